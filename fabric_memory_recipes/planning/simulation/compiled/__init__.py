"""Fast mode's compiled blocks in the simulated step: what inductor's graphs keep for backward."""

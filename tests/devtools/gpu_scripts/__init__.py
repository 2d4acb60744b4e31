"""scripts/gpu/*.sh on a CPU: their syntax, the preamble they share, their dry runs."""

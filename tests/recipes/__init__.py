"""recipes/ and run_all.sh: every recipe runs end to end on a CPU, and the ladder runs as a whole."""

"""fmr-estimate --model SOURCE:NAME: the estimate for the user's model (estimate.py), its fitting technique sets (sets.py), measured on a GPU (measure.py), and their command line (cli.py)."""

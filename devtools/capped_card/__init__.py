"""What the GPU proofs of the planner and the estimate share about runs on an emulated card (--memory-budget-gb): the table of predicted against measured and its targets (fit_table.py)."""

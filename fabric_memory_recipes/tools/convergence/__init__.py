"""fmr-convergence: every rung's accuracy on real digits against fp32 (benchmark.py), its report (report.py) and figure (figure.py)."""

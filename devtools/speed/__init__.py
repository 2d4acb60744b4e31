"""Where a rung's step time goes, on a GPU (python -m devtools.speed.NAME): rung 11's offload hooks, rung 15's profile."""

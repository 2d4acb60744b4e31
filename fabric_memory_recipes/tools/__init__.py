"""Command-line tools: `python -m fabric_memory_recipes.tools.<name>` (some also as `fmr-*` console scripts)."""

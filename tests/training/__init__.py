"""fabric_memory_recipes/training/: the loop, the step, fast mode, the data, the flags, the multi-process path."""

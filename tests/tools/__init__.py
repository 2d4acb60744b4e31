"""fabric_memory_recipes/tools/: the reference comparison and the convergence benchmark."""

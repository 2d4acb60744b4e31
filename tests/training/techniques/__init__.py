"""fabric_memory_recipes/training/techniques/ and the rungs that use them."""

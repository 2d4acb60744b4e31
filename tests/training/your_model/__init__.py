"""fabric_memory_recipes/training/your_model/: the your-model runner's models, how they are built and their compiled graphs."""

"""fabric_memory_recipes/training/your_model/: the your-model runner's models and their compiled graphs."""

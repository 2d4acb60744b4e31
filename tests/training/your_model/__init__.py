"""fabric_memory_recipes/training/your_model/: models built for the your-model runner."""

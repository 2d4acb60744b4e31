"""fabric_memory_recipes/measurement/: what a run measures and records, and the report rendered from it."""

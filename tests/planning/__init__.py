"""fabric_memory_recipes/planning/: the estimator, the planner and the advice for a user's own model."""

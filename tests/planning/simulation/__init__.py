"""fabric_memory_recipes/planning/simulation/: the simulated step, its gradient sums, and the allocator replays."""

"""The measurement layer: what a run records (results JSON, peaks, step times, whole-device memory),
the profiling of its first steps, and the report rendered from results folders."""

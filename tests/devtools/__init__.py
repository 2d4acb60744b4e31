"""devtools/ and scripts/: the proof tools and the GPU scripts, on a CPU."""

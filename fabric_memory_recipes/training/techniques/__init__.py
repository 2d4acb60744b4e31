"""The memory techniques a rung adds beside the loop, one module each, shared by the ladder's recipes and the
your-model runner: activation checkpointing, activation offloading, the step inside backward, 8-bit optimizer
state, compensated bf16 updates, weights on the CPU, fused attention, float8 and the LLM toggles."""

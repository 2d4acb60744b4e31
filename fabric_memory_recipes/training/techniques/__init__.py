"""The memory techniques a rung adds beside the loop: compensated bf16 updates, activation offloading, weights on the CPU, fused attention, float8 and the LLM toggles."""

"""The training layer: flags, data, models, the one training loop and its fast path (CUDA graphs),
checkpoints and fault handling, and the techniques that live in shared code (offload, bf16 updates)."""

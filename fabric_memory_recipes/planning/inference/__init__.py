"""Inference: generate() and forward passes on fake tensors, the estimate, --infer --fit, and the GPU check."""

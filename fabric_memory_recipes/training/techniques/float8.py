"""Rung 15's ``--float8``: the model's linear layers train with float8 matrix products (torchao).

``torchao.float8.convert_to_float8_training`` swaps each chosen ``nn.Linear`` for a ``Float8Linear``:
its weight stays in the run's dtype (bf16 here), and each matrix product - forward and both of the
backward's - casts its two operands to float8 with one scale per tensor ("tensorwise": the tensor's
largest magnitude, found on the GPU) and runs on the float8 tensor cores, twice the bf16 peak on an
H100. The casts are extra passes over the operands; ``torch.compile`` fuses them into the kernels
around the products. Whether the faster products outweigh the casts depends on the shapes: this flag
exists to measure it at the rung's batch.

Which layers: every ``nn.Linear`` whose two dimensions are multiples of 16 (the float8 kernel's
requirement), except the classification head (10 outputs; and a head is usually left in high
precision). Needs a GPU with float8 tensor cores (compute capability 8.9: Ada, Hopper or later).
"""

from __future__ import annotations

import torch
from torch import nn

from fabric_memory_recipes.config import UsageError

HEAD_NAMES = ("heads.head", "head")


def eligible(module: nn.Module, name: str) -> bool:
    """The ``module_filter_fn`` torchao asks for each module: convert this one?"""
    return (
        isinstance(module, nn.Linear)
        and name not in HEAD_NAMES
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert(model: nn.Module, device) -> int:
    """Convert ``model``'s eligible linear layers to float8 training in place; returns how many.

    Raises :class:`UsageError` (one line, exit 2) when torchao is missing or ``device`` has no float8
    tensor cores. Call it after the weights are loaded and before ``torch.compile``."""
    if getattr(device, "type", str(device)) != "cuda":
        raise UsageError("--float8 needs a CUDA GPU with float8 tensor cores (compute capability >= 8.9)")
    if torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise UsageError(f"--float8: {name} has no float8 tensor cores (compute capability >= 8.9 needed)")
    return convert_modules(model)


def convert_modules(model: nn.Module) -> int:
    """The swap itself, with no device check (the tests look at which layers it converts on a CPU)."""
    try:
        from torchao.float8 import convert_to_float8_training  # optional: only --float8 needs it
    except ImportError:
        raise UsageError('--float8 needs torchao: python3 -m pip install -e ".[lowbit]"') from None
    chosen = [name for name, module in model.named_modules() if eligible(module, name)]
    convert_to_float8_training(model, module_filter_fn=eligible)
    return len(chosen)

"""The memory techniques a rung adds beside the loop, one module each, shared by the ladder's recipes and the
your-model runner: activation checkpointing, activation offloading, the step inside backward, 8-bit optimizer
state, compensated bf16 updates, weights on the CPU, fused attention, float8, the fused loss and the LLM
toggles; in ``inference/``, int8 weights for inference. Each is named by its record (``fabric_memory_recipes/techniques.py``): :func:`module_of` finds it."""

from __future__ import annotations

import importlib
from types import ModuleType


def module_of(technique) -> ModuleType:
    """The module of a technique's record (``Technique.module``): what generic code calls, such as the
    estimate applying a switched technique (``apply``) without naming it."""
    return importlib.import_module(f"{__name__}.{technique.module}")


def refusal_of(technique, model) -> str | None:
    """Why the technique's module cannot apply to ``model`` (its ``refusal(model)``: the fused loss's for a
    model without a plain output projection), or None when it can or its module refuses nothing."""
    refusal = getattr(module_of(technique), "refusal", None)
    return refusal(model) if refusal is not None else None

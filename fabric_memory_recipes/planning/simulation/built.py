"""What a run built, read for its estimate: the blocks it checkpointed and the optimizer it made.

A rung's technique is declared in its ``RUNG`` for the estimators that never run it (the planner, the
predicted ladder, the check of older results read it from the source: ``declarations.declared_rung``). The
estimate a run records (``simulate.for_run``) reads the model and the optimizer the run's code built
instead, so a recipe does not tell it a second time and a change to the code is what it predicts;
tests/recipes/test_recipes.py checks that every rung's declaration is what its code builds.

What cannot be read from the built objects stays declared: activation offload is a context around the
forward pass, the step inside backward and rung 16's streamed weights are hooks made after the estimate,
and a sharding strategy wraps the blocks when ``fabric.setup`` runs, after it too.
"""

from __future__ import annotations

from typing import Any

import torch

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.planning.plan import CHECKPOINT_WRAPPERS

# optimizer classes by name (torchao's is matched by name: an optional dependency) -> the Plan's name
OPTIMIZER_NAMES = {"Adam": "adam", "AdamW": "adamw", "AdamW8bit": "adamw8bit", "SGD": "sgd"}


def checkpointed_blocks(model: torch.nn.Module) -> tuple[str, ...]:
    """The classes of the modules that a checkpoint wrapper (rung 10's ``CheckpointedBlock``, torch's
    ``CheckpointWrapper``) runs under activation checkpointing."""
    return tuple(
        sorted(
            {
                type(child).__name__
                for module in model.modules()
                if type(module).__name__ in CHECKPOINT_WRAPPERS
                for child in module.children()
            }
        )
    )


def optimizer_technique(optimizer: Any) -> dict[str, str]:
    """``optimizer`` and ``optimizer_impl`` of a plan, from a built optimizer; {} for one the estimator
    does not model (the declaration stands)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # fabric.setup wraps it
    name = OPTIMIZER_NAMES.get(type(opt).__name__)
    if name is None:
        return {}
    if name == "sgd" and opt.defaults.get("momentum"):
        name = "sgd-momentum"
    found = {"optimizer": name}
    if "fused" in opt.defaults:  # torch's own: fused, foreach, or its default (foreach for CUDA tensors)
        if opt.defaults["fused"]:
            found["optimizer_impl"] = "fused"
        elif opt.defaults.get("foreach") or (opt.defaults.get("foreach") is None and _on_cuda(opt)):
            found["optimizer_impl"] = "foreach"
        else:
            found["optimizer_impl"] = "for-loop"
    return found


def _on_cuda(opt: torch.optim.Optimizer) -> bool:
    return all(p.is_cuda for group in opt.param_groups for p in group["params"])


def built_technique(model: torch.nn.Module, cfg: RunConfig, optimizer: Any = None) -> dict[str, Any]:
    """The plan fields read from what the run built: the checkpointed blocks (unless a sharding strategy
    wraps them later, at ``fabric.setup``) and, when given, the optimizer."""
    found: dict[str, Any] = {}
    if cfg.sharding == "none":
        found["activation_checkpointing"] = checkpointed_blocks(model)
    if optimizer is not None:
        found.update(optimizer_technique(optimizer))
    return found

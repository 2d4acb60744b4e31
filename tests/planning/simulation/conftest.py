"""What the allocator tests share: one training step's requests written as allocator events, and a small
MLP's step simulated under a plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric_memory_recipes import planning

MiB = 1 << 20


@pytest.fixture
def one_step_events() -> tuple[list, dict[str, int]]:
    """Weights (30 MiB), the optimizer state (60 MiB, made at the first step's update), then a step: a
    50 MiB activation that backward frees, 20 MiB of gradients freed after the update; the marks say where
    the state, the step, the update and the end begin."""
    events = [("alloc", 0, 30 * MiB), ("alloc", 1, 60 * MiB)]
    events += [("alloc", 2, 50 * MiB), ("free", 2, 0), ("alloc", 4, 20 * MiB), ("free", 4, 0)]
    return events, {"state": 1, "step": 2, "update": 5, "end": 6}


@pytest.fixture
def simulate_mlp():
    """``simulate_mlp(plan)``: the simulated step of a 1024-4096-1024 MLP on a micro-batch of 512 rows
    (32-bit; the loss: the mean square of its output) under ``plan``."""

    def simulate(plan: planning.Plan) -> planning.Estimate:
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
        return planning.simulate(
            model,
            plan,
            make_batch=lambda: (torch.empty(512, 1024),),
            batch_fn=lambda m, b: (m(b[0]).pow(2).mean(),),
        )

    return simulate

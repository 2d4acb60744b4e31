"""fabric_memory_recipes.planning.simulation.built: the estimate a run records reads the technique from what it built."""

from __future__ import annotations

import pytest
import torch

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.planning.simulation.built import (
    built_technique,
    checkpointed_blocks,
    optimizer_technique,
)
from fabric_memory_recipes.planning.simulation.simulate import for_run
from fabric_memory_recipes.training import models
from fabric_memory_recipes.training.techniques.checkpointing import CheckpointedBlock


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


def _params():
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: torch.optim.Adam(p, fused=True), {"optimizer": "adam", "optimizer_impl": "fused"}),
        (lambda p: torch.optim.AdamW(p, foreach=True), {"optimizer": "adamw", "optimizer_impl": "foreach"}),
        (lambda p: torch.optim.Adam(p), {"optimizer": "adam", "optimizer_impl": "for-loop"}),  # CPU tensors
        (lambda p: torch.optim.SGD(p, lr=0.1), {"optimizer": "sgd", "optimizer_impl": "for-loop"}),
        (
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
            {"optimizer": "sgd-momentum", "optimizer_impl": "fused"},
        ),
        (lambda p: torch.optim.RMSprop(p), {}),  # not modelled: the declaration stands
    ],
)
def test_the_optimizer_is_read_from_the_built_one(make, expected):
    assert optimizer_technique(make(_params())) == expected


def test_checkpointed_blocks_are_the_wrapped_classes():
    model = torch.nn.Sequential(CheckpointedBlock(Block()), Block())
    assert checkpointed_blocks(model) == ("Block",)
    assert checkpointed_blocks(torch.nn.Sequential(Block())) == ()


def test_a_sharding_strategy_keeps_the_declared_checkpoints():
    """FSDP wraps the blocks at fabric.setup, after the estimate: the model shows none yet."""
    model = torch.nn.Sequential(Block())
    assert built_technique(model, RunConfig(activation_checkpointing=("Block",))) == {
        "activation_checkpointing": ()
    }
    assert "activation_checkpointing" not in built_technique(
        model, RunConfig(activation_checkpointing=("Block",), sharding="fsdp")
    )


def test_the_recorded_estimate_follows_the_code_not_the_declaration():
    """A recipe that builds SGD while its configuration still says Adam is estimated with SGD."""
    model = models.build_model("vit_tiny", None)
    cfg = RunConfig(recipe="test", model="vit_tiny", accelerator="cpu", batch_size=2, optimizer="adam")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with_sgd, declared = for_run(model, cfg, sgd), for_run(model, cfg)
    assert with_sgd.error is None and with_sgd.plan.optimizer == "sgd" and declared.plan.optimizer == "adam"
    assert with_sgd.static_gb["optimizer_state"] == 0 < declared.static_gb["optimizer_state"]

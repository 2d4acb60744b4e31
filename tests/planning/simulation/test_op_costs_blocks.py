"""The op-cost collector marks the ops a repeated block runs (planning/simulation/costs.py: forward, recompute
and the backward nodes its forward made), and fast mode fuses only those (micro_batch_time.py): the loss and
whatever runs outside the compiled blocks are priced as in eager mode."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from fabric_memory_recipes import planning
from fabric_memory_recipes.planning.simulation.costs import OpCosts
from fabric_memory_recipes.planning.your_model import step_time
from fabric_memory_recipes.planning.your_model.micro_batch_time import MicroBatch
from tests.planning.your_model.test_step_time import Block


class Net(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList([Block(width, pointwise=2) for _ in range(2)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return torch.tanh(self.head(x))  # a pointwise op outside the blocks


def collected(checkpointed: bool, blocks: tuple[str, ...] = ("Block",)) -> OpCosts:
    collector = OpCosts(blocks)
    plan = planning.Plan(
        device="cpu",
        optimizer_impl="foreach",
        micro_batch_size=8,
        activation_checkpointing=("Block",) if checkpointed else (),
    )
    planning.simulate(
        Net(),
        plan,
        make_batch=lambda: (torch.empty(8, 64),),
        batch_fn=lambda m, b: (m(b[0]).pow(2).mean(),),
        op_costs=collector,
    )
    return collector


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_ops_of_the_blocks_are_marked_in_forward_recompute_and_backward(checkpointed):
    ops = [o for o in collected(checkpointed).of(0) if o.kernels]
    inside = [o for o in ops if o.in_block]
    # each block: a linear (a matmul forward, its recompute when checkpointed, two in backward: input and
    # weight) and its sigmoids
    assert sum(o.matmul and not o.backward for o in inside) == 2
    assert sum(o.matmul and o.recompute for o in inside) == (2 if checkpointed else 0)
    assert sum(o.matmul and o.backward and not o.recompute for o in inside) == 4
    assert any(o.name == "sigmoid" for o in inside) and any(o.backward and o.name != "mm" for o in inside)
    outside = [o for o in ops if not o.in_block]
    names = {o.name for o in outside}
    assert {"tanh", "pow", "mean", "addmm"} <= names  # the head, its tanh and the loss
    assert "sigmoid" not in names and not any(o.recompute for o in outside)
    assert any(o.backward and o.name == "tanh_backward" for o in outside)


def test_no_blocks_named_marks_nothing():
    assert not any(o.in_block for o in collected(False, ()).of(0))


def test_fast_mode_fuses_the_blocks_memory_ops_alone():
    collector = collected(False)
    micro = MicroBatch.of(collector.of(0), collector.module_calls(0))
    c = dataclasses.replace(step_time.ceilings("h100")[0], fusion=1e-9)
    memory = ~micro.matmul & (micro.kernels > 0)
    assert memory[micro.in_block].any() and memory[~micro.in_block].any()
    unfused = micro.bytes / c.bandwidth + micro.kernels * MicroBatch.kernel_s(c, "fast", True)
    matmuls = np.maximum(micro.flops / c.matmul_flops, micro.bytes / c.bandwidth)
    matmuls += micro.kernels * MicroBatch.kernel_s(c, "fast", True)
    expected = matmuls[micro.matmul].sum() + unfused[memory & ~micro.in_block].sum()
    assert micro.seconds(c, "fast", graphs=True) == pytest.approx(expected, rel=1e-6)
    # blocks not compiled (fast mode's graphs alone): every memory-bound op at its bytes and launch
    assert micro.seconds(c, "fast", graphs=True, fused=False) == pytest.approx(
        matmuls[micro.matmul].sum() + unfused[memory].sum(), rel=1e-6
    )

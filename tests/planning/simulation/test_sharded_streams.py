"""FSDP's gradients and all-gather outputs on their own streams in the simulated step
(planning/simulation/sharded.py), and the allocator models' pools for those streams."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric_memory_recipes import planning
from fabric_memory_recipes.planning.simulation import simulate as simulation
from fabric_memory_recipes.planning.simulation.allocator import (
    ALLOC_GATHER,
    ALLOC_REDUCE,
    ALLOC_SHARD,
    REDUCE,
    CachingAllocator,
    replay,
)
from fabric_memory_recipes.planning.simulation.expandable import ExpandableAllocator

MIB = 1 << 20
WIDTH, UNITS, BATCH = 1024, 4, 512  # each unit 4 MiB of fp32 weights


class Units(nn.Module):
    """``UNITS`` Linear blocks (the FSDP units) and a root head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False)) for _ in range(UNITS))
        self.head = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _step(monkeypatch, sharding: str, cpu_offload: bool = False, precision: str = "32-true"):
    """(estimate, events, marks) of one simulated step over 2 ranks, each Sequential an FSDP unit."""
    caught = {}
    replays = simulation.peaks_reserved

    def keep(events, marks, *args, **kwargs):
        caught["events"], caught["marks"] = list(events), dict(marks)
        return replays(events, marks, *args, **kwargs)

    monkeypatch.setattr(simulation, "peaks_reserved", keep)
    plan = planning.Plan(
        device="cuda",
        precision=precision,
        micro_batch_size=BATCH,
        optimizer="adam",
        sharding=sharding,
        shard_units=("Sequential",),
        world_size=2,
        cpu_offload=cpu_offload,
        mixed_precision_policy=sharding == "fsdp2" and precision.endswith("-mixed"),
    )
    est = planning.simulate(
        Units(),
        plan,
        make_batch=lambda: (torch.empty(BATCH, WIDTH),),
        batch_fn=lambda m, b: (m(b[0]).float().pow(2).mean(),),
    )
    return est, caught["events"], caught["marks"]


def test_fsdp2_keeps_each_units_gradient_shard_on_the_reduce_scatter_stream(monkeypatch):
    """One fp32 shard per unit (and the root), 1/2 of its gradients, made on the reduce-scatter stream; the
    replay keeps their memory with that stream, where the next step's forward cannot reuse it."""
    est, events, marks = _step(monkeypatch, "fsdp2")
    shards = [n for kind, _, n in events if kind == ALLOC_REDUCE]
    unit = WIDTH * WIDTH * 4 // 2
    assert shards == [unit] * (UNITS + 1)  # the units and the root (the head)
    allocator = replay(events, marks)
    assert allocator.reserved_by_stream[REDUCE] >= sum(shards)
    assert est.components_gb["gradients"] > 0


def test_fsdp2_cpu_offload_drops_each_shard_before_the_next_is_made(monkeypatch):
    """CPUOffloadPolicy: the shard is copied to the host and freed at once, so one shard's memory serves them
    all; the gradients cost nothing on the GPU between steps."""
    est, events, marks = _step(monkeypatch, "fsdp2", cpu_offload=True)
    made = [h for kind, h, _ in events if kind == ALLOC_REDUCE]
    freed = {h for kind, h, _ in events if kind == "free"}
    assert len(made) == UNITS + 1 and set(made) <= freed
    assert replay(events, marks).reserved_by_stream[REDUCE] == 20 * MIB  # one 20 MiB segment for 2 MiB shards
    assert est.static_gb["gradients"] == 0


def test_fsdp2_all_gather_outputs_reserve_their_own_stream_and_mixed_precision_casts(monkeypatch):
    """The all-gather outputs get segments of their own stream (allocated and freed: the gathered units count
    as allocated once); under bf16-mixed with the policy the reduce-scatter's bf16 output precedes the fp32
    shard on the reduce-scatter stream."""
    _, events, _ = _step(monkeypatch, "fsdp2")
    gathered = [n for kind, _, n in events if kind == ALLOC_GATHER]
    assert gathered == [WIDTH * WIDTH * 4, 2 * WIDTH * WIDTH * 4]  # the root's, then two units'
    _, events, _ = _step(monkeypatch, "fsdp2", precision="bf16-mixed")
    reduced = [n for kind, _, n in events if kind == ALLOC_REDUCE]
    assert reduced[:2] == [WIDTH * WIDTH * 2 // 2, WIDTH * WIDTH * 4 // 2]  # bf16 output, then the fp32 shard


def test_fsdp1_cpu_offload_keeps_its_gradient_shards_on_the_post_backward_stream_to_the_end_of_backward(
    monkeypatch,
):
    """FSDP1 with CPU offload: each unit's fp32 gradient shard is made on the post-backward stream and kept
    there until the end of backward, so the stream reserves them all; the compute stream's freed blocks
    (the loss's, the activations') cannot hold them, and the replay reserves more than on one stream."""
    est, events, marks = _step(monkeypatch, "fsdp", cpu_offload=True, precision="bf16-mixed")
    shards = [(h, n) for kind, h, n in events if kind == ALLOC_REDUCE and n == WIDTH * WIDTH * 4 // 2]
    assert len(shards) == UNITS + 1  # the units and the root
    frees = [i for i, (kind, h, _) in enumerate(events) if kind == "free" and h in dict(shards)]
    assert min(frees) > max(h for h, _ in shards)  # none freed before the last is made
    allocator = replay(events, marks)
    assert allocator.reserved_by_stream[REDUCE] >= sum(n for _, n in shards)
    merged = replay([("alloc" if kind.startswith("alloc") else kind, h, n) for kind, h, n in events], marks)
    assert allocator.peak_reserved > merged.peak_reserved
    assert est.static_gb["gradients"] == 0


def test_fsdp1_gathers_on_its_unshard_stream_and_casts_shards_on_another(monkeypatch):
    """FSDP1's gathered units (the root and two units, allocated) and one more unit and root (reserved) on
    the unshard stream; under mixed precision each low-precision shard, with offload its fp32 copy from the
    host, on the low-precision shard stream."""
    unit = WIDTH * WIDTH * 2
    _, events, _ = _step(monkeypatch, "fsdp", cpu_offload=True, precision="bf16-mixed")
    assert [n for kind, _, n in events if kind == ALLOC_GATHER] == [unit] * 5
    assert [n for kind, _, n in events if kind == ALLOC_SHARD] == [unit // 2, unit, unit // 2, unit]
    _, events, _ = _step(monkeypatch, "fsdp", precision="bf16-mixed")
    assert [n for kind, _, n in events if kind == ALLOC_SHARD] == [unit // 2, unit // 2]


@pytest.mark.parametrize("model", [CachingAllocator, ExpandableAllocator])
def test_a_side_streams_freed_blocks_are_not_reused_by_the_compute_stream(model):
    """Both allocator models give FSDP2's side streams pools of their own."""
    allocator = model()
    allocator.run([(ALLOC_REDUCE, 0, 8 * MIB), ("free", 0, 0), ("alloc", 1, 8 * MIB)])
    assert allocator.peak_reserved == 40 * MIB  # a 20 MiB page or segment for each stream
    allocator.run([(ALLOC_GATHER, 2, 8 * MIB)])
    assert allocator.peak_reserved == 60 * MIB

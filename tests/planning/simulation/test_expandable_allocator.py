"""fabric_memory_recipes.planning.simulation.expandable: the caching allocator under expandable segments on
hand-written requests (reserved derived by hand, unlike the default allocator's), fast mode's order with its
CUDA graph's private pool, committed GPU traces replayed to what the runs with expandable segments
reserved, and which runs the estimates replay that way."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import tarfile

import pytest
import torch
from torch import nn

from fabric_memory_recipes import planning
from fabric_memory_recipes.config import FAST_ALLOCATOR, Hardware
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.planning.check import recorded_allocator
from fabric_memory_recipes.planning.plan import allocator_of, expandable_in, plan_for
from fabric_memory_recipes.planning.simulation import simulate as simulate_module
from fabric_memory_recipes.planning.simulation.allocator import CachingAllocator, replay
from fabric_memory_recipes.planning.simulation.expandable import (
    GRAPH,
    MAIN,
    ExpandableAllocator,
    replay_graphs,
    replay_recorded_expandable,
)
from fabric_memory_recipes.training.your_model import runner
from tests.conftest import REPO
from tests.planning.simulation.conftest import MiB

PUBLISHED = REPO / "results/published/h100"


def test_a_segment_grows_by_20_mib_pages_and_tiles_what_the_default_allocator_strands():
    """Weights, three 12 MiB activations freed by backward, then a 36 MiB optimizer state. The default
    allocator gives each activation a segment of its own (requests of 10 MiB or more) and none of the three
    freed ones holds the state: 100 + 3 x 12 + 36 = 172 MiB. Expandable segments map 20 MiB pages at the
    end of one segment: the weights fill pages 0-4; a1 maps page 5 (8 MiB left); a2 takes those 8 MiB and
    maps page 6; a3 fits the remaining 16; the three merge into one free 40 MiB block when freed, and the
    state fits it: 140 MiB, never more."""
    sizes = {"w": 100, "a1": 12, "a2": 12, "a3": 12}
    runs = []
    for allocator in (CachingAllocator(), ExpandableAllocator()):
        for handle, mib in sizes.items():
            allocator.malloc(handle, mib * MiB)
        for handle in ("a1", "a2", "a3"):
            allocator.free(handle)
        allocator.malloc("state", 36 * MiB)
        runs.append(allocator)
    default, expandable = runs
    assert default.peak_reserved == 172 * MiB and default.peak_allocated == 136 * MiB
    assert expandable.peak_reserved == 140 * MiB and expandable.peak_allocated == 136 * MiB


def test_empty_cache_unmaps_whole_free_pages_inside_a_segment_in_use_and_the_lowest_hole_refills_first():
    """x (30 MiB) maps pages 0-1; y (5 MiB) fits the 10 MiB left in page 1. With x freed, ``empty_cache``
    unmaps page 0 alone (page 1 still holds y): 20 MiB reserved. A 20 MiB request then maps page 0 again
    (the lowest unmapped range that, with the free 10 MiB after it, holds it), not a page at the end."""
    a = ExpandableAllocator()
    a.malloc("x", 30 * MiB)
    a.malloc("y", 5 * MiB)
    assert a.reserved == 40 * MiB
    a.free("x")
    a.empty_cache()
    assert a.reserved == 20 * MiB
    a.malloc("z", 20 * MiB)
    assert a.reserved == 40 * MiB and a.peak_reserved == 40 * MiB


def test_small_requests_map_2_mib_pages_and_split_any_remainder():
    a = ExpandableAllocator()
    a.malloc("s", 100)  # rounded to 512 bytes, a 2 MiB page of the small pool
    a.malloc("m", 3 * MiB)  # a 20 MiB page of the large pool; the 17 MiB left is split off
    a.malloc("n", 17 * MiB - 512)  # fits it, leaving 512 bytes: split again (the default allocator would not)
    assert (a.reserved, a.allocated) == (22 * MiB, 20 * MiB)


def test_fast_modes_capture_allocates_from_its_own_pool_after_the_warm_up_gave_its_pages_back(
    one_step_events,
):
    """Weights (30 MiB), optimizer state (60), a step of a 50 MiB activation and 20 MiB of gradients.
    Default stream: the weights, 2 pages (40 MiB). Warm-up step 1, side stream: the activation maps 3 pages
    (100), the gradients take its first 20 MiB; ``empty_cache`` before the first optimizer step unmaps the
    2 free pages behind them (60); the state maps 3 pages at [20, 80) (120). Step 2: the freed gradients'
    page cannot hold the activation: 3 more pages at the end (180, the peak), the gradients back in their
    page. ``empty_cache`` before the capture leaves the weights and the state (40 + 60); the captured step
    maps 3 pages of its own pool."""
    events, marks = one_step_events
    graphs = replay_graphs(events, marks)
    assert graphs.peak_reserved == 180 * MiB
    assert graphs.mapped == {MAIN: 100 * MiB, GRAPH: 60 * MiB}
    assert replay(events, marks).peak_reserved == 140 * MiB  # the default allocator's eager steps


def snapshot_of(name: str) -> dict:
    """One of the committed allocator histories of your model (``--snapshot``: the default allocator)."""
    with tarfile.open(PUBLISHED / "reserved-snapshots/reserved-snapshots.tgz") as tar:
        data = tar.extractfile(f"reserved-snapshots/{name}/your_model-{name}-snapshot.pickle.gz").read()
    with gzip.open(io.BytesIO(data)) as f:
        return pickle.load(f)


@pytest.mark.parametrize(
    "name, unrecorded",
    [
        ("llama-fast", "your-model-speed/lm/your_model-llama-fast-fused-ckpt-mb8-r1.json"),
        ("neox-fast", "your-model-speed/lm/your_model-neox-fast-fused-ckpt-mb8-r1.json"),
    ],
)
def test_a_recorded_runs_requests_under_expandable_segments_reserve_what_its_unrecorded_run_did(
    name, unrecorded
):
    """The same set, same code, same day: recorded with ``--snapshot`` (no CUDA graphs, the default
    allocator: 7.81 GB reserved for the Llama) and not (fast mode's expandable segments: 6.40 GB). The
    recorded requests replayed under expandable segments reserve the unrecorded run's peak, to the byte."""
    run = json.loads((PUBLISHED / unrecorded).read_text())
    assert expandable_in(run["provenance"]["cuda_alloc_conf"])
    assert replay_recorded_expandable(snapshot_of(name)).peak_reserved == round(
        run["memory"]["peak_reserved_gb"] * 1e9
    )


def test_an_estimate_carries_every_settings_replay_and_reserves_its_plans(simulate_mlp):
    est = simulate_mlp(planning.Plan(micro_batch_size=512, allocator="expandable"))
    assert set(est.reserved_by_allocator) == {"default", "expandable", "graphs"}
    assert est.reserved_gb == est.reserved_by_allocator["expandable"]
    assert est.to_dict()["assumptions"]["allocator"] == "expandable"


def test_the_replay_follows_the_runs_allocator_setting(monkeypatch):
    """Fast mode on one GPU captures CUDA graphs and sets expandable segments; eager mode, several GPUs and
    the allocator's recording keep the default; a runner that leaves the graphs out after fast mode chose
    them (a text model) keeps the segments: the estimate says which from the configuration, a run from its
    own environment, a committed run from its provenance."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # checked() sets it in fast mode
    rung, _ = declared_rung("04_lower_batch_size")
    hardware = Hardware.planned()
    assert plan_for(rung.with_flags(accelerator="cuda").checked(hardware)).allocator == "graphs"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == FAST_ALLOCATOR
    for flags in ({"mode": "eager"}, {"devices": 2}, {"snapshot": True}, {"cuda_graphs": False}):
        assert plan_for(rung.with_flags(accelerator="cuda", **flags).checked(hardware)).allocator == "default"
    assert plan_for(rung.with_flags(accelerator="cuda")).allocator == "graphs"  # unchecked: fast by default
    assert plan_for(rung.with_flags(accelerator="cpu")).allocator == "default"
    text = runner.default_config().with_flags(accelerator="cuda", cuda_graphs=False, mode="fast")
    assert allocator_of(text) == "default" and allocator_of(text, expandable=True) == "expandable"

    seen = []

    def simulate(model, plan, **_):
        seen.append(plan.allocator)
        return simulate_module.failed(plan, "stand-in", "not simulated")

    monkeypatch.setattr(simulate_module, "simulate", simulate)
    for conf, allocator in ((FAST_ALLOCATOR, "graphs"), ("", "default")):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        simulate_module.for_run(nn.Linear(2, 2), rung.with_flags(accelerator="cuda", cuda_graphs=True))
        assert seen.pop() == allocator

    runs = {
        "ladder/04_lower_batch_size.json": "graphs",  # fast mode, CUDA graphs
        "your-model-speed/lm/your_model-llama-fast-fused-ckpt-mb8-r1.json": "expandable",  # text: no graphs
        "estimate/eager/04_lower_batch_size.json": "default",  # recorded before fast mode
        "ladder/16_weights_on_cpu.json": "default",  # eager
    }
    for path, allocator in runs.items():
        result = json.loads((PUBLISHED / path).read_text())
        own = (
            runner.default_config()
            if result["recipe"] == "your_model"
            else declared_rung(result["recipe"])[0]
        )
        cfg = own.with_flags(accelerator="cuda")
        assert recorded_allocator(result, cfg) == allocator, path


def test_offload_holds_a_window_of_copies_per_side_stream_inside_the_captured_step():
    """training/techniques/offload.py keeps up to a window of copies waiting on its "out" stream and
    prefetches up to another on its "in" stream (what still waits when backward starts is used in place):
    the simulation holds two windows. Fast mode makes them inside each step, so the capture's pool holds
    them, not the main pool: weights (2 pages) stay in the main pool; the pool maps the 16 MiB of copies
    and the 10 MiB activation behind them (2 pages)."""
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    args = dict(make_batch=lambda: (torch.empty(64, 256),), batch_fn=lambda m, b: (m(b[0]).pow(2).mean(),))
    peak = {}
    for window in (0, 8 * MiB):
        plan = planning.Plan(activation_offload=True, offload_window_bytes=window, offload_min_bytes=0)
        peak[window] = planning.simulate(model, plan, **args).peak_gb
    assert peak[8 * MiB] - peak[0] == pytest.approx(2 * 8 * MiB / 1e9)

    events = [("alloc", 0, 30 * MiB), ("alloc", 1, 16 * MiB), ("alloc", 2, 10 * MiB), ("free", 2, 0)]
    marks = {"workspace": 1, "window": 1, "state": 2, "step": 2, "update": 4, "end": 4}
    graphs = replay_graphs(events, marks)
    assert graphs.mapped == {MAIN: 40 * MiB, GRAPH: 40 * MiB} and graphs.peak_reserved == 80 * MiB

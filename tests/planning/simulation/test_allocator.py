"""fabric_memory_recipes.planning.simulation.allocator: the caching allocator's rules on small cases, a committed
allocator trace of a real H100 run replayed to the byte, and what the replay adds to an estimate."""

from __future__ import annotations

import gzip
import pickle

import pytest
import torch
from torch import nn

from fabric_memory_recipes import planning
from fabric_memory_recipes.planning import reserved
from fabric_memory_recipes.planning.planner import calibration
from fabric_memory_recipes.planning.simulation.allocator import (
    COPY,
    RESIDUAL,
    CachingAllocator,
    replay,
    replay_recorded,
)
from fabric_memory_recipes.planning.simulation.cache import SimulationCache
from fabric_memory_recipes.planning.your_model import estimate
from tests.conftest import REPO
from tests.planning.simulation.conftest import MiB

TRACE = REPO / "results/published/h100/snapshot/05_gradient_accumulation-snapshot.pickle.gz"


def test_small_requests_share_2_mib_segments_and_large_ones_get_20_mib_or_their_size():
    a = CachingAllocator()
    a.malloc("x", 100)  # rounded to 512 bytes, in a 2 MiB small segment
    a.malloc("y", 1000)
    assert (a.allocated, a.reserved) == (512 + 1024, 2 * MiB)
    a.malloc("m", 3 * MiB)  # 1 MiB < request < 10 MiB: a 20 MiB segment, split
    a.malloc("n", 5 * MiB)  # fits the 17 MiB remainder
    assert a.reserved == 22 * MiB
    a.malloc("big", 13 * MiB + 1)  # > the 12 MiB left, >= 10 MiB: its own segment, rounded up to 2 MiB
    assert a.reserved == 22 * MiB + 14 * MiB


def test_best_fit_splitting_and_merging_decide_what_is_reserved():
    a = CachingAllocator()
    a.malloc("a", 40 * MiB)
    a.malloc("b", 40 * MiB)
    a.free("a")
    a.malloc("c", 30 * MiB)  # best fit: a's 40 MiB block, split (10 MiB > 1 MiB stays free)
    assert a.reserved == 80 * MiB
    a.malloc("d", 11 * MiB)  # the 10 MiB remainder is too small: a new 12 MiB segment, 1 MiB not split
    assert a.reserved == 92 * MiB
    a.free("c")  # c merges with the 10 MiB remainder behind it: a 40 MiB free block again
    a.malloc("e", 40 * MiB)
    assert a.reserved == 92 * MiB and a.peak_allocated == 40 * MiB + 40 * MiB + 12 * MiB
    a.malloc("f", 40 * MiB + 512)  # nothing cached is large enough: reserved grows
    assert a.reserved == 92 * MiB + 42 * MiB


def test_a_remainder_of_1_mib_or_less_stays_with_the_block():
    a = CachingAllocator()
    a.malloc("a", 12 * MiB)
    a.free("a")
    a.malloc("b", 11 * MiB)  # 1 MiB left: not split (large pool: more than 1 MiB is)
    assert a.allocated == 12 * MiB
    a.malloc("c", 100)  # the small pool never takes from the large one
    assert a.reserved == 12 * MiB + 2 * MiB


def test_a_stream_reuses_only_the_blocks_it_freed_itself():
    """Segments belong to the stream that made them: a block another stream freed is never handed out."""
    a = CachingAllocator()
    a.malloc("weights", 24 * MiB, COPY)  # a streamed block's copy, on the copy stream
    a.free("weights")
    a.malloc("activation", 24 * MiB)  # the compute stream: a segment of its own
    assert a.reserved == 48 * MiB and a.reserved_by_stream == {COPY: 24 * MiB, "compute": 24 * MiB}
    a.free("activation")
    a.malloc("next weights", 24 * MiB, COPY)  # the copy stream takes back its own block
    assert a.reserved == 48 * MiB


def test_a_block_freed_after_record_stream_is_freed_at_once_but_reused_only_later():
    """``record_stream``: torch.cuda.memory_allocated drops at the free, but the block goes back to its
    pool only once the other stream has run past it; until then a request of its size needs a new segment."""
    a = CachingAllocator()
    a.malloc("unit 1", 24 * MiB, COPY)
    a.free_later("unit 1")
    assert a.allocated == 0
    a.malloc("unit 2", 24 * MiB, COPY)
    assert a.reserved == 48 * MiB
    a.reuse("unit 1")  # the compute stream's kernels that read it have run
    a.malloc("unit 3", 24 * MiB, COPY)
    assert a.reserved == 48 * MiB and a.peak_allocated == 48 * MiB


def test_a_committed_h100_trace_replays_to_the_segments_the_gpu_reserved():
    """The allocator's own record of a real run (rung 05, ViT-L/16, H100, torch 2.11; recorded mid-run:
    the segments that existed before it are taken from the snapshot) replayed event by event: the
    model reserves the same segments, byte for byte."""
    with gzip.open(TRACE) as f:
        snapshot = pickle.load(f)
    _, grown, created = replay_recorded(snapshot)
    assert len(created) > 100
    assert sorted(grown) == sorted(created)


def test_replay_makes_the_optimizer_state_in_the_first_step(one_step_events):
    """Weights, then steps; the state arrives after the first step's backward, in a cache the step
    already fragmented; later steps reuse what the first one reserved."""
    events, marks = one_step_events
    one = replay(events, marks, steps=1)
    # the gradients took 20 MiB of the 50 the activations freed; the state (60 MiB) fits nothing cached
    assert one.reserved == (30 + 50 + 60) * MiB
    assert one.peak_allocated == (30 + 20 + 60) * MiB
    assert replay(events, marks, steps=3).reserved == one.reserved  # later steps reuse the cache


def test_simulated_estimate_replays_its_step_and_the_card_adds_the_committed_margin(simulate_mlp):
    est = simulate_mlp(planning.Plan(device="cuda", micro_batch_size=512, optimizer="adamw"))
    assert est.reserved_gb >= est.peak_gb  # reserved holds what is allocated
    got = estimate.card(est)
    assert got["replayed_reserved_gb"] == pytest.approx(est.reserved_gb, abs=1e-6)
    assert got["peak_reserved_gb"] == pytest.approx(est.reserved_gb * RESIDUAL, abs=1e-5)
    assert got["device_peak_gb"] > got["peak_reserved_gb"]
    cpu = planning.simulate(
        nn.Linear(8, 8),
        planning.Plan(device="cpu"),
        make_batch=lambda: (torch.empty(2, 8),),
        batch_fn=lambda m, b: (m(b[0]).sum(),),
    )
    assert cpu.reserved_gb is None  # no caching allocator on a CPU


def test_the_margin_is_the_committed_run_that_sets_it():
    """RESIDUAL is the largest measured/replayed ratio of the committed eager runs; the run that sets it
    (rung 04, ViT-L/16 batch 32) replays to its value (python -m fabric_memory_recipes.planning.reserved
    replays them all)."""
    runs = calibration.load_runs((str(calibration.RESULTS_DIR),))
    rung04 = [r for r in runs if r.path == "published/h100/estimate/eager/04_lower_batch_size.json"]
    assert rung04
    cache = SimulationCache()  # the planner's file (the session's): the replay may be kept there already
    row = reserved.residuals(tuple(rung04), cache)[0]
    assert row["ratio"] == pytest.approx(RESIDUAL, abs=0.001)
    simulated = cache.simulated
    assert (
        simulated <= 1 and reserved.residuals(tuple(rung04), cache) == [row] and cache.simulated == simulated
    )


def test_the_margins_command_answers_help_at_once_and_prints_each_ratio(monkeypatch, capsys):
    """``python -m fabric_memory_recipes.planning.reserved --help`` printed no help: it replayed every committed
    eager run (tens of seconds on a CPU, the docs check's slowest page). It answers at once now; the command
    prints each run's ratio and the largest beside the margin in use (here on rung 04's run alone)."""

    def replays():
        raise AssertionError("--help replayed the committed runs")

    with monkeypatch.context() as patched:
        patched.setattr(reserved, "residuals", replays)
        with pytest.raises(SystemExit) as e:
            reserved.main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m fabric_memory_recipes.planning.reserved")
    runs = calibration.load_runs((str(calibration.RESULTS_DIR),))
    rung04 = tuple(r for r in runs if r.path == "published/h100/estimate/eager/04_lower_batch_size.json")
    monkeypatch.setattr(calibration, "load_runs", lambda dirs: rung04)
    assert reserved.main([]) == 0
    ratio, largest = capsys.readouterr().out.strip().splitlines()
    assert ratio.endswith(rung04[0].path) and f"measured {rung04[0].reserved_gb:.3f}" in ratio
    assert largest == f"largest: {float(ratio.split()[0]):.4f} ({rung04[0].path}); in use: {RESIDUAL}"

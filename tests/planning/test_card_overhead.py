"""The card overhead (fabric_memory_recipes/planning/overhead.py): measured from results JSONs (the
whole-device sampler's device_overhead_gb, the allocator's OOM message), stored with its sources,
used by the estimator (peak reserved, whole-device peak), --check and --memory-budget-gb."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from fabric_memory_recipes.config import RunConfig, UsageError
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.measurement import card_overhead
from fabric_memory_recipes.planning import check, overhead
from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.planning.check import check_results, render_check
from fabric_memory_recipes.planning.planner import calibration
from fabric_memory_recipes.planning.simulation.allocator import RESIDUAL
from fabric_memory_recipes.planning.simulation.cache import SimulationCache
from fabric_memory_recipes.planning.your_model import estimate as your_model_estimate
from fabric_memory_recipes.training import lifecycle

OOM = (
    "CUDA out of memory. Tried to allocate 26.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which"
    " 74.66 GiB is free. Including non-PyTorch memory, this process has 4.51 GiB memory in use. 3.73 GiB"
    " allowed; Of the allocated memory 3.66 GiB is allocated by PyTorch, and 45.70 MiB is reserved by"
    " PyTorch but unallocated. If reserved but unallocated memory is large try setting ..."
)
TABLE = {"kinds": {"h100": {
    "eager": {"overhead_gb": 0.80, "runs": 3, "smallest_gb": 0.79, "largest_from": "a.json", "methods": ["nvml-device"]},
    "compiled": {"overhead_gb": 0.87, "runs": 2, "smallest_gb": 0.86, "largest_from": "b.json", "methods": ["oom-message"]},
}}}  # fmt: skip


def run_json(status="ok", compiled=True, gpu="NVIDIA H100 80GB HBM3", world=1, **memory) -> dict:
    return {
        "schema_version": 1, "recipe": "14_memory_floor", "status": status,
        "error": OOM if status == "oom" else None,
        "config": {"compile": compiled, "cuda_graphs": compiled, "model": "vit_tiny", "precision": "bf16-true",
                   "batch_size": 4, "accumulation_steps": 1, "micro_batch_size": 4, "devices": 1,
                   "accelerator": "cuda"},
        "provenance": {"gpu_name": gpu, "world_size": world},
        "memory": {"kind": "cuda", **memory},
    }  # fmt: skip


def test_the_overhead_is_read_from_an_oom_message():
    # 4.51 GiB in use - 3.66 GiB allocated - 45.70 MiB reserved but unallocated
    expected = (4.51 * 2**30 - 3.66 * 2**30 - 45.70 * 2**20) / 1e9
    assert overhead.oom_overhead_gb(OOM) == pytest.approx(expected)
    assert overhead.oom_overhead_gb("CUDA out of memory. Tried to allocate 2 GiB") is None


def test_the_table_is_the_largest_per_kind_and_mode_with_its_sources(tmp_path):
    runs = tmp_path / "published" / "h100" / "ladder"
    runs.mkdir(parents=True)
    (runs / "a.json").write_text(
        json.dumps(run_json(compiled=False, device_overhead_gb=0.79, device_method="nvml-device"))
    )
    (runs / "b.json").write_text(
        json.dumps(run_json(compiled=False, device_overhead_gb=0.81, device_method="nvml-device"))
    )
    (runs / "c.json").write_text(json.dumps(run_json(status="oom")))  # the message: 0.865 GB, compiled
    (runs / "d.json").write_text(
        json.dumps(run_json(world=2, device_overhead_gb=2.0))
    )  # NCCL too: not counted
    (runs / "e.json").write_text(json.dumps(run_json(gpu="NVIDIA H200", device_overhead_gb=0.9)))
    (runs / "f.json").write_text(
        json.dumps(run_json(device_overhead_gb=None))
    )  # a run from before the sampler
    (runs / "notes.json").write_text("[1, 2]")
    table = overhead.measure([tmp_path])
    eager, compiled = table["kinds"]["h100"]["eager"], table["kinds"]["h100"]["compiled"]
    assert (eager["overhead_gb"], eager["runs"], eager["smallest_gb"]) == (0.81, 2, 0.79)
    assert eager["largest_from"].endswith("b.json") and len(eager["sources"]) == 2
    assert compiled["methods"] == ["oom-message"] and compiled["overhead_gb"] == pytest.approx(
        0.8648, abs=1e-4
    )
    assert table["kinds"]["h200"]["compiled"]["overhead_gb"] == 0.9
    assert set(table["kinds"]) == {"h100", "h200"}


def test_the_committed_table_names_the_files_it_came_from():
    table = overhead.load_table()
    for modes in table["kinds"].values():
        for entry in modes.values():
            assert entry["sources"] and entry["runs"] == len(entry["sources"])
            for source in entry["sources"]:
                assert (overhead.REPO / source.split("#")[0]).is_file(), source  # path#run: a check's row
    measured = overhead.measure([overhead.REPO / "results"])
    assert measured["kinds"] == table["kinds"] and measured["sharded"] == table.get(
        "sharded", {}
    )  # reproducible


SHARDED = {**TABLE, "sharded": {"h100": {"4": {
    "compiled": {"overhead_gb": 2.1, "runs": 3, "smallest_gb": 1.7, "largest_from": "s.json", "methods": ["nvml-process"]},
}}}}  # fmt: skip


def test_runs_of_several_processes_on_one_machine_give_the_overhead_per_gpu(tmp_path):
    runs = tmp_path / "published" / "h100x4" / "compare"
    runs.mkdir(parents=True)
    (runs / "a.json").write_text(json.dumps(run_json(world=4, device_overhead_gb=1.9)))
    (runs / "b.json").write_text(json.dumps(run_json(world=4, device_overhead_gb=2.1)))
    (runs / "c.json").write_text(json.dumps(run_json(world=2, compiled=False, device_overhead_gb=1.4)))
    two_nodes = run_json(world=4, device_overhead_gb=5.0)
    two_nodes["provenance"]["num_nodes"] = 2  # two torchrun 'nodes' on one host: not one machine's count
    (runs / "d.json").write_text(json.dumps(two_nodes))
    table = overhead.measure([tmp_path])
    assert table["kinds"] == {}  # one process's overhead lacks NCCL: never mixed
    four = table["sharded"]["h100"]["4"]["compiled"]
    assert (four["overhead_gb"], four["runs"], four["smallest_gb"]) == (2.1, 2, 1.9)
    assert four["largest_from"].endswith("b.json")
    assert table["sharded"]["h100"]["2"]["eager"]["overhead_gb"] == 1.4


def test_the_overhead_per_gpu_is_the_measured_one_for_that_many_processes_and_says_so():
    four = card_overhead.overhead_per_gpu("h100", "fast", 4, SHARDED)
    assert four.gb == 2.1 and "h100 x4 compiled" in four.source and "s.json" in four.source
    two = card_overhead.overhead_per_gpu("h100", "eager", 2, SHARDED)
    assert two.gb == 2.1 and "no h100 x2 eager measurement" in two.source
    assert card_overhead.overhead_per_gpu("h100", "eager", 1, SHARDED).gb == 0.80  # one process
    other = card_overhead.overhead_per_gpu("h200", "eager", 4, SHARDED)  # another kind's, said
    assert other.gb == 2.1 and "no h200 x4 eager measurement" in other.source and "h100 x4" in other.source
    unknown = card_overhead.overhead_per_gpu("h200", "eager", 4, {"kinds": {}, "sharded": {}})
    assert unknown.gb is None and "NCCL" in unknown.source


def _entry(gb: float, source: str) -> dict:
    return {
        "overhead_gb": gb,
        "runs": 1,
        "smallest_gb": gb,
        "largest_from": source,
        "methods": ["nvml-process"],
    }


def test_without_a_measurement_the_closest_sharded_one_is_assumed_and_said_to_be():
    """h100 x2 eager took h200 x4 compiled's 2.09 GB (the largest of all), which raised a small model's
    card per GPU: the same mode and process count come first now (h200 x2 eager, 1.68)."""
    table = {
        "kinds": {},
        "sharded": {
            "h200": {
                "2": {"eager": _entry(1.68, "a.json"), "compiled": _entry(2.09, "b.json")},
                "4": {"compiled": _entry(2.09, "c.json"), "eager": _entry(1.70, "d.json")},
            }
        },
    }
    two = card_overhead.overhead_per_gpu("h100", "eager", 2, table)
    assert (two.gb, two.measured) == (1.68, False) and "(h200 x2 eager, 1.68 GB per GPU" in two.source
    assert card_overhead.overhead_per_gpu("h100", "eager", 8, table).gb == 1.70  # same mode, the largest
    exact = card_overhead.overhead_per_gpu("h200", "compiled", 4, table)
    assert (
        exact.measured
        and exact.phrase(4) == "the card overhead measured for h200 x4 compiled (2.09 GB per GPU)"
    )
    assert two.phrase(2).startswith("a card overhead assumed for h100 x2 eager, which no run measured:")
    one = card_overhead.card_overhead("h100", "eager", TABLE)
    assert one.measured and one.phrase() == "the card overhead measured for h100 eager (0.80 GB)"
    assert not card_overhead.card_overhead("a100", "eager", TABLE).measured  # another kind's, assumed


def test_a_sharded_prediction_uses_the_sharded_ratio_and_the_overhead_per_gpu(tmp_path):
    ratio = calibration.ReservedRatio("sharded", 1.08, 3, 1.0, "s.json")
    card = overhead.card_prediction(
        3.0, graphs=False, compiled=True, gpu="h100", sharded=ratio, table=SHARDED, devices=4
    )
    assert card["peak_reserved_gb"] == pytest.approx(3.24) and card["device_peak_gb"] == pytest.approx(5.34)
    assert card["devices"] == 4 and "x4" in card["overhead_source"]
    folder = tmp_path / "published" / "h100x4" / "compare"
    folder.mkdir(parents=True)
    for name, reserved, estimate in (("a", 4.0, 3.6), ("b", 3.3, 3.0)):
        payload = run_json(world=4, peak_reserved_gb=reserved)
        payload["estimate"] = {"peak_allocated_gb": estimate}
        (folder / f"{name}.json").write_text(json.dumps(payload))
    (folder / "c.json").write_text(json.dumps(run_json(world=1, peak_reserved_gb=9.0)))  # one GPU: not here
    measured = calibration.sharded_reserved_ratio((str(tmp_path),))
    assert (
        measured.ratio == pytest.approx(4.0 / 3.6)
        and measured.runs == 2
        and measured.worst.endswith("a.json")
    )
    empty = calibration.sharded_reserved_ratio((str(tmp_path / "none"),))
    assert (
        empty.ratio == calibration.BUILT_IN_RESERVED_RATIO[0] and "no committed sharded run" in empty.line()
    )


def test_an_unknown_kind_or_mode_takes_the_same_mode_of_another_kind_else_the_largest_and_says_so():
    known = overhead.card_overhead("h100", "fast", TABLE)
    assert known.gb == 0.87 and known.mode == "compiled" and "largest of 2" in known.source
    assert overhead.card_overhead("h100", "eager", TABLE).gb == 0.80
    other = overhead.card_overhead("a100", "eager", TABLE)  # the mode decides it more than the card
    assert other.gb == 0.80 and not other.measured and "no a100 eager measurement: h100's" in other.source
    nothing = overhead.card_overhead("h100", "eager", {"kinds": {}})
    assert nothing.gb is None and "no measured overhead" in nothing.source
    # the committed table: an H200's inference takes the H100's inference runs', not the H200's compiled
    # training runs' (an H200's mT5 generate() measured 0.71 GB, results/published/h200/article-mt5/)
    h200 = overhead.card_overhead("h200", "inference")
    assert (
        h200.gb
        == overhead.card_overhead("h100", "inference").gb
        < 0.75
        < overhead.card_overhead("h200", "fast").gb
    )
    unmeasured = overhead.card_overhead("a100", "inference", TABLE)  # no kind measured the mode
    assert unmeasured.gb == 0.87 and "the largest measured overhead is assumed" in unmeasured.source


def test_the_card_prediction_is_the_allocator_replay_and_the_overhead():
    """One process: peak reserved is the step's allocator replay (the prediction --check compares), and
    the replay x RESIDUAL is what a planner budgets, as the estimate for your own model takes it; the
    whole-device peak adds the overhead of the GPU kind and mode. It was the simulated peak allocated x
    the largest reserved/allocated ratio of the committed runs of the mode."""
    card = overhead.card_prediction(1.0, replayed_gb=1.2, graphs=True, compiled=True, gpu="h100", table=TABLE)
    assert card["replayed_reserved_gb"] == 1.2 and card["replayed_device_gb"] == pytest.approx(1.2 + 0.87)
    assert card["peak_reserved_gb"] == pytest.approx(1.2 * RESIDUAL)
    assert card["device_peak_gb"] == pytest.approx(1.2 * RESIDUAL + 0.87)
    assert overhead.predicted_reserved(card) == (card["replayed_reserved_gb"], card["replayed_device_gb"])
    eager = overhead.card_prediction(
        1.0, replayed_gb=1.2, graphs=False, compiled=False, gpu="h100", table=TABLE
    )
    assert eager["replayed_device_gb"] == pytest.approx(1.2 + 0.80)
    none = overhead.card_prediction(
        1.0, replayed_gb=1.2, graphs=False, compiled=False, gpu="h100", table={"kinds": {}}
    )
    assert none["device_peak_gb"] is None and none["replayed_device_gb"] is None
    assert none["replayed_reserved_gb"] == 1.2
    est = SimpleNamespace(peak_gb=1.0, reserved_gb=1.2)
    over = card_overhead.card_overhead("h100", "fast")
    mine = your_model_estimate.card(est, "h100", "fast")
    assert {k: mine[k] for k in ("peak_reserved_gb", "device_peak_gb", "replayed_reserved_gb")} == {
        k: overhead.replayed_card(1.2, over)[k]
        for k in ("peak_reserved_gb", "device_peak_gb", "replayed_reserved_gb")
    }, "the ladder's estimate and your model's take the replay to the card alike"


def test_the_estimator_prints_reserved_and_whole_device_peaks(capsys):
    argv = ["--recipe", "14_memory_floor", "--model", "vit_tiny"]
    assert estimate_main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["replayed_reserved_gb"] == pytest.approx(d["peak_reserved_simulated_gb"], abs=1e-6)
    assert d["replayed_reserved_gb"] >= d["peak_allocated_gb"]
    assert d["peak_reserved_gb"] == pytest.approx(d["replayed_reserved_gb"] * RESIDUAL, abs=1e-5)
    over = overhead.card_overhead("h100", "fast")
    assert d["overhead_gb"] == over.gb and d["overhead_source"] == over.source
    assert d["device_peak_gb"] == pytest.approx(d["peak_reserved_gb"] + over.gb)
    assert "components_gb" in d
    assert estimate_main(argv) == 0
    out = capsys.readouterr().out
    assert "peak reserved" in out and "whole-device peak" in out and "outside the allocator" in out
    assert f"the allocator replay's {d['replayed_reserved_gb']:.3f} x {RESIDUAL}" in out


def test_check_compares_the_whole_device_peak(tmp_path, monkeypatch):
    monkeypatch.setattr(card_overhead, "load_table", lambda path=None: TABLE)
    estimate = {"peak_allocated_gb": 1.0, "peak_reserved_simulated_gb": 1.02, "peak_phase": "backward"}
    measured = {
        "peak_allocated_gb": 1.0,
        "run_peak_reserved_gb": 1.05,
        "device_peak_gb": 1.9,
        "device_overhead_gb": 0.85,
        "device_method": "nvml-device",
    }
    (tmp_path / "a.json").write_text(json.dumps({**run_json(**measured), "estimate": estimate}))
    (tmp_path / "b.json").write_text(json.dumps({**run_json(peak_allocated_gb=1.0), "estimate": estimate}))
    rows = check_results([str(tmp_path)])
    assert rows[0]["predicted_reserved_gb"] == 1.02
    assert rows[0]["reserved_error_pct"] == pytest.approx(100 * (1.02 / 1.05 - 1))
    assert rows[0]["predicted_device_gb"] == pytest.approx(1.02 + 0.87)
    assert rows[0]["device_error_pct"] == pytest.approx(100 * ((1.02 + 0.87) / 1.9 - 1))
    assert rows[1]["measured_device_gb"] is None and rows[1]["device_error_pct"] is None
    text = render_check(rows)
    assert "measured device GB" in text and "Whole-device peak: 1 runs" in text and "h100 compiled" in text
    assert "Peak reserved: 1 runs, error -2.9% to -2.9%; 1 of 1 within ±5%" in text


def test_check_replays_a_run_that_did_not_record_its_replay_with_the_plan_it_recorded(tmp_path, monkeypatch):
    """Runs made before the estimate recorded its replay are simulated again, with the plan their
    estimate assumed where it differs from the declared rung (rung 16 declares no activation offload; its
    run offloaded, and its recorded estimate says so)."""
    monkeypatch.setattr(card_overhead, "load_table", lambda path=None: TABLE)
    plans = []

    def simulated(model, plan, model_name=None):
        plans.append(plan)
        return SimpleNamespace(
            error=None, peak_gb=0.09, activations_host_gb=0.0, reserved_gb=0.15, seconds=1.0
        )

    monkeypatch.setattr(check, "simulate", simulated)
    run = {
        **run_json(compiled=False, peak_allocated_gb=0.1, run_peak_reserved_gb=0.2, device_peak_gb=1.0),
        "recipe": "16_weights_on_cpu",
    }
    assert not declared_rung("16_weights_on_cpu")[0].activation_offload, "the declared rung alone"
    run["estimate"] = {
        "peak_allocated_gb": 0.09,
        "assumptions": {"activation_offload": True, "checkpoint": []},
    }
    (tmp_path / "16_weights_on_cpu.json").write_text(json.dumps(run))
    cache = SimulationCache(use_disk=False)
    (row,) = check_results([str(tmp_path)], cache=cache)
    (plan,) = plans
    assert plan.activation_offload and plan.activation_checkpointing == () and plan.weights_offload
    assert row["predicted_gb"] == 0.09, "the recorded peak allocated is what is compared"
    assert row["predicted_reserved_gb"] == 0.15 and row["reserved_error_pct"] == pytest.approx(-25.0)
    assert row["predicted_device_gb"] == pytest.approx(0.15 + 0.80)
    assert check_results([str(tmp_path)], cache=cache)[0]["predicted_reserved_gb"] == 0.15 and len(plans) == 1
    run["estimate"]["peak_reserved_simulated_gb"] = 0.16  # recorded: taken as it is, nothing simulated
    (tmp_path / "16_weights_on_cpu.json").write_text(json.dumps(run))
    fresh = SimulationCache(use_disk=False)
    assert check_results([str(tmp_path)], cache=fresh)[0]["predicted_reserved_gb"] == 0.16 and len(plans) == 1


@pytest.fixture
def h100(monkeypatch):
    calls = []

    class Props:
        total_memory = 80e9

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append(f))
    monkeypatch.setattr(card_overhead, "load_table", lambda path=None: TABLE)
    return calls


def test_a_memory_budget_stands_for_a_card(h100):
    eager = lifecycle.apply_memory_budget(
        RunConfig(memory_budget_gb=4.0, mode="eager", compile=False, cuda_graphs=False)
    )
    assert eager["allocator_gb"] == pytest.approx(3.2) and eager["overhead_gb"] == 0.80
    assert h100 == [pytest.approx(3.2 / 80)] and "h100 eager" in eager["overhead_source"]
    fast = lifecycle.apply_memory_budget(
        RunConfig(memory_budget_gb=4.0, mode="fast", compile=True, cuda_graphs=True)
    )
    assert fast["allocator_gb"] == pytest.approx(3.13) and fast["budget_gb"] == 4.0
    with pytest.raises(UsageError, match="cannot even hold the 0.87 GB"):
        lifecycle.apply_memory_budget(RunConfig(memory_budget_gb=0.5, compile=True))


def test_a_memory_budget_under_fsdp_caps_each_process_on_its_own_gpu(monkeypatch):
    """Several processes: each caps the GPU of its local rank (set by the launcher), less the overhead per
    GPU measured for that many processes (NCCL's buffers), not one process's."""
    capped = []

    class Props:
        total_memory = 80e9

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, d)))
    monkeypatch.setattr(card_overhead, "load_table", lambda path=None: SHARDED)
    cfg = RunConfig(memory_budget_gb=10.0, devices=4, mode="fast", compile=True, cuda_graphs=False)
    for rank in ("0", "3"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        record = lifecycle.apply_memory_budget(cfg)
        assert record["device_index"] == int(rank) and record["processes_per_machine"] == 4
        assert (
            record["allocator_gb"] == pytest.approx(10.0 - 2.1)
            and "h100 x4 compiled" in record["overhead_source"]
        )
    assert capped == [(pytest.approx(7.9 / 80), 0), (pytest.approx(7.9 / 80), 3)]
    monkeypatch.setenv("LOCAL_RANK", "3")  # one process: device 0 whatever the environment says
    one = lifecycle.apply_memory_budget(
        RunConfig(memory_budget_gb=10.0, mode="eager", compile=False, cuda_graphs=False)
    )
    assert capped[-1][1] == 0 and one["overhead_gb"] == 0.80 and one["processes_per_machine"] == 1


def test_a_memory_budget_without_a_measured_overhead_caps_the_allocator_and_says_so(h100, monkeypatch):
    monkeypatch.setattr(card_overhead, "load_table", lambda path=None: {"kinds": {}})
    record = lifecycle.apply_memory_budget(RunConfig(memory_budget_gb=2.0))
    assert record["allocator_gb"] == 2.0 and record["overhead_gb"] is None
    assert "no measured overhead" in record["overhead_source"]


def test_inference_runs_and_inference_check_rows_are_their_own_mode(tmp_path):
    """An ``--infer`` run loads no backward or optimizer kernels: its overhead is the 'inference' mode's,
    read from its results JSON or from a row of an inference check's summary (whole device - reserved)."""
    infer = run_json(compiled=False, device_overhead_gb=0.74, device_method="nvml-process")
    infer["config"]["infer"] = True
    (tmp_path / "run.json").write_text(json.dumps(infer))
    rows = [{"run": "a", "status": "ok", "gpu": "NVIDIA H100 80GB HBM3", "measured_device_gb": 9.0,
             "measured_reserved_gb": 8.24},
            {"run": "b", "status": "oom", "gpu": "NVIDIA H100 80GB HBM3", "measured_device_gb": None,
             "measured_reserved_gb": None}]  # fmt: skip
    (tmp_path / "inference_check.json").write_text(json.dumps({"target": 0.05, "rows": rows}))
    entry = overhead.measure([tmp_path])["kinds"]["h100"]["inference"]
    assert entry["overhead_gb"] == pytest.approx(0.76) and entry["runs"] == 2
    assert any(s.endswith("inference_check.json#a") for s in entry["sources"])
    assert card_overhead.overhead_mode(infer["config"]) == "inference"


def test_inference_without_its_own_measurement_assumes_its_kinds_eager_overhead():
    assumed = card_overhead.card_overhead("h100", "inference", TABLE)
    assert assumed.gb == 0.80 and not assumed.measured and "eager training runs" in assumed.source
    with_it = {"kinds": {"h100": {**TABLE["kinds"]["h100"], "inference": {**TABLE["kinds"]["h100"]["eager"],
                                                                          "overhead_gb": 0.76}}}}  # fmt: skip
    assert card_overhead.card_overhead("h100", "inference", with_it).gb == 0.76

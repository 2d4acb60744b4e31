"""scripts/gpu/sharded_spread_summary.py: the sharded rungs' runs against the article's script of the same call,
per call and pooled over calls (median, range, targets), on small fake result files; bad input exits 2."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location(
    "sharded_spread_summary", REPO / "scripts" / "gpu" / "sharded_spread_summary.py"
)
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)


def _rung(folder, recipe, tag, speed, reserved=4.0, n=4, intervals=None, gpu="NVIDIA H100 80GB HBM3"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{recipe}-{tag}.json").write_text(json.dumps({
        "recipe": recipe, "status": "ok", "tag": tag, "config": {"mode": "fast"},
        "timing": {"images_per_s": speed, "median_step_s": 256 / speed, "warmup_steps": 3, "optimizer_steps": 12,
                   "intervals_s": intervals or [9.0, 9.0, 9.0] + [0.2] * 8},
        "memory": {"peak_reserved_gb": reserved, "device_overhead_gb": 1.5},
        "provenance": {"world_size": n, "gpu_name": gpu},
    }))  # fmt: skip


def _reference(folder, key, speed, reserved, n=4, rank_reserved=None):
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"reference-11_delay-allocation{key}"
    run = {"schema": "reference_run/1", "status": "ok", "rank": 0, "world_size": n, "images_per_s": speed,
           "peak_reserved_gb": reserved}  # fmt: skip
    (folder / f"{stem}.json").write_text(json.dumps(run))
    if rank_reserved is not None:  # a later rank's file: memory per GPU is the largest rank's
        (folder / f"{stem}.rank1.json").write_text(
            json.dumps({**run, "rank": 1, "peak_reserved_gb": rank_reserved})
        )


def _call(
    root, name, fsdp2_speeds, article=400.0, gpus="NVIDIA H100 80GB HBM3", reserved=4.2, article_reserved=4.5
):
    call = root / name
    call.mkdir(parents=True)
    (call / "gpus.csv").write_text(
        "index, name, memory.total [MiB]\n" + "".join(f"{i}, {gpus}, 81559 MiB\n" for i in range(4))
    )
    _reference(call / "x4" / "ref", "-no-offload", article, 4.4, rank_reserved=article_reserved)
    _reference(call / "x4" / "ref", "", 200.0, 3.5)
    for i, speed in enumerate(fsdp2_speeds, 1):
        _rung(call / "x4" / f"r{i}", "08_fsdp2", f"r{i}", speed, reserved=reserved, gpu=gpus)
        _rung(call / "x4" / f"r{i}", "09_cpu_offload", f"r{i}", 800.0, reserved=2.8)
    return call


def test_each_run_is_divided_by_its_own_calls_article_and_pooled_over_calls(tmp_path):
    _call(tmp_path, "call1", [1200.0, 1600.0], article=400.0)  # 3.0x, 4.0x
    _call(tmp_path, "call2", [1500.0], article=500.0)  # 3.0x against its own call's article run
    data, text = summary.summarise(summary.call_folders([tmp_path]))
    first = {r["rung"]: r for r in data["calls"][0]["rows"]}["08_fsdp2"]
    assert first["x_article"] == [3.0, 4.0] and first["median_x_article"] == 3.5
    assert first["min_images_per_s"] == 1200.0 and first["max_images_per_s"] == 1600.0
    assert first["x_article_reserved"] == pytest.approx(4.2 / 4.5)  # the article's largest rank
    pooled = {r["rung"]: r for r in data["pooled"]}["08_fsdp2"]
    assert pooled["runs"] == 3 and pooled["calls_with_article"] == 2 and pooled["median_x_article"] == 3.0
    assert pooled["target"] == "not met: speed < 3.5x"
    assert "## call1: 4 x NVIDIA H100 80GB HBM3" in text and "2 calls, NVIDIA H100 80GB HBM3" in text


def test_a_rung_meets_its_targets_with_three_runs_in_two_calls_and_rung_09_needs_a_steady_step(tmp_path):
    _call(tmp_path, "call1", [1500.0, 1500.0], article=400.0)
    _call(tmp_path, "call2", [1450.0], article=400.0)
    data, _ = summary.summarise(summary.call_folders([tmp_path]))
    pooled = {r["rung"]: r for r in data["pooled"]}
    assert pooled["08_fsdp2"]["target"] == "met"
    assert (
        pooled["09_cpu_offload"]["target"] == "met" and pooled["09_cpu_offload"]["p90_over_p10"] == [1.0] * 3
    )
    _rung(
        tmp_path / "call2" / "x4" / "r9",
        "09_cpu_offload",
        "r9",
        800.0,
        reserved=2.8,
        intervals=[1.0] * 3 + [0.2] * 6 + [0.4] * 2,
    )
    data, _ = summary.summarise(summary.call_folders([tmp_path]))
    assert {r["rung"]: r for r in data["pooled"]}["09_cpu_offload"]["target"] == "not met: p90/p10 > 1.3"


def test_calls_on_other_gpu_kinds_pool_their_ratios_and_reserved_is_compared_within_each_call(tmp_path):
    _call(tmp_path, "call1", [1400.0, 1480.0], article=400.0)  # 3.5x, 3.7x; 4.2 / 4.5 GB
    _call(tmp_path, "call2", [1600.0], article=450.0, gpus="NVIDIA H200", reserved=4.6, article_reserved=4.7)
    data, text = summary.summarise(summary.call_folders([tmp_path]))
    pooled = {r["rung"]: r for r in data["pooled"]}["08_fsdp2"]
    assert pooled["gpu"] == "NVIDIA H100 80GB HBM3, NVIDIA H200" and pooled["runs"] == 3
    assert pooled["median_x_article"] == pytest.approx(3.5555, abs=1e-3)  # 1600 / 450
    assert pooled["x_article_reserved"] == pytest.approx(
        4.6 / 4.7
    )  # not 4.6 / 4.5: each run against its call
    assert pooled["target"] == "met" and "## call2: 4 x NVIDIA H200" in text


def test_variants_profiles_and_node_checks_are_kept_apart(tmp_path):
    call = _call(tmp_path, "call1", [1200.0])
    _rung(call / "x4" / "r1", "08_fsdp", "r1-compile", 1400.0)
    _rung(call / "x2" / "r1", "08_fsdp2", "r1", 700.0, n=2)
    _reference(call / "x2" / "ref", "-no-offload", 200.0, 5.3, n=2)
    _rung(call / "profile" / "08_fsdp2-x4", "08_fsdp2", "r1", 10.0)  # profiled: slowed by the profiler
    _rung(call / "nodes" / "one-node", "08_fsdp2", "r1", 10.0)
    data, text = summary.summarise([call])
    rows = {(r["rung"], r["world_size"]): r for r in data["calls"][0]["rows"]}
    assert set(rows) == {("08_fsdp2", 4), ("08_fsdp+compile", 4), ("09_cpu_offload", 4), ("08_fsdp2", 2)}
    assert rows[("08_fsdp+compile", 4)]["x_article"] == [3.5] and rows[("08_fsdp2", 2)]["x_article"] == [3.5]
    assert rows[("08_fsdp2", 4)]["runs"] == 1
    assert "| 08_fsdp+compile | 4 |" in text


def test_your_model_rows_count_the_runs_within_ten_percent(tmp_path):
    call = tmp_path / "call1"
    for name, reserved in (("neox-x2", 20.0), ("tiny-x2", 15.41)):
        (call / "your-model" / name).mkdir(parents=True)
        (call / "your-model" / name / "your_model.json").write_text(json.dumps({
            "status": "ok", "config": {"model": "hf:x"}, "provenance": {"world_size": 2, "gpu_name": "H"},
            "memory": {"peak_allocated_gb": 10.0, "peak_reserved_gb": reserved, "device_peak_gb": 22.0},
            "estimate": {"peak_allocated_gb": 10.5},
            "extra": {"predicted_card": {"peak_reserved_gb": 13.86 if name == "tiny-x2" else 19.0, "device_peak_gb": 21.0}},
        }))  # fmt: skip
    data, text = summary.summarise([call])
    assert [r["within"] for r in data["your_model"]] == [True, False]  # 13.86 / 15.41 - 1 = -10.1 %
    assert "Within +-10 % on allocated, reserved and whole device: 1 of 2 runs." in text


def test_the_call_folder_is_written_and_bad_input_exits_2(tmp_path, capsys):
    call = _call(tmp_path, "call1", [1200.0])
    assert summary.main([str(call)]) == 0
    assert json.loads((call / "summary.json").read_text())["calls"][0]["gpus"] == "4 x NVIDIA H100 80GB HBM3"
    assert summary.main([str(call), str(call)]) == 2  # several calls need --out
    assert summary.main([str(tmp_path / "missing")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert summary.main([str(tmp_path), "--out", str(tmp_path / "pooled")]) == 0
    assert (tmp_path / "pooled" / "summary.md").is_file()

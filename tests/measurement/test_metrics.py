"""fabric_memory_recipes.measurement.results (the measurements), fabric_memory_recipes.measurement.results_file (the file) and lifecycle.run_recipe's outcome
handling: an OOM is recorded (not fatal), results are written atomically, timings are computed from the
step marks as documented, the summary is one block."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.measurement import results, results_file
from fabric_memory_recipes.measurement.results import RunResults
from fabric_memory_recipes.measurement.results_file import results_path, summary, write_json_atomic
from fabric_memory_recipes.training import lifecycle

OOM_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB"


def _files(folder) -> list[str]:
    return sorted(os.listdir(folder))


# ---------------------------------------------------------------------------------------------- OOM
def test_injected_oom_is_recorded_not_fatal(tmp_path, capsys):
    import lightning as L

    results = tmp_path / "results"
    reached = []

    def main(cfg, log):
        fabric = L.Fabric(accelerator="cpu", devices=1, precision=cfg.precision)
        log.attach(fabric)
        log.set(data_source="synthetic", weights="random")
        with log.phase("model_load"):
            pass
        reached.append(True)
        with log.phase("train"):
            raise torch.cuda.OutOfMemoryError(
                OOM_MESSAGE + "\nIf reserved but unallocated memory is large ..."
            )

    argv = ["--accelerator", "cpu", "--model", "vit_tiny", "--precision", "bf16-true", "--batch-size", "32",
            "--accumulation-steps", "4", "--results-dir", str(results), "--tag", "oom"]  # fmt: skip
    code = lifecycle.run_recipe(main, RunConfig(recipe="99_oom_probe"), "OOM probe\nmore", argv=argv)
    assert reached and code == 3

    path = results / "99_oom_probe-oom.json"
    assert _files(results) == [path.name], "one results file, no temporary files left"
    p = json.loads(path.read_text())
    assert p["status"] == "oom"
    assert p["error"] == OOM_MESSAGE, "the error's first line only"
    assert p["recipe"] == "99_oom_probe" and p["tag"] == "oom" and p["description"] == "OOM probe"
    cfg = p["config"]
    assert cfg["precision"] == "bf16-true" and cfg["batch_size"] == 32 and cfg["accumulation_steps"] == 4
    assert cfg["micro_batch_size"] == 8 and cfg["model"] == "vit_tiny"
    assert p["provenance"]["device"] == "cpu" and p["provenance"]["data_source"] == "synthetic"
    # the phase that failed is still measured (the peak up to the OOM is what one wants to see)
    assert {"model_load", "train"} <= set(p["memory"]["phases"])
    assert p["timing"]["optimizer_steps"] == 0 and p["timing"]["median_step_s"] is None
    out = capsys.readouterr().out
    assert "== 99_oom_probe-oom: OOM (CUDA out of memory. Tried to allocate 2.00 GiB" in out


def test_ok_run_through_run_recipe(tmp_path):
    import lightning as L

    def main(cfg, log):
        log.attach(L.Fabric(accelerator="cpu", devices=1))
        log.step_done()

    code = lifecycle.run_recipe(
        main, RunConfig(recipe="r"), "d", argv=["--accelerator", "cpu", "--results-dir", str(tmp_path)]
    )
    assert code == 0
    p = json.loads((tmp_path / "r.json").read_text())
    assert p["status"] == "ok" and p["error"] is None and p["timing"]["optimizer_steps"] == 1


def test_a_crash_is_recorded_as_error_and_still_raises(tmp_path):
    import lightning as L

    def main(cfg, log):
        log.attach(L.Fabric(accelerator="cpu", devices=1))
        with log.phase("train"):
            raise RuntimeError("loss is NaN\nat step 3")

    with pytest.raises(RuntimeError, match="loss is NaN"):
        lifecycle.run_recipe(
            main, RunConfig(recipe="r"), "d", argv=["--accelerator", "cpu", "--results-dir", str(tmp_path)]
        )
    p = json.loads((tmp_path / "r.json").read_text())
    assert p["status"] == "error" and p["error"] == "RuntimeError: loss is NaN"
    assert "train" in p["memory"]["phases"]


# ------------------------------------------------------------------------------------------- atomic
def test_write_json_atomic_replaces_whole_file(tmp_path):
    path = tmp_path / "sub" / "x.json"
    write_json_atomic(str(path), {"a": 1})
    write_json_atomic(str(path), {"b": [1, 2]})
    assert json.loads(path.read_text()) == {"b": [1, 2]}
    assert _files(path.parent) == ["x.json"]


def test_write_json_atomic_failure_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    write_json_atomic(str(path), {"old": True})

    def broken_dump(obj, f, **kw):
        f.write('{"half": ')  # a partial write, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(results_file.json, "dump", broken_dump)
    with pytest.raises(KeyboardInterrupt):
        write_json_atomic(str(path), {"new": True})
    assert json.loads(path.read_text()) == {"old": True}, "readers never see a half-written file"
    assert _files(tmp_path) == ["x.json"], "the temporary file is removed"


def test_write_json_atomic_uses_rename_in_the_same_folder(tmp_path, monkeypatch):
    renames = []
    real = os.replace

    def spy(src, dst):
        renames.append((src, dst))
        assert os.path.basename(src).startswith(".tmp-")
        assert json.loads(open(src).read()) == {"k": 1}, "complete before the rename"
        return real(src, dst)

    monkeypatch.setattr(results_file.os, "replace", spy)
    write_json_atomic(str(tmp_path / "y.json"), {"k": 1})
    assert len(renames) == 1
    assert os.path.dirname(renames[0][0]) == str(tmp_path) and renames[0][1] == str(tmp_path / "y.json")


def test_results_file_gets_normal_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        write_json_atomic(str(tmp_path / "z.json"), {"k": 1})
        with open(tmp_path / "plain.json", "w") as f:
            f.write("{}")
    finally:
        os.umask(umask)
    mode = stat.S_IMODE(os.stat(tmp_path / "z.json").st_mode)
    assert mode == stat.S_IMODE(os.stat(tmp_path / "plain.json").st_mode) == 0o644, oct(mode)


def test_results_path():
    assert results_path("res", "01_baseline") == os.path.join("res", "01_baseline.json")
    assert results_path("res", "01_baseline", "a100") == os.path.join("res", "01_baseline-a100.json")


# ------------------------------------------------------------------------------------------- timing
def _cfg(recipe: str, **flags) -> RunConfig:
    base = dict(
        batch_size=16, accumulation_steps=4, results_dir="unused", precision="32-true", model="vit_tiny"
    )
    return RunConfig(recipe=recipe, **{**base, **flags})


class FakeClock:
    def __init__(self, times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_step_timing_from_fake_clock(monkeypatch):
    marks = [100.0, 110.0, 115.0, 116.0, 117.0, 118.5, 119.5, 121.0]  # 7 intervals
    # phase("train") reads the clock on entry and exit around the steps
    monkeypatch.setattr(results.time, "perf_counter", FakeClock([99.0, *marks, 130.0]))
    log = RunResults(_cfg("t"))
    with log.phase("train"):
        for _ in marks:
            log.step_done()
            log.micro_batches += 4
    assert log.step_intervals() == pytest.approx([10, 5, 1, 1, 1.5, 1, 1.5])
    t = log.payload(gather=False)["timing"]
    assert t["warmup_steps"] == results_file.WARMUP_STEPS == 3
    assert t["timed_intervals"] == 4
    assert t["intervals_s"] == pytest.approx([10, 5, 1, 1, 1.5, 1, 1.5])  # each step, for its spread
    assert t["median_step_s"] == pytest.approx(1.25)  # median of [1, 1.5, 1, 1.5]: warm-up left out
    assert t["images_per_s"] == pytest.approx(16 / 1.25)  # effective batch x world / median step
    assert t["optimizer_steps"] == 8 and t["micro_batches"] == 32
    assert t["images_seen"] == 32 * 4
    assert t["train_wall_s"] == pytest.approx(31.0)


@pytest.mark.parametrize(
    "marks,warmup,median",
    [
        ([], 0, None),
        ([5.0], 0, None),
        ([0.0, 2.0], 0, 2.0),  # one interval: nothing to leave out
        ([0.0, 9.0, 10.0], 1, 1.0),  # as in the 3-step CPU runs: the first interval is warm-up
        ([0.0, 9.0, 10.0, 12.0, 13.0], 3, 1.0),
    ],
)
def test_step_timing_few_steps(marks, warmup, median):
    log = RunResults(_cfg("t"))
    log.step_marks = list(marks)
    log.optimizer_steps = len(marks)
    t = log.payload(gather=False)["timing"]
    assert t["warmup_steps"] == warmup
    assert t["median_step_s"] == (pytest.approx(median) if median is not None else None)
    assert t["images_per_s"] == (pytest.approx(16 / median) if median else None)


def test_images_per_s_counts_all_ranks():
    class FakeFabric:
        device = torch.device("cpu")
        global_rank = 0
        world_size = 4

    log = RunResults(_cfg("t", batch_size=8, accumulation_steps=4))
    log.attach(FakeFabric())
    log.step_marks = [0.0, 1.0, 3.0]
    log.micro_batches = 10
    t = log.payload(gather=False)["timing"]
    assert t["median_step_s"] == pytest.approx(2.0)
    assert t["images_per_s"] == pytest.approx(8 * 4 / 2.0)
    assert t["images_seen"] == 10 * 2 * 4


def test_cpu_phases_are_rss_in_gb(monkeypatch):
    log = RunResults(_cfg("t"))
    with log.phase("model_load"):
        pass
    with log.phase("train"):
        pass
    mem = log.payload(gather=False)["memory"]
    assert mem["kind"] == "cpu_rss" and mem["unit"] == "GB"
    import resource

    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    assert 0 < mem["peak_allocated_gb"] <= rss_gb + 1e-9
    assert mem["peak_allocated_gb"] == mem["phases"]["train"]["peak_allocated_gb"]
    assert mem["phases"]["train"]["per_rank"] == [
        {"rank": 0, "allocated_gb": mem["peak_allocated_gb"], "reserved_gb": mem["peak_reserved_gb"]}
    ]


def test_time_spent_predicting_memory_is_not_load_time(monkeypatch):
    """The recipe predicts inside its model_load phase; the prediction's seconds are left out."""
    import types

    clock = iter([100.0, 103.5, 200.0, 201.0])  # model_load: 3.5 s, of which 2.25 s estimating
    monkeypatch.setattr(results.time, "perf_counter", lambda: next(clock))
    log = RunResults(_cfg("t"))
    with log.phase("model_load"):
        log.estimate = types.SimpleNamespace(seconds=2.25)
    with log.phase("train"):  # a later phase is not charged for it again
        pass
    assert log.phases["model_load"]["wall_s"] == pytest.approx(1.25)
    assert log.phases["train"]["wall_s"] == pytest.approx(1.0)
    assert log.estimate.seconds == 2.25


# ------------------------------------------------------------------------------------------ summary
def test_finish_prints_one_consistent_block(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        results.time, "perf_counter", FakeClock([0.0, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 9.0])
    )
    log = RunResults(_cfg("05_x", results_dir=str(tmp_path), tag="t1", precision="bf16-true"))
    log.set(data_source="synthetic", weights="random")
    with log.phase("train"):
        for _ in range(7):
            log.step_done()
    log.micro_batches = 28
    log.accuracy.update(train=0.5, val=0.25, test=0.125)
    payload = log.finish()
    out = capsys.readouterr().out
    path = str(tmp_path / "05_x-t1.json")
    assert json.loads(open(path).read()) == json.loads(json.dumps(payload))
    block = summary(payload, path)
    assert out.strip() == block.strip(), "finish prints exactly the summary block"
    lines = block.splitlines()
    assert len(lines) == 6
    assert lines[0] == "== 05_x-t1: OK"
    assert all(ln.startswith("   ") for ln in lines[1:])
    t = payload["timing"]
    assert t["median_step_s"] == pytest.approx(0.5) and t["images_per_s"] == pytest.approx(32.0)
    assert "precision bf16-true" in lines[1] and "model vit_tiny (random)" in lines[1]
    assert "data synthetic" in lines[1]
    assert "peak RSS" in lines[2] and f"{payload['memory']['peak_allocated_gb']:.2f} GB" in lines[2]
    assert "32.0 img/s" in lines[3] and "median step 0.5000 s" in lines[3] and "7 steps" in lines[3]
    assert "loop 9.0 s" in lines[3]
    assert "train 0.500 | val 0.250 | test 0.125" in lines[4]
    assert lines[5].strip() == f"results       {path}"


def test_summary_of_an_oom_without_timings():
    log = RunResults(_cfg("02_y"))
    p = log.payload(status="oom", error="CUDA out of memory.", gather=False)
    lines = summary(p).splitlines()
    assert len(lines) == 5  # no path given, no results line
    assert lines[0] == "== 02_y: OOM (CUDA out of memory.)"
    assert "n/a img/s" in lines[3] and "0 steps" in lines[3]
    assert "train n/a | val n/a | test n/a" in lines[4]


def test_a_resumed_runs_speed_line_counts_this_processs_steps():
    """It said "30 steps" for a process that resumed at step 11 and ran 19: the median and the loop time
    are this process's."""
    log = RunResults(_cfg("05_x"))
    log.optimizer_steps = 30
    log.extra["resumed_from"] = {"path": "ck/step-000011.ckpt", "step": 11}
    speed = next(ln for ln in summary(log.payload(gather=False)).splitlines() if "speed" in ln)
    assert "19 steps in this process, resumed at step 11 of 30," in speed, speed
    fresh = RunResults(_cfg("05_x"))
    fresh.optimizer_steps = 30
    assert ", 30 steps, loop" in summary(fresh.payload(gather=False))

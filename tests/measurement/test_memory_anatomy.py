"""--memory-timeline and --snapshot (fabric_memory_recipes/measurement/profiling.py) and the experiments in experiments/, tiny, on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import describe, run_recipe_inprocess

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ("--accelerator", "cpu", "--model", "vit_tiny", "--data", "synthetic", "--weights", "none")


def run(*args: str, cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "FMR_OFFLINE": "1",
        "FMR_LOG_DIR": str(cwd / "logs"),
    }
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_memory_timeline_writes_html_png_json_and_records_them(tmp_path):
    out = tmp_path / "results"
    argv = [*TINY, "--max-steps", "3", "--eval-batches", "1", "--memory-timeline", "--profile-steps", "2"]
    proc, payload = run_recipe_inprocess("05_gradient_accumulation", argv, out)
    assert proc.returncode == 0, describe(proc)
    files = payload["memory"]["timeline"]
    assert files and "error" not in files, files
    assert Path(files["png"]).read_bytes().startswith(PNG_MAGIC)
    assert "<img src='data:image/png;base64," in Path(files["html"]).read_text()
    data = json.loads(Path(files["json"]).read_text())
    assert data["device"] == "cpu" and len(data["time_ms"]) > 10
    # the categoriser found the model's weights and Adam's state, and the loop's phases were marked
    assert max(data["categories"]["parameters"]) > 0 and max(data["categories"]["optimizer state"]) > 0
    assert {"forward", "backward", "optimizer"} <= {name for name, _, _ in data["phases_ms"]}
    assert len(data["step_phase_times_ms"]) == 2  # --profile-steps 2
    # on a CPU the phases are host spans, placed on the memory timeline's clock
    assert data["phase_times"] == "host" and data["step_phase_kernel_ms"] is None
    assert all(-1.0 <= start < data["time_ms"][-1] for _, start, _ in data["phases_ms"])
    # the estimate rides along in the same JSON, and the summary says where the files are
    assert payload["estimate"]["peak_allocated_gb"] > 0 and payload["estimate"]["error"] is None
    assert "timeline" in proc.stdout


def test_snapshot_needs_cuda_and_says_so(capsys):
    from fabric_memory_recipes.config import RunConfig
    from fabric_memory_recipes.training import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.parse(RunConfig(), [*TINY, "--snapshot"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--snapshot needs CUDA" in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def experiments(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    monkeypatch.setenv("FMR_OFFLINE", "1")
    import lora_tower
    import trainable_position

    return trainable_position, lora_tower


def test_experiments_run_tiny_and_write_json_and_plots(experiments, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainable_position, lora_tower = experiments
    common = [
        "--accelerator",
        "cpu",
        "--model",
        "vit_tiny",
        "--batch-size",
        "8",
        "--steps",
        "3",
        "--profile-steps",
        "1",
    ]
    assert trainable_position.main([*common, "--out", str(tmp_path / "a")]) == 0
    assert lora_tower.main([*common, "--no-timelines", "--out", str(tmp_path / "b")]) == 0

    a = json.loads((tmp_path / "a" / "trainable_position.json").read_text())
    rows = {r["variant"]: r for r in a["variants"]}
    assert set(rows) == {"full", "first_block", "last_block"}
    assert rows["first_block"]["parameters"]["trainable"] == rows["last_block"]["parameters"]["trainable"]
    saved = {k: r["measured"]["saved_activations_gb"] for k, r in rows.items()}
    assert saved["last_block"] < saved["first_block"] < saved["full"]  # position decides activation memory
    for r in rows.values():  # the estimator's traced activations are what the real forward saved
        assert r["predicted"]["activations_saved_gb"] == pytest.approx(
            r["measured"]["saved_activations_gb"], abs=2e-6
        )
        assert {"forward", "backward", "optimizer"} <= set(r["measured"]["phase_ms"])
        assert Path(r["measured"]["timeline"]["png"]).exists()
    assert (tmp_path / "a" / "trainable_position.png").read_bytes().startswith(PNG_MAGIC)

    b = json.loads((tmp_path / "b" / "lora_tower.json").read_text())
    rows = {r["variant"]: r for r in b["variants"]}
    assert rows["embedded"]["parameters"]["trainable"] == rows["tower"]["parameters"]["trainable"]
    saved = {k: r["measured"]["saved_activations_gb"] for k, r in rows.items()}
    assert saved["tower"] < saved["embedded"] < saved["full"]  # the tower frees the backbone's activations
    assert (tmp_path / "b" / "lora_tower.png").read_bytes().startswith(PNG_MAGIC)


def test_phase_times_are_gpu_side_and_follow_launches_from_other_threads(tmp_path):
    """Kernels count for the range that was open on the host when they were launched, on any thread.

    Backward's kernels are launched by autograd's own thread, so a span read off the main thread alone
    would be empty; this trace has that shape and the backward time must come from its kernels.
    """
    from fabric_memory_recipes.measurement.timeline import phase_ms_from_trace

    def x(name, cat, ts, dur, tid=1, corr=None):
        e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    events = [
        # host ranges on the main thread (microseconds)
        x("## forward ##", "user_annotation", 0, 100),
        x("## backward ##", "user_annotation", 100, 50),
        x("## optimizer ##", "user_annotation", 150, 20),
        x("## forward ##", "user_annotation", 1000, 100),  # a range that launched nothing: host time
        # forward: two launches on the main thread, kernels queue behind them on the GPU
        x("cudaLaunchKernel", "cuda_runtime", 10, 5, corr=1),
        x("cudaLaunchKernel", "cuda_runtime", 90, 5, corr=2),
        x("gemm", "kernel", 200, 300, tid=7, corr=1),
        x("gemm", "kernel", 700, 1300, tid=7, corr=2),  # the GPU idles 500..700 us
        # backward: launched from autograd's thread (tid 2) while the main thread waits in its range
        x("cudaLaunchKernel", "cuda_runtime", 120, 5, tid=2, corr=3),
        x("cuLaunchKernel", "cuda_driver", 140, 5, tid=2, corr=4),
        x("gemm_bwd", "kernel", 2000, 1000, tid=7, corr=3),
        x("Memset", "gpu_memset", 3000, 4000, tid=7, corr=4),
        # optimizer: one fused kernel
        x("cudaLaunchKernel", "cuda_runtime", 160, 5, corr=5),
        x("adam", "kernel", 7000, 500, tid=7, corr=5),
        # a stray kernel launched outside every range is ignored
        x("cudaLaunchKernel", "cuda_runtime", 500, 5, corr=6),
        x("other", "kernel", 8000, 9000, tid=7, corr=6),
        {"ph": "i", "name": "marker", "ts": 0},
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    span, kernel = phase_ms_from_trace(str(trace))
    assert span["forward"] == pytest.approx([1.8, 0.1])  # GPU span 200..2000 us; then host 100 us
    assert span["backward"] == pytest.approx([5.0])  # 2000..7000 us, from kernels of another thread
    assert span["optimizer"] == pytest.approx([0.5])
    # kernel time: the kernels' own durations, idle gaps excluded (forward: 300 + 1300 us)
    assert kernel["forward"] == pytest.approx([1.6, 0.0])
    assert kernel["backward"] == pytest.approx([5.0])
    assert kernel["optimizer"] == pytest.approx([0.5])

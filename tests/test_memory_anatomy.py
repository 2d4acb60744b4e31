"""--memory-timeline and --snapshot (common/profiling.py) and the seed-000 experiments, tiny, on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
    proc = run(
        str(REPO / "recipes" / "05_gradient_accumulation.py"), *TINY, "--max-steps", "3",
        "--eval-batches", "1", "--memory-timeline", "--profile-steps", "2", "--results-dir", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((out / "05_gradient_accumulation.json").read_text())
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
    # the estimate rides along in the same JSON, and the summary says where the files are
    assert payload["estimate"]["peak_allocated_gb"] > 0 and payload["estimate"]["error"] is None
    assert "timeline" in proc.stdout


def test_snapshot_needs_cuda_and_says_so(capsys):
    from common import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args("test", {}, argv=[*TINY, "--snapshot"])
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

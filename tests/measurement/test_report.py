"""fabric_memory_recipes.measurement.report.render: results JSON -> README.md table + ladder.png, on fixtures and on a real CPU run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fabric_memory_recipes.measurement.report import render
from tests.conftest import run_recipe_inprocess

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_result(
    recipe: str,
    *,
    tag: str | None = None,
    status: str = "ok",
    batch: int = 64,
    accum: int = 1,
    precision: str = "32-true",
    allocated: float | None = 26.891,
    reserved: float | None = 29.5,
    kind: str = "cuda",
    images_per_s: float | None = 123.4,
    extra_phases: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """A valid schema-1 payload with the keys documented in fabric_memory_recipes/measurement/results.py."""
    gpu = kind == "cuda"

    def phase(a, r):
        return {
            "peak_allocated_gb": a,
            "peak_reserved_gb": r,
            "per_rank": [{"rank": 0, "allocated_gb": a, "reserved_gb": r}],
        }

    phases = {"model_load": phase(1.2, 1.3), "train": phase(allocated, reserved), "eval": phase(2.0, 2.5)}
    phases.update(extra_phases or {})
    return {
        "schema_version": 1,
        "recipe": recipe,
        "tag": tag,
        "description": f"{recipe} fixture",
        "status": status,
        "error": "CUDA out of memory" if status == "oom" else None,
        "config": {
            "precision": precision,
            "batch_size": batch,
            "accumulation_steps": accum,
            "micro_batch_size": batch // accum,
            "devices": 1,
            "max_steps": 10,
        },
        "provenance": {
            "device": "cuda" if gpu else "cpu",
            "gpu_name": "NVIDIA H100 80GB HBM3" if gpu else None,
            "world_size": 1,
            "num_nodes": 1,
            "torch": "2.5.1",
            "lightning": "2.4.0",
            "torchvision": "0.20.1",
            "python": "3.11.7",
            "cuda": "12.4",
            "float32_matmul_precision": "high",
            "data_source": "cifar10" if gpu else "synthetic",
            "weights": "pretrained" if gpu else "random",
            "model": "vit_l_16" if gpu else "vit_tiny",
            "parameters": 304_000_000,
            "timestamp": "2025-01-01T00:00:00+00:00",
        },
        "memory": {
            "kind": kind,
            "unit": "GB",
            "phases": phases,
            "peak_allocated_gb": allocated,
            "peak_reserved_gb": reserved,
        },
        "timing": {
            "train_wall_s": 100.0,
            "median_step_s": 0.5,
            "images_per_s": images_per_s,
            "optimizer_steps": 10 if status == "ok" else 0,
            "micro_batches": 10 * accum,
            "images_seen": 10 * batch,
            "warmup_steps": 1,
        },
        "accuracy": {"train": 0.91234, "val": 0.8766, "test": 0.87} if status == "ok" else {},
        "loss": {"first": 2.3, "last": 0.4},
        "extra": extra or {},
    }


FIXTURES = {
    "01_baseline.json": make_result("01_baseline", allocated=26.891, reserved=29.5),
    "02_mixed_precision.json": make_result("02_mixed_precision", precision="16-mixed", allocated=18.2),
    "04_lower_batch_size.json": make_result("04_lower_batch_size", batch=16, allocated=5.123),
    "04_lower_batch_size-small.json": make_result(
        "04_lower_batch_size", tag="small", batch=8, allocated=3.333, reserved=4.0
    ),
    "05_gradient_accumulation.json": make_result("05_gradient_accumulation", batch=16, accum=4),
    "03_true_half_precision.json": make_result(
        "03_true_half_precision", status="oom", allocated=None, reserved=None, images_per_s=None
    ),
    "06_cpu.json": make_result("06_sgd_cosine", tag="cpu", kind="cpu_rss", allocated=1.2824, reserved=1.2824),
    "07_init_module.json": make_result(
        "07_init_module",
        extra_phases={
            "load_cpu_then_move": {"peak_allocated_gb": 4.567, "peak_reserved_gb": 4.75, "per_rank": []}
        },
        extra={"model_load_peak_allocated_gb": {"cpu_then_move": 4.567, "init_module": 1.234, "ratio": 0.27}},
    ),
}


def write_fixtures(directory: Path, fixtures: dict = FIXTURES) -> None:
    for name, payload in fixtures.items():
        (directory / name).write_text(json.dumps(payload, indent=2))


def table_rows(markdown: str, mode: bool = False) -> dict[str, list[str]]:
    """Rows of the main table (the first one), keyed by the recipe cell; without the mode column
    (``mode=True``: that column alone)."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| recipe |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    at = header.index("mode")
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[at] if mode else cells[:at] + cells[at + 1 :]
    return rows


def test_mode_column_says_how_each_row_ran(tmp_path):
    """Compiled, CUDA-graph and eager rows are labelled, never an unlabelled mix."""
    runs = {
        "a": {"compile": True, "cuda_graphs": True},
        "b": {"compile": True, "cuda_graphs": False},
        "c": {"compile": False, "cuda_graphs": False},
        "d": {"compile": False},  # an older file without the key
    }
    results = []
    for tag, config in runs.items():
        r = make_result("01_baseline", tag=tag)
        r["config"].pop("cuda_graphs", None)
        r["config"].update(config)
        results.append(r)
    modes = table_rows(render.render_table(results), mode=True)
    assert modes == {
        "01_baseline (a)": "compiled + graphs",
        "01_baseline (b)": "compiled",
        "01_baseline (c)": "eager",
        "01_baseline (d)": "eager",
    }


def run_module(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "fabric_memory_recipes.measurement.report.render", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_png(path: Path) -> None:
    assert path.is_file()
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000


def test_main_renders_table_and_figure(tmp_path):
    write_fixtures(tmp_path)
    assert render.main([str(tmp_path)]) == 0
    markdown = (tmp_path / "README.md").read_text()
    assert_png(tmp_path / "ladder.png")
    assert "![ladder](ladder.png)" in markdown
    assert "python -m fabric_memory_recipes.measurement.report.render" in markdown
    assert "NVIDIA H100 80GB HBM3" in markdown and "**CPU**" in markdown

    rows = table_rows(markdown)
    assert len(rows) == len(FIXTURES)
    # columns: recipe, status, precision, batch, devices, reserved, allocated, img/s, steps, train, val
    base = rows["01_baseline"]
    assert base[1:] == ["ok", "32-true", "64", "1", "29.50", "26.89", "123", "10", "0.912", "0.877"]
    assert rows["02_mixed_precision"][2] == "16-mixed"
    assert rows["05_gradient_accumulation"][3] == "16 (4×4)"
    assert rows["04_lower_batch_size (small)"][3:7] == ["8", "1", "4.00", "3.33"]

    oom = rows["03_true_half_precision"]
    assert oom[1] == "oom" and oom[5:7] == ["OOM", "OOM"]
    assert oom[7] == "—" and oom[9:] == ["—", "—"]
    assert oom[3] == "64"  # its config is still shown

    cpu = rows["06_sgd_cosine (cpu)"]
    assert cpu[5].startswith("1.28") and cpu[5] != "1.28"  # marked with the footnote
    assert "RSS" in markdown
    # synthetic data: its accuracy is not a score, shown as a dash; the note names the real-data rows
    assert cpu[9:] == ["—", "—"] and base[9:] == ["0.912", "0.877"]
    note = next(line for line in markdown.splitlines() if line.startswith("Accuracy is shown"))
    assert "01_baseline (cifar10)" in note and "06_sgd_cosine (cpu)" not in note

    # Sorted by recipe, then tag (untagged first).
    assert list(rows) == [
        "01_baseline",
        "02_mixed_precision",
        "03_true_half_precision",
        "04_lower_batch_size",
        "04_lower_batch_size (small)",
        "05_gradient_accumulation",
        "06_sgd_cosine (cpu)",
        "07_init_module",
    ]

    # Extra phases and recipe extras of rung 07.
    assert "| 07_init_module | load_cpu_then_move | 4.57 | 4.75 |" in markdown
    assert "model_load_peak_allocated_gb" in markdown
    assert "cpu_then_move 4.57" in markdown and "init_module 1.23" in markdown and "ratio 0.27" in markdown


def test_module_subprocess(tmp_path):
    write_fixtures(tmp_path)
    proc = run_module(str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "26.89" in (tmp_path / "README.md").read_text()
    assert_png(tmp_path / "ladder.png")


def test_bad_files_are_skipped_with_a_warning(tmp_path, capsys):
    write_fixtures(tmp_path, {"01_baseline.json": FIXTURES["01_baseline.json"]})
    (tmp_path / "02_broken.json").write_text('{"schema_version": 1, "recipe": ')
    (tmp_path / "01_baseline.rank1.json").write_text(json.dumps(make_result("01_rankfile")))
    (tmp_path / "other.json").write_text(json.dumps({"not": "a result"}))
    (tmp_path / "future.json").write_text(json.dumps({**make_result("09_future"), "schema_version": 2}))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "01_baseline-timeline.json").write_text(json.dumps({"events": []}))  # beside a run: not one
    assert render.main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "02_broken.json" in err and "future.json" in err
    # JSON of the wrong shape was dropped without a word
    assert (
        f"skipping {tmp_path / 'other.json'}: not a results file (wrong shape: an object without schema_version)"
        in err
    )
    assert f"skipping {tmp_path / 'list.json'}: not a results file (wrong shape: an array)" in err
    assert "rank1" not in err and "timeline" not in err
    assert "report: 1 run -> " in out, out  # not "1 runs"
    rows = table_rows((tmp_path / "README.md").read_text())
    assert list(rows) == ["01_baseline"]


def test_load_results_sorted(tmp_path):
    write_fixtures(tmp_path)
    results = render.load_results(tmp_path)
    keys = [(r["recipe"], r["tag"] or "") for r in results]
    assert keys == sorted(keys)


@pytest.mark.parametrize("kind", ["empty", "missing", "only_bad"])
def test_nothing_to_render_exits_2(tmp_path, kind):
    target = tmp_path / "results"
    if kind != "missing":
        target.mkdir()
    if kind == "only_bad":
        (target / "x.json").write_text("not json")
    proc = run_module(str(target))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == (2 if kind == "only_bad" else 1)  # only_bad: its warning, then the error
    assert "Traceback" not in proc.stderr
    assert not (target / "README.md").exists()


def test_end_to_end_with_a_real_run(tmp_path):
    """Guards that report.py reads what metrics.py really writes (the run in this interpreter: conftest)."""
    args = ["--accelerator", "cpu", "--model", "vit_tiny", "--data", "synthetic", "--weights", "none",
            "--max-steps", "3", "--eval-batches", "1"]  # fmt: skip
    run, _ = run_recipe_inprocess("01_baseline", args, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert render.main([str(tmp_path)]) == 0
    markdown = (tmp_path / "README.md").read_text()
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| recipe |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    row = dict(zip(header, (c.strip() for c in lines[start + 2].strip("|").split("|")), strict=True))
    assert (
        row["recipe"] == "01_baseline" and row["tiny run: status"] == "ok" and row["precision"] == "32-true"
    )
    assert row["batch"] == "64" and row["optimizer steps"] == "3" and row["img/s (range)"] != "—"
    assert (
        float(row["peak RSS GB (process)"]) > 0 and "peak reserved GB" not in markdown
    )  # RSS, named as such
    assert "GPU config predicted" not in row and "no full-size prediction here" in markdown
    assert_png(tmp_path / "ladder.png")


# ------------------------------------------------------------------------------- speed range, CPU track
def with_steps(result: dict, p10: float, median: float, p90: float, timed: int = 17) -> dict:
    result["timing"].update(
        median_step_s=median,
        images_per_s=result["config"]["batch_size"] / median,
        timed_intervals=timed,
        step_s={"min": p10 * 0.9, "p10": p10, "median": median, "p90": p90, "max": p90 * 1.2},
    )
    return result


def test_speed_shows_its_median_and_the_range_over_the_timed_steps():
    fast = with_steps(make_result("01_baseline", batch=64), p10=0.100, median=0.125, p90=0.160)
    few = with_steps(make_result("02_mixed_precision", batch=64), 0.1, 0.125, 0.16, timed=2)
    old = make_result("03_true_half_precision")  # no timing.step_s: a JSON older than the spread
    rows = table_rows(render.render_table([fast, few, old]))
    assert rows["01_baseline"][7] == "512 (400–640)"  # 64 images / 0.125 s; at p90 0.16 s and p10 0.1 s
    assert rows["02_mixed_precision"][7] == "512"  # 2 timed intervals: no range
    assert rows["03_true_half_precision"][7] == "123"
    markdown = render.render_markdown([fast, old])
    assert "p90 and the p10 step interval" in markdown


def cpu_run(recipe: str, batch: int = 64) -> dict:
    r = make_result(recipe, kind="cpu_rss", batch=batch, allocated=0.98, reserved=0.98)
    r["provenance"]["data_source"] = "digits"
    return with_steps(r, 0.008, 0.01, 0.02)


def predicted_file(directory: Path, rows: dict[str, float | None]) -> None:
    payload = {
        "schema_version": 1,
        "what": "predicted (ViT-L/16, GPU config)",
        "rows": [
            {
                "recipe": name,
                "peak_allocated_gb": gb,
                "error": None if gb is not None else "RuntimeError: boom",
                "config": {
                    "precision": "bf16-true",
                    "batch_size": 16,
                    "accumulation_steps": 4,
                    "micro_batch_size": 4,
                    "devices": 1,
                    "model": "vit_l_16",
                },
            }
            for name, gb in rows.items()
        ],
    }
    (directory / "predicted.json").write_text(json.dumps(payload))


def test_cpu_track_shows_the_predicted_full_size_memory_labelled_beside_the_tiny_run(tmp_path, capsys):
    runs = {"01_baseline": 64, "05_gradient_accumulation": 16, "14_memory_floor": 4}
    fixtures = {f"{name}.json": cpu_run(name, batch) for name, batch in runs.items()}
    fixtures["15_speed.json"] = cpu_run("15_speed", 256)
    fixtures["15_speed.json"]["extra"] = {"mfu": None, "achieved_tflops": 0.05}
    write_fixtures(tmp_path, fixtures)
    predicted_file(tmp_path, {"01_baseline": 25.118, "05_gradient_accumulation": 3.133, "15_speed": None})
    assert render.main([str(tmp_path)]) == 0
    assert "predicted.json" not in capsys.readouterr().err  # not taken for a results file
    markdown = (tmp_path / "README.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| recipe |"))
    assert "predicted (ViT-L/16, GPU config): peak allocated GB" in header
    assert "peak RSS GB (process)" in header and "peak reserved GB" not in header
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
        for line in markdown.splitlines()
        if line.startswith("| 0") or line.startswith("| 1")
    }
    assert rows["01_baseline"][1:3] == ["25.12", "bf16-true, batch 16 (4×4)"]
    assert rows["05_gradient_accumulation"][1] == "3.13"
    assert rows["14_memory_floor"][1:3] == ["—", "not predicted"]
    assert rows["15_speed"][1] == "—" and "prediction failed" in rows["15_speed"][2]
    assert rows["01_baseline"][6] == "0.98" and rows["01_baseline"][7] == "6400 (3200–8000)"
    assert "not measured here" in markdown and "Predicted vs measured peak" not in markdown
    assert "None" not in markdown and "`mfu`: n/a" in markdown
    assert_png(tmp_path / "ladder.png")


def test_a_cpu_folder_without_predictions_names_rss_as_rss_and_a_stopped_ladder_says_so(tmp_path):
    """A CPU ladder stopped before its prediction: the process RSS is not labelled 'peak reserved / peak
    allocated', and the report says that the ladder stopped."""
    write_fixtures(tmp_path, {"01_baseline.json": cpu_run("01_baseline")})
    assert render.main([str(tmp_path)]) == 0
    markdown = (tmp_path / "README.md").read_text()
    assert "peak RSS GB (process)" in markdown and "peak reserved GB" not in markdown
    assert "predicted (ViT-L/16" not in markdown and "Stopped before it finished" not in markdown
    started = (tmp_path / "01_baseline.json").stat().st_mtime - 1
    (tmp_path / "run_all.json").write_text(
        json.dumps({"started": started, "mode": "cpu", "state": "stopped", "recipes": ["01_baseline"]})
    )
    assert render.main([str(tmp_path)]) == 0
    assert "Stopped before it finished" in (tmp_path / "README.md").read_text()


def test_the_table_is_written_without_matplotlib(tmp_path, monkeypatch, capsys):
    write_fixtures(tmp_path)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert render.main([str(tmp_path)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["report: matplotlib is not installed: table written, figure skipped"]
    markdown = (tmp_path / "README.md").read_text()
    assert "26.89" in markdown and "![ladder]" not in markdown
    assert not (tmp_path / "ladder.png").exists()


def test_the_cpu_speed_figure_carries_each_runs_spread():
    """A noisy CPU step can show checkpointing 26x faster: the bars carry the p10-p90 rates."""
    from fabric_memory_recipes.measurement.report import cpu as report_cpu

    run = with_steps(cpu_run("10_activation_checkpointing"), p10=0.01, median=0.02, p90=0.08)
    batch = run["config"]["batch_size"]
    assert report_cpu._rate(run, "p10", 0.0) == pytest.approx(batch / 0.01)
    assert report_cpu._rate(run, "p90", 0.0) == pytest.approx(batch / 0.08)
    bare = cpu_run("01_baseline")
    bare["timing"].pop("step_s", None)
    assert report_cpu._rate(bare, "p90", 123.0) == 123.0  # no step times: no spread

"""Every numbered recipe runs end to end on CPU and writes a results JSON with the documented keys.

The recipes are discovered from recipes/[0-9][0-9]_*.py, so a new rung is covered without editing this
file. One-process runs run in this interpreter (conftest.run_recipe_inprocess); rungs that shard across
devices (default --devices > 1) run as a process with 2 CPU ranks (gloo), started in the background as
soon as the tests are collected. The first recipe runs with ``--tag`` (one run checks both its
results and the file-name suffix). The rungs built on Fabric's FSDPStrategy cannot run on CPU and must
say so clearly (exit 2, one line).
"""

from __future__ import annotations

import math
import os
import runpy
import sys

import pytest

from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.planning.plan import plan_for
from tests.conftest import (
    CPU_ARGS,
    CUDA_ONLY_RECIPES,
    RECIPES_DIR,
    describe,
    load_recipe_module,
    recipe_files,
    recipe_names,
    result,
    run_recipe_inprocess,
    session_dir,
    submit_recipe,
)

RECIPES = recipe_names()
CPU_RECIPES = [n for n in RECIPES if n not in CUDA_ONLY_RECIPES]
CUDA_ONLY = [n for n in RECIPES if n in CUDA_ONLY_RECIPES]
TAG = "smoke"
TAGGED = RECIPES[0] if RECIPES else None
BACKGROUND_PRIORITY = 20
BACKGROUND_TESTS = {"test_recipe_runs_on_cpu_and_writes_results"}  # the sharded rungs' processes
_RUNS: dict = {}


def test_recipes_are_discovered():
    assert len(RECIPES) >= 7, RECIPES
    assert RECIPES[0].startswith("01_")


def _rung(name: str):
    return load_recipe_module(name).RUNG


def _cpu_precision(name: str) -> str | None:
    """fp16 autocast needs CUDA; on CPU the analogue is bf16 autocast (as run_all.sh's CPU path does)."""
    return "bf16-mixed" if _rung(name).precision == "16-mixed" else None


def _cpu_devices(name: str) -> int:
    """A sharding rung keeps its multi-process path on CPU: 2 processes (when there are 2 cores)."""
    return min(2, os.cpu_count() or 1) if _rung(name).devices > 1 else 1


def _args(name: str) -> list[str]:
    args = list(CPU_ARGS)
    precision = _cpu_precision(name)
    if precision:
        args += ["--precision", precision]
    if _rung(name).devices > 1:
        args += ["--devices", str(_cpu_devices(name))]
    if name == TAGGED:
        args += ["--tag", TAG]
    return args


def start_background_jobs(selected: list[str]) -> None:
    """The sharded rungs' runs (several processes) that the selected tests need."""
    for name in CPU_RECIPES:
        if _cpu_devices(name) > 1 and f"test_recipe_runs_on_cpu_and_writes_results[{name}]" in selected:
            submit_recipe(f"recipes:{name}", name, _args(name))


def _run(name: str):
    """The recipe's CPU run: a process in the background for the sharded rungs, in-process otherwise
    (once per session: two tests read the tagged one)."""
    if _cpu_devices(name) > 1:
        return result(f"recipes:{name}")
    if name not in _RUNS:
        results_dir = session_dir(f"results-{name}")
        _RUNS[name] = (*run_recipe_inprocess(name, _args(name), results_dir), results_dir)
    return _RUNS[name]


@pytest.mark.parametrize("name", CPU_RECIPES)
def test_recipe_runs_on_cpu_and_writes_results(name):
    proc, p, results_dir = _run(name)
    tag = TAG if name == TAGGED else None
    file_name = f"{name}-{tag}.json" if tag else f"{name}.json"
    assert proc.returncode == 0, describe(proc)
    assert p is not None, f"no {file_name} in {results_dir}" + describe(proc)
    assert [f.name for f in results_dir.iterdir()] == [file_name], "only the JSON, no temp/rank files"
    rung = _rung(name)
    world = _cpu_devices(name)

    assert p["schema_version"] == 1
    assert p["recipe"] == name
    assert p["tag"] == tag
    assert p["status"] == "ok" and p["error"] is None

    cfg = p["config"]
    assert cfg["precision"] == (_cpu_precision(name) or rung.precision)
    assert cfg["batch_size"] == rung.batch_size
    assert cfg["accumulation_steps"] == rung.accumulation_steps
    assert cfg["micro_batch_size"] == rung.batch_size // rung.accumulation_steps
    assert cfg["max_steps"] == 3 and cfg["model"] == "vit_tiny" and cfg["accelerator"] == "cpu"
    assert cfg["devices"] == world

    prov = p["provenance"]
    assert prov["device"] == "cpu"
    assert prov["gpu_name"] is None
    assert prov["world_size"] == world
    assert prov["data_source"] == "synthetic"
    assert prov["weights"] == "random"
    assert prov["model"] == "vit_tiny"
    assert isinstance(prov["parameters"], int) and prov["parameters"] > 0
    for key in ("torch", "lightning", "torchvision", "python", "timestamp", "float32_matmul_precision"):
        assert prov.get(key), key

    mem = p["memory"]
    assert mem["kind"] == "cpu_rss"
    assert mem["unit"] == "GB"
    assert {"model_load", "train", "eval"} <= set(mem["phases"])
    assert mem["peak_allocated_gb"] == mem["phases"]["train"]["peak_allocated_gb"] > 0
    assert mem["peak_reserved_gb"] == mem["phases"]["train"]["peak_reserved_gb"] > 0
    assert sorted(r["rank"] for r in mem["phases"]["train"]["per_rank"]) == list(range(world))

    t = p["timing"]
    k = rung.accumulation_steps
    assert t["optimizer_steps"] == 3
    assert t["micro_batches"] == 3 * k, "each optimizer step should consume accumulation_steps micro-batches"
    assert t["images_seen"] == 3 * k * cfg["micro_batch_size"] * world
    assert t["train_wall_s"] > 0
    assert t["median_step_s"] is not None and t["median_step_s"] > 0
    assert t["images_per_s"] == pytest.approx(rung.batch_size * world / t["median_step_s"])
    assert t["warmup_steps"] + t["timed_intervals"] == 2  # 3 steps -> 2 intervals between them

    assert set(p["accuracy"]) >= {"train", "val", "test"}
    for split in ("train", "val", "test"):
        assert 0.0 <= p["accuracy"][split] <= 1.0, split
    assert math.isfinite(p["loss"]["first"]) and math.isfinite(p["loss"]["last"])
    assert isinstance(p["extra"], dict)

    # The estimate read the technique from what the code built; the rung's declaration, which the
    # planner reads without running the recipe, says the same (planning/simulation/built.py).
    built = p["estimate"]["assumptions"]
    declared = plan_for(declared_rung(name)[0])
    assert (built["optimizer"], built["optimizer_impl"], tuple(built["activation_checkpointing"])) == (
        declared.optimizer,
        declared.optimizer_impl,
        declared.activation_checkpointing,
    ), "RUNG declares another technique than the recipe builds"

    # The summary block is printed on stdout (once, by rank 0) and names the file written.
    assert proc.stdout.count(f"== {name}{'-' + tag if tag else ''}: OK") == 1, describe(proc)
    assert str(results_dir / file_name) in proc.stdout


def test_tag_suffixes_the_results_file():
    proc, p, results_dir = _run(TAGGED)
    assert proc.returncode == 0, describe(proc)
    assert sorted(f.name for f in results_dir.iterdir()) == [f"{TAGGED}-{TAG}.json"]
    assert p["tag"] == TAG and p["config"]["tag"] == TAG
    assert p["status"] == "ok"


@pytest.mark.parametrize("name", CUDA_ONLY)
def test_cuda_only_recipe_refuses_cpu_clearly(name, monkeypatch, capsys, tmp_path):
    """Run as __main__ in-process: the refusal comes before Fabric exists, so nothing else can print."""
    path = str(RECIPES_DIR / f"{name}.py")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *_args(name), "--results-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(path, run_name="__main__")
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{name}.py: error: "), captured.err
    assert "CUDA" in lines[0]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("path", recipe_files(), ids=lambda p: p.stem)
def test_help_exits_0_and_documents_flags(path, monkeypatch, capsys):
    """``python recipes/X.py --help``, run as __main__ in-process (a subprocess per recipe costs ~6 s)."""
    monkeypatch.setattr(sys, "argv", [path.name, "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(path), run_name="__main__")
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    for flag in ("--accumulation-steps", "--batch-size", "--precision", "--devices", "--max-steps", "--tag"):
        assert flag in out, flag
    assert out.startswith("usage: " + path.name)

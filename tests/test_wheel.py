"""The installed wheel alone: built from this checkout, installed without the checkout, and run with
only its declared dependencies importable (no extra, no test tool). Its console scripts start, and
``fmr-estimate`` plans in every mode a wheel user has; ``--model hf:`` without transformers, and the
picks' commands that need the checkout, each say so in one line."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO, describe, result, session_dir, submit

DIST = "fabric-memory-recipes"
BACKGROUND_PRIORITY = 20  # one of the longest jobs (a wheel built and installed, every console script)
QWEN = str(REPO / "examples" / "configs" / "qwen2-0.5b")
CALLS = {  # name: (console script, arguments)
    "help": ("fmr-estimate", ["--help"]),
    "recipe": ("fmr-estimate", ["--recipe", "14_memory_floor"]),
    "fit": ("fmr-estimate", ["--fit", "8GB"]),
    # a small search (ResNet-50 at batch 64 took 34 s of CPU here): what is checked is the wheel's data
    "model_fit": ("fmr-estimate", ["--model", "torchvision:resnet18", "--batch-size", "8", "--fit", "4GB"]),
    "hf": ("fmr-estimate", ["--model", f"hf:{QWEN}"]),
    "ladder_help": ("fmr-ladder", ["--help"]),
    "report_help": ("fmr-report", ["--help"]),
    "compare_help": ("fmr-compare", ["--help"]),
    "convergence_help": ("fmr-convergence", ["--help"]),
}

# Runs inside the wheel's interpreter (python -S: no site-packages, only the paths given): every call in
# one process, each console script found through the installed wheel's entry points.
DRIVER = r"""
import contextlib, importlib, importlib.metadata as md, io, json, sys
calls = json.loads(sys.argv[1])
scripts = {e.name: e for e in md.distribution("fabric-memory-recipes").entry_points if e.group == "console_scripts"}
import fabric_memory_recipes
out = {"package": fabric_memory_recipes.__file__, "scripts": sorted(scripts)}
for name, (script, args) in calls.items():
    buf = io.StringIO()
    sys.argv = [script, *args]
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            code = scripts[script].load()()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:
            code, _ = "raised", print(f"{type(e).__name__}: {e}")
    out[name] = {"code": code, "output": buf.getvalue()}
print(json.dumps(out))
"""


def declared_closure(dist: str) -> list[md.Distribution]:
    """The distributions ``dist`` needs without any extra, transitively (as pip would install them)."""
    seen, todo, found = set(), [dist], []
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            d = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        found.append(d)
        for text in d.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def site_of(dists: list[md.Distribution], view: Path) -> None:
    """A folder that holds exactly ``dists`` (links to their installed top-level files)."""
    view.mkdir(parents=True)
    for d in dists:
        if canonicalize_name(d.metadata["Name"]) == DIST:
            continue  # the checkout's own install: the wheel replaces it
        root = Path(d.locate_file(""))
        for top in {Path(f).parts[0] for f in d.files or [] if not str(f).startswith("..")}:
            if top not in ("__pycache__", "bin") and (root / top).exists() and not (view / top).exists():
                os.symlink(root / top, view / top)


def _run_wheel():
    tmp = session_dir("wheel")
    wheels, site, deps = tmp / "dist", tmp / "site", tmp / "deps"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", str(REPO), "-w", str(wheels)],
        capture_output=True,
        text=True,
        cwd=tmp,
    )
    if build.returncode:
        return build, None
    wheel = next(wheels.glob("*.whl"))
    install = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        cwd=tmp,
    )
    if install.returncode:
        return install, None
    site_of(declared_closure(DIST), deps)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=f"{site}{os.pathsep}{deps}", HOME=str(tmp / "home"), FMR_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-S", "-c", DRIVER, json.dumps(CALLS)],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=600,
    )
    return proc, site


def start_background_jobs() -> None:
    submit("wheel", _run_wheel)


@pytest.fixture(scope="module")
def wheel_run() -> dict:
    proc, site = result("wheel")
    assert proc.returncode == 0 and site is not None, describe(proc)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["package"].startswith(str(site)), out["package"]  # the wheel's copy, not the checkout's
    return out


def test_the_closure_leaves_out_the_extras():
    names = {canonicalize_name(d.metadata["Name"]) for d in declared_closure(DIST)}
    assert {"torch", "lightning", "scikit-learn"} <= names
    assert not {"transformers", "huggingface-hub", "timm", "peft", "pytest"} & names


def test_every_console_script_of_the_wheel_starts(wheel_run):
    assert wheel_run["scripts"] == sorted({script for script, _ in CALLS.values()})
    for name in ("help", "ladder_help", "report_help", "compare_help", "convergence_help"):
        assert wheel_run[name]["code"] == 0, (name, wheel_run[name]["output"][-2000:])
    assert "checkout" in wheel_run["ladder_help"]["output"]


def test_the_wheel_estimates_and_plans_without_the_checkout(wheel_run):
    for name in ("recipe", "fit", "model_fit"):
        run = wheel_run[name]
        assert run["code"] == 0, (name, run["output"][-3000:])
        assert "Traceback" not in run["output"], run["output"][-3000:]
    assert "whole-device peak" in wheel_run["recipe"]["output"]
    # both planners plan from the package data alone: the ladder's picks show the committed runs' speeds
    assert "Fastest that fit" in wheel_run["fit"]["output"]
    assert re.search(r"^ +1 +\d+ measured ", wheel_run["fit"]["output"], re.M), wheel_run["fit"]["output"]
    assert "Which technique sets fit 4 GB?" in wheel_run["model_fit"]["output"]
    for name in ("fit", "model_fit"):  # the picks name recipes/*.py: a wheel user is told where they run
        assert "python recipes/" in wheel_run[name]["output"]
        assert wheel_run[name]["output"].rstrip().endswith("python3 -m pip install -e .)")


def test_a_hugging_face_model_without_transformers_is_one_line(wheel_run):
    run = wheel_run["hf"]
    assert run["code"] == 2, run["output"][-2000:]
    lines = run["output"].strip().splitlines()
    assert len(lines) == 1 and "pip install 'fabric-memory-recipes[hf]'" in lines[0], lines

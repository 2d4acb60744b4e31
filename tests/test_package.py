"""The installed package as a user meets it: one importable package named for the project (no top-level
``common`` or ``tools``), imports and ``python -m`` forms that work from any folder, console scripts
whose ``--help`` shows the name that was typed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fabric_memory_recipes import console
from fabric_memory_recipes.tools import ladder
from tests.conftest import REPO, result, session_dir, submit

SCRIPTS = ("fmr-ladder", "fmr-estimate", "fmr-report", "fmr-compare", "fmr-convergence")


# The environment at collection: the jobs below run while other tests may set variables of their own.
ENV = dict(os.environ)
SHELL_ENV = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}  # as a user's shell: no checkout on the path


def _python(code_or_args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *code_or_args], cwd=cwd, env=SHELL_ENV, capture_output=True, text=True, timeout=120
    )


def _installed() -> bool:
    probe = _python(
        ["-c", "import fabric_memory_recipes, sys; print(fabric_memory_recipes.__file__)"], Path("/")
    )
    return probe.returncode == 0


INSTALLED = _installed()
needs_install = pytest.mark.skipif(not INSTALLED, reason="the project is not installed (pip install -e .)")


# ------------------------------------------------------------------------------------ background jobs
# Each check starts fresh interpreters that import torch and Lightning (~6 s of CPU each): they run in the
# background while the in-process tests go on (conftest: background jobs), each test waits for its own.
def _imports_from_any_folder() -> dict[str, subprocess.CompletedProcess]:
    tmp = session_dir("package-imports")
    runs = {
        "ok": _python(
            ["-c", "import fabric_memory_recipes.training.loop, fabric_memory_recipes.planning"], tmp
        )
    }
    return runs | {name: _python(["-c", f"import {name}"], tmp) for name in ("common", "tools")}


def _dash_m_from_any_folder() -> dict[str, subprocess.CompletedProcess]:
    tmp = session_dir("package-dash-m")
    modules = ("fabric_memory_recipes.measurement.report.render", "fabric_memory_recipes.planning")
    return {m: _python(["-m", m, "--help"], tmp) for m in modules}


def _script_paths() -> dict[str, str | None]:
    return {s: shutil.which(s, path=str(Path(sys.executable).parent)) for s in SCRIPTS}


def _console_scripts_help() -> dict[str, subprocess.CompletedProcess]:
    """Each installed console script's ``--help``, one after the other (each imports torch)."""
    tmp = session_dir("package-scripts")
    return {
        s: subprocess.run([p, "--help"], cwd=tmp, env=ENV, capture_output=True, text=True, timeout=180)
        for s, p in _script_paths().items()
        if p is not None
    }


JOBS = {
    "test_the_package_imports_from_any_folder_and_common_does_not": ("package:imports", _imports_from_any_folder),
    "test_python_dash_m_works_from_any_folder_and_help_names_the_module": ("package:dash-m", _dash_m_from_any_folder),
    "test_console_scripts_are_installed_and_help_shows_their_name": ("package:scripts", _console_scripts_help),
}  # fmt: skip
BACKGROUND_TESTS = set(JOBS)


def start_background_jobs(selected: list[str]) -> None:
    if INSTALLED:
        for name in selected:
            if name in JOBS:
                submit(*JOBS[name])


@needs_install
def test_the_package_imports_from_any_folder_and_common_does_not():
    runs = result("package:imports")
    assert runs["ok"].returncode == 0, runs["ok"].stderr
    for name in ("common", "tools"):
        gone = runs[name]
        assert gone.returncode != 0 and "ModuleNotFoundError" in gone.stderr, name


@needs_install
def test_python_dash_m_works_from_any_folder_and_help_names_the_module():
    runs = result("package:dash-m")
    run = runs["fabric_memory_recipes.measurement.report.render"]
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: python -m fabric_memory_recipes.measurement.report.render")
    run = runs["fabric_memory_recipes.planning"]
    assert run.returncode == 0 and run.stdout.startswith("usage: python -m fabric_memory_recipes.planning ")


@needs_install
def test_console_scripts_are_installed_and_help_shows_their_name():
    paths = _script_paths()
    if None in paths.values():
        pytest.skip(f"not beside {sys.executable}: {[s for s, p in paths.items() if p is None]}")
    for script, proc in result("package:scripts").items():
        assert proc.returncode == 0, (script, proc.stderr)
        if script == "fmr-ladder":  # run_all.sh's own help, from the checkout the package was installed from
            assert "./run_all.sh --quick" in proc.stdout
        else:
            assert proc.stdout.startswith(f"usage: {script}"), (script, proc.stdout[:200])


def test_program_names_what_was_typed():
    module = Path(console.__file__).parent / "measurement" / "report" / "render.py"
    assert console.program(str(module)) == "python -m fabric_memory_recipes.measurement.report.render"
    assert console.program(str(module.parents[2] / "planning" / "__main__.py")) == (
        "python -m fabric_memory_recipes.planning"
    )
    assert console.program("/usr/local/bin/fmr-report") == "fmr-report"
    assert (
        console.program(str(REPO / "recipes" / "05_gradient_accumulation.py"))
        == "05_gradient_accumulation.py"
    )


def test_a_console_script_help_keeps_what_follows_the_module(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/fmr-estimate", "--fit", "8GB"])
    assert console.Parser(prog="python -m fabric_memory_recipes.planning --fit").prog == "fmr-estimate --fit"
    monkeypatch.setattr(sys, "argv", ["/x/fabric_memory_recipes/planning/__main__.py"])
    assert console.Parser(prog="python -m fabric_memory_recipes.planning --fit").prog == (
        "python -m fabric_memory_recipes.planning --fit"
    )


def test_the_ladder_launcher_needs_a_checkout_and_says_so_in_one_line(tmp_path, capsys):
    assert ladder.run_all_script(REPO) == REPO / "run_all.sh"
    with pytest.raises(SystemExit) as stop:
        ladder.run_all_script(tmp_path)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install -e" in err

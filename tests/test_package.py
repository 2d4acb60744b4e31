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
from tests.conftest import REPO

SCRIPTS = ("fmr-ladder", "fmr-estimate", "fmr-report", "fmr-compare", "fmr-convergence")


def _python(code_or_args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH"
    }  # as a user's shell: no checkout on the path
    return subprocess.run(
        [sys.executable, *code_or_args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _installed() -> bool:
    probe = _python(
        ["-c", "import fabric_memory_recipes, sys; print(fabric_memory_recipes.__file__)"], Path("/")
    )
    return probe.returncode == 0


needs_install = pytest.mark.skipif(not _installed(), reason="the project is not installed (pip install -e .)")


@needs_install
def test_the_package_imports_from_any_folder_and_common_does_not(tmp_path):
    ok = _python(
        ["-c", "import fabric_memory_recipes.training.loop, fabric_memory_recipes.planning"], tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    for name in ("common", "tools"):
        gone = _python(["-c", f"import {name}"], tmp_path)
        assert gone.returncode != 0 and "ModuleNotFoundError" in gone.stderr, name


@needs_install
def test_python_dash_m_works_from_any_folder_and_help_names_the_module(tmp_path):
    run = _python(["-m", "fabric_memory_recipes.measurement.report.render", "--help"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: python -m fabric_memory_recipes.measurement.report.render")
    run = _python(["-m", "fabric_memory_recipes.planning", "--help"], tmp_path)
    assert run.returncode == 0 and run.stdout.startswith("usage: python -m fabric_memory_recipes.planning ")


@needs_install
def test_console_scripts_are_installed_and_help_shows_their_name(tmp_path):
    paths = {s: shutil.which(s, path=str(Path(sys.executable).parent)) for s in SCRIPTS}
    if None in paths.values():
        pytest.skip(f"not beside {sys.executable}: {[s for s, p in paths.items() if p is None]}")
    running = {
        s: subprocess.Popen(
            [p, "--help"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for s, p in paths.items()
    }  # fmt: skip  (side by side: each imports torch)
    for script, proc in running.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, (script, err)
        if script == "fmr-ladder":  # run_all.sh's own help, from the checkout the package was installed from
            assert "./run_all.sh --quick" in out
        else:
            assert out.startswith(f"usage: {script}"), (script, out[:200])


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

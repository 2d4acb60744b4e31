"""Shared fixtures: run recipes in this interpreter (CPU, offline), or as processes where a process is
what is tested.

Every recipe runs with FMR_OFFLINE=1 (no network look-ups) and FMR_LOG_DIR in a temporary folder
(Fabric's CSV/TensorBoard logs), from the repository root.

* In-process (:func:`run_recipe_inprocess`, the ``run_recipe`` fixture): the recipe file runs as
  ``__main__`` with a patched ``sys.argv`` (runpy), in the interpreter that has imported torch and
  Lightning once. This is how a recipe run is tested: its flags, its results JSON, its one-line
  refusals and exit codes (``SystemExit``).
* A process (:func:`run_process`, :func:`run_recipe_process`, :class:`Started`; tests/processes): what
  needs one - several ranks (gloo), real signals and their exit codes, ``run_all.sh`` and the tools' command
  lines. A fresh interpreter spends ~6 s of CPU importing torch/Lightning: a recipe or tool that imports
  Lightning first starts from a pre-imported zygote where that is the same (tests/processes/zygote.py).
  These processes start as background jobs: a test module may define ``start_background_jobs()``; it is
  called once the tests are collected (only for modules with selected tests) and submits its runs with
  :func:`submit` / :func:`submit_recipe`. They run while the in-process tests go on; a test waits for its
  own with :func:`result`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
import runpy
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest

from tests.processes import (  # noqa: F401 - the tests import them from here
    REPO,
    ZYGOTE,
    Started,
    background_priority,
    from_a_terminal,
    jobs,
    run_process,
)
from tests.processes.jobs import result, submit  # noqa: F401 - the tests import them from here
from tests.processes.state import process_state_kept
from tests.processes.zygote import server_argv

RECIPES_DIR = REPO / "recipes"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# In-process code (fabric_memory_recipes.measurement.results reads FMR_LOG_DIR at import time; fabric_memory_recipes.training.data.network reads FMR_OFFLINE)
# must see these before anything imports fabric_memory_recipes.*: set them while conftest is imported.
_TMP_ROOT = Path(tempfile.mkdtemp(prefix="fmr-tests-"))
_LOG_DIR = _TMP_ROOT / "logs"
os.environ["FMR_OFFLINE"] = "1"
# No torch.compile in CPU tests: compiling costs minutes on 2 cores and is not what they check. torchao's
# 8-bit Adam (rung 13) compiles its update step; with dynamo disabled it runs the same step eagerly.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ["FMR_LOG_DIR"] = str(_LOG_DIR)
# No planner worker processes (planning/planner/workers.py): on the suite's 2 busy cores their simulations ahead
# of the search only add CPU (the README's Qwen2 --fit: ~130 CPU-s with two, ~98 without, the same plan).
# tests/planning/your_model/test_fit_workers.py sets it where the workers are what it tests.
os.environ.setdefault("FMR_PLAN_WORKERS", "0")
# The planners' simulated steps (planning/simulation/cache.py), kept for this session: its tests and the
# processes they start share them (the README's --fit 8GB, --check and the planner's tests simulate the same
# ViT-L/16 steps), and a session starts without the user's own cache file, as CI does (unless FMR_PLAN_CACHE
# names one).
os.environ.setdefault("FMR_PLAN_CACHE", str(_TMP_ROOT / "simulations.json"))
# The environment the processes the tests start inherit: the session's, as it began. Not os.environ at the
# time of the start: background jobs start their processes while in-process tests run, and what such a test
# sets meanwhile (monkeypatch.setenv("FMR_PUBLISH", "1"), or PL_GLOBAL_SEED, OMP_NUM_THREADS and
# PYTORCH_CUDA_ALLOC_CONF, which Lightning and the recipes export) would reach whichever process started then.
_SESSION_ENV = dict(os.environ)

# The flags that make any recipe a quick CPU run (see run_all.sh's CPU path).
CPU_ARGS = (
    "--accelerator", "cpu", "--model", "vit_tiny", "--data", "synthetic", "--weights", "none",
    "--max-steps", "3", "--eval-batches", "1",
)  # fmt: skip
# Rungs whose strategy (Fabric's FSDPStrategy) refuses the CPU: on CPU they must exit 2 with one line
# saying so (docs/08_fsdp.md); everything else runs on CPU.
CUDA_ONLY_RECIPES = frozenset({"08_fsdp"})


# ------------------------------------------------------------------------------------------ discovery
def free_port() -> int:
    """A TCP port free on this host now (a gloo group's rendezvous): another suite here may hold a fixed one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def recipe_files() -> list[Path]:
    """The numbered ladder, discovered (new rungs are covered without editing the tests)."""
    return sorted(RECIPES_DIR.glob("[0-9][0-9]_*.py"))


def recipe_names() -> list[str]:
    return [p.stem for p in recipe_files()]


def load_recipe_module(name: str):
    """Import ``recipes/<name>.py`` as a module (its ``main`` and ``RUNG``), not as __main__. What the file
    sets for its process at import (rung 14 exports PYTORCH_CUDA_ALLOC_CONF before CUDA starts) is put
    back: a module loaded outside a test (a background job's set-up, at collection) would leave it to
    every test after."""
    path = RECIPES_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    with process_state_kept():
        spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------- subprocesses
def subprocess_env(log_dir: str | os.PathLike | None = None, **extra: str) -> dict[str, str]:
    """The environment of a process a test starts: the session's (``_SESSION_ENV``), never what a test
    running at the time has set, plus the settings below and ``extra``."""
    env = dict(_SESSION_ENV)
    env["FMR_OFFLINE"] = "1"
    env["FMR_LOG_DIR"] = str(log_dir or _LOG_DIR)
    env["PYTHONUNBUFFERED"] = "1"
    # run_all.sh starts recipes with $PYTHON: the interpreter running pytest (not python3 on
    # PATH, which may lack torch when pytest runs as venv/bin/python -m pytest without an activated venv)
    env["PYTHON"] = sys.executable
    # `fabric_memory_recipes` importable from a plain checkout too (as run_all.sh does), not only after pip install -e .
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    # Several recipe processes run at once on few cores: one intra-op thread each avoids thrashing.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _option(args: Sequence[str], flag: str) -> str | None:
    args = list(args)
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def run_recipe_inprocess(
    name: str, args: Sequence[str], results_dir: str | os.PathLike
) -> tuple[subprocess.CompletedProcess, dict | None]:
    """``python recipes/<name>.py *args``, run in this interpreter: the file is executed as
    ``__main__`` with its own ``sys.argv`` (runpy, as torchtune's recipe tests do), stdout and stderr
    captured, ``SystemExit`` taken as the exit code and an uncaught exception as exit code 1 with its
    traceback on stderr (what the interpreter would print). Returns (the outcome as a
    CompletedProcess, the results JSON or None).

    ``--results-dir results_dir`` is added unless ``args`` has one. The JSON is the file the recipe is
    documented to write: ``<results_dir>/<name>[-<tag>].json``. Everything that needs a real process
    (signals, several ranks, exit codes of the interpreter itself) uses :func:`run_process` instead.
    """
    args = [str(a) for a in args]
    where = _option(args, "--results-dir")
    if where is None:
        where = str(results_dir)
        args += ["--results-dir", where]
    path = RECIPES_DIR / f"{name}.py"
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_path = sys.argv, list(sys.path)
    code = 0
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(RECIPES_DIR))  # as `python recipes/<name>.py` sets sys.path[0]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    proc = subprocess.CompletedProcess(
        [sys.executable, str(path), *args], code, out.getvalue(), err.getvalue()
    )
    tag = _option(args, "--tag")
    json_path = Path(where) / (f"{name}-{tag}.json" if tag else f"{name}.json")
    payload = (
        json.loads(json_path.read_text()) if os.path.exists(json_path) else None
    )  # a too-long path: none
    return proc, payload


def run_recipe_process(
    name: str, args: Sequence[str], results_dir: str | os.PathLike, log_dir=None
) -> tuple[subprocess.CompletedProcess, dict | None]:
    """``python recipes/<name>.py *args`` as a real process (several ranks, signals); as
    :func:`run_recipe_inprocess` otherwise."""
    args = [str(a) for a in args]
    where = _option(args, "--results-dir")
    if where is None:
        where = str(results_dir)
        args += ["--results-dir", where]
    proc = run_process([sys.executable, str(RECIPES_DIR / f"{name}.py"), *args], subprocess_env(log_dir))
    tag = _option(args, "--tag")
    path = Path(where) / (f"{name}-{tag}.json" if tag else f"{name}.json")
    payload = json.loads(path.read_text()) if path.exists() else None
    return proc, payload


@pytest.fixture
def run_recipe(tmp_path):
    """``run_recipe(name, *args)`` -> (CompletedProcess, parsed results JSON or None), run now in-process."""

    def _run(name: str, *args: str):
        return run_recipe_inprocess(name, args, tmp_path / "results")

    return _run


def describe(proc: subprocess.CompletedProcess) -> str:
    """Everything a failing assertion needs to show about a process."""
    return (
        f"\n$ {' '.join(map(str, proc.args))}\nexit {proc.returncode}\n"
        f"--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-3000:]}"
    )


# ------------------------------------------------------------------------------------- background jobs
def session_dir(name: str) -> Path:
    """A fresh folder for a background job (removed at the end of the session)."""
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=_TMP_ROOT))


def submit_recipe(key: str, name: str, args: Sequence[str], results_dir: Path | None = None) -> Future:
    """Run ``recipes/<name>.py *args`` as a process in the background (the multi-process runs);
    ``result(key)`` -> (process, JSON, results_dir)."""
    results_dir = results_dir or session_dir(f"results-{key.replace(':', '-')}")
    return submit(key, lambda: (*run_recipe_process(name, args, results_dir), results_dir))


def run_estimate_process(command: str) -> subprocess.CompletedProcess:
    """An ``fmr-estimate`` command line run as its own process (this interpreter, the session's environment)."""
    argv = [sys.executable, "-m", "fabric_memory_recipes.planning", *shlex.split(command)[1:]]
    return run_process(argv, subprocess_env())


def submit_estimate(command: str) -> str:
    """An ``fmr-estimate`` command the docs show, as a process in the background (once per command, whichever
    test module asks first); returns the key :func:`result` waits for (a ``CompletedProcess``)."""
    key = f"estimate:{command}"
    submit(key, run_estimate_process, command)
    return key


def pytest_collection_modifyitems(session, config, items):
    jobs.order(items)


def pytest_sessionstart(session):
    """Start the zygote (tests/processes/zygote.py) while the tests are collected: its imports then take the
    core that collecting leaves idle."""
    if not session.config.option.collectonly:
        ZYGOTE.folder = _TMP_ROOT / "zygote"
        ZYGOTE.start(from_a_terminal(server_argv(ZYGOTE.folder)), subprocess_env(), REPO)


def _starts_processes(module) -> bool:
    """Whether a test module starts processes through this file's helpers (then the zygote is started)."""
    helpers = (run_process, run_recipe_process, Started, submit, submit_recipe, submit_estimate)
    return module is not None and any(getattr(module, h.__name__, None) is h for h in helpers)


def pytest_collection_finish(session):
    """Start the selected modules' background processes as soon as the test list is known
    (:func:`tests.processes.jobs.start_selected`)."""
    if session.config.option.collectonly:
        return
    if not any(_starts_processes(getattr(item, "module", None)) for item in session.items):
        ZYGOTE.stop()  # started for nothing: these tests start no process
    jobs.start_selected(session.items)


def pytest_sessionfinish(session, exitstatus):
    jobs.shutdown()
    ZYGOTE.stop()
    shutil.rmtree(_TMP_ROOT, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """In-process tests use tiny models; with recipe processes busy on the other cores, several
    intra-op threads here would mostly spin and wait (a 2 s test took 30 s that way)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Settings a test must find as the session began and leave so: what sets them for the process outside a
# test (a recipe imported at collection, a fixture of module scope) reaches every test after it.
KEPT_FOR_THE_SESSION = ("PYTORCH_CUDA_ALLOC_CONF",)


def session_setting_changed(when: str) -> str | None:
    """A line naming each of KEPT_FOR_THE_SESSION that differs from the session's value (each put back
    to it), or None when all are as the session began."""
    changed = []
    for name in KEPT_FOR_THE_SESSION:
        now, began = os.environ.get(name), _SESSION_ENV.get(name)
        if now != began:
            changed.append(f"{name}={now!r} {when} (the session began with {began!r})")
            if began is None:
                del os.environ[name]
            else:
                os.environ[name] = began
    return "; ".join(changed) or None


@pytest.fixture(autouse=True)
def _session_settings_kept():
    """Fails the test in whose set-up or teardown a setting of KEPT_FOR_THE_SESSION is not the session's:
    set before its function's fixtures began (at collection, by a background job, or by a fixture of wider
    scope it uses) or left after them: set up before :func:`_process_state_restored` (which asks for it),
    torn down after it."""
    if problem := session_setting_changed("when this test's set-up began"):
        pytest.fail(problem + ": set outside a test, or by a module or session fixture of this test")
    yield
    if problem := session_setting_changed("after this test"):
        pytest.fail(problem + ": this test or one of its fixtures set it and did not put it back")


@pytest.fixture(autouse=True)
def _process_state_restored(_session_settings_kept):
    """Each test leaves the process as it found it (:func:`process_state_kept`), so that none depends on
    what ran before it. In-process recipe runs and the libraries they call set process-wide state meant
    for a recipe's own process: the recipes torch's float32 matmul precision, rung 09 its thread count
    (Adam runs on the CPU), Lightning's seed_everything PL_GLOBAL_SEED and PL_SEED_WORKERS, its launcher
    OMP_NUM_THREADS, fast mode PYTORCH_CUDA_ALLOC_CONF."""
    with process_state_kept():
        yield


# ------------------------------------------------------------------------- shared by several test files
@pytest.fixture
def dynamo_on(monkeypatch):
    """torch.compile traces during this test (the suite turns dynamo off: TORCHDYNAMO_DISABLE=1 above, which
    ``torch.compile`` reads at each call and then returns the function untraced), with a fresh cache.

    ``torch._dynamo.config`` is patched with its own ``patch``: pytest's ``monkeypatch.setattr`` reads the
    old value from the module's ``__dict__``, where torch's config keeps none, and its undo then deletes
    ``disable``, which hides it ("torch._dynamo.config.disable does not exist") for the rest of the process."""
    import torch

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=False):
        yield
    torch._dynamo.reset()


@pytest.fixture
def fabric():
    import lightning as L  # here, not at import: collection stays quick (see conftest: background jobs)

    return L.Fabric(accelerator="cpu", devices=1, precision="32-true")


@functools.cache
def run_estimate(command: str) -> tuple[int, str, str]:
    """An ``fmr-estimate`` command of the README, in this interpreter: (exit code, stdout, stderr)."""
    from fabric_memory_recipes.planning.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(shlex.split(command)[1:]) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Exception as e:
            code, _ = 1, err.write(f"{type(e).__name__}: {e}")
    return code, out.getvalue(), err.getvalue()

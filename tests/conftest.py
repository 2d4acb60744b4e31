"""Shared fixtures: run recipes as subprocesses (CPU, offline), or load them in-process.

Every recipe process runs with FMR_OFFLINE=1 (no network look-ups) and FMR_LOG_DIR in a temporary
folder (Fabric's CSV/TensorBoard logs), from the repository root, with the interpreter running pytest.

Speed. A fresh interpreter spends ~6 s of CPU importing torch/lightning before a recipe parses its
flags, and the suite needs a few dozen recipe runs. Two things keep it fast on 2 cores:

* Background jobs: a test module may define ``start_background_jobs()``; it is called once the tests
  are collected (only for modules with selected tests) and submits its runs with :func:`submit` /
  :func:`submit_recipe`. They run concurrently while the in-process tests go on; a test waits for its
  own with :func:`result`.
* A warm interpreter (tests/_zygote.py) that has imported the third-party packages once and forks a
  child per run: the child executes ``recipes/<name>.py`` as ``__main__`` with its own argv, sys.path,
  environment, working directory, stdout/stderr and exit code, importing the project's code fresh.
  ``submit_recipe`` uses it; ``run_recipe`` (and FMR_TEST_COLD=1 for everything) runs a plain
  ``python recipes/<name>.py``. run_all.sh's tests always start plain interpreters.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO / "recipes"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# In-process code (common.metrics reads FMR_LOG_DIR at import time; common.net reads FMR_OFFLINE)
# must see these before anything imports common.*: set them while conftest is imported.
_TMP_ROOT = Path(tempfile.mkdtemp(prefix="fmr-tests-"))
_LOG_DIR = _TMP_ROOT / "logs"
os.environ["FMR_OFFLINE"] = "1"
# No torch.compile in CPU tests: compiling costs minutes on 2 cores and is not what they check. torchao's
# 8-bit Adam (rung 13) compiles its update step; with dynamo disabled it runs the same step eagerly.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ["FMR_LOG_DIR"] = str(_LOG_DIR)

# The flags that make any recipe a quick CPU run (see run_all.sh's CPU path).
CPU_ARGS = (
    "--accelerator", "cpu", "--model", "vit_tiny", "--data", "synthetic", "--weights", "none",
    "--max-steps", "3", "--eval-batches", "1",
)  # fmt: skip
# Rungs whose strategy (Fabric's FSDPStrategy) refuses the CPU: on CPU they must exit 2 with one line
# saying so (DESIGN.md, "Known ground"); everything else runs on CPU.
CUDA_ONLY_RECIPES = frozenset({"08_fsdp", "09_cpu_offload"})
SUBPROCESS_TIMEOUT = 400
WORKERS = int(os.environ.get("FMR_TEST_WORKERS", "0")) or max(2, min(4, os.cpu_count() or 2))
COLD = os.environ.get("FMR_TEST_COLD", "") not in ("", "0")


# ------------------------------------------------------------------------------------------ discovery
def recipe_files() -> list[Path]:
    """The numbered ladder, discovered (new rungs are covered without editing the tests)."""
    return sorted(RECIPES_DIR.glob("[0-9][0-9]_*.py"))


def recipe_names() -> list[str]:
    return [p.stem for p in recipe_files()]


def load_recipe_module(name: str):
    """Import ``recipes/<name>.py`` as a module (its ``main``, ``RECIPE``, ``DEFAULTS``), not as __main__."""
    path = RECIPES_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------- subprocesses
def subprocess_env(log_dir: str | os.PathLike | None = None, **extra: str) -> dict[str, str]:
    env = os.environ.copy()
    env["FMR_OFFLINE"] = "1"
    env["FMR_LOG_DIR"] = str(log_dir or _LOG_DIR)
    env["PYTHONUNBUFFERED"] = "1"
    # `common` importable from a plain checkout too (as run_all.sh does), not only after pip install -e .
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    # Several recipe processes run at once on few cores: one intra-op thread each avoids thrashing.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()


def run_process(cmd: Sequence[str], env: dict[str, str], timeout: float = SUBPROCESS_TIMEOUT):
    """subprocess.run, in its own process group, remembered so that an aborted session can end it."""
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    with _LIVE_LOCK:
        _LIVE.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, err = proc.communicate()
        err += f"\n[tests] killed after {timeout} s"
    finally:
        _kill(proc)  # whatever it launched and left behind (its process group) goes with it
        with _LIVE_LOCK:
            _LIVE.discard(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the process group we started (it may have children)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(proc: subprocess.Popen) -> None:
    _killpg(proc.pid)


def _option(args: Sequence[str], flag: str) -> str | None:
    args = list(args)
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def run_recipe_process(
    name: str, args: Sequence[str], results_dir: str | os.PathLike, log_dir=None, warm: bool = False
) -> tuple[subprocess.CompletedProcess, dict | None]:
    """``python recipes/<name>.py *args`` from the repo root; returns (process, results JSON or None).

    ``--results-dir results_dir`` is added unless ``args`` has one. The JSON is the file the recipe
    is documented to write: ``<results_dir>/<name>[-<tag>].json``. ``warm``: a forked child of the
    warm interpreter runs the script (same behaviour, ~6 s less CPU), unless FMR_TEST_COLD=1.
    """
    args = [str(a) for a in args]
    where = _option(args, "--results-dir")
    if where is None:
        where = str(results_dir)
        args += ["--results-dir", where]
    argv = [str(RECIPES_DIR / f"{name}.py"), *args]
    if warm and not COLD:
        proc = _ZYGOTE.run(argv, subprocess_env(log_dir))
    else:
        proc = run_process([sys.executable, *argv], subprocess_env(log_dir))
    tag = _option(args, "--tag")
    path = Path(where) / (f"{name}-{tag}.json" if tag else f"{name}.json")
    payload = json.loads(path.read_text()) if path.exists() else None
    return proc, payload


class _Zygote:
    """Client of tests/_zygote.py (see its docstring): one warm interpreter, a forked child per run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._dead = False
        self._closing = False
        self._jobs: dict[str, dict] = {}
        self._ids = itertools.count()

    def _start(self) -> None:
        with self._lock:
            if self._proc is None and not self._closing:
                env = subprocess_env()
                # single-threaded until it forks: no BLAS/OpenMP pools may exist in the parent
                env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
                self._log = open(_TMP_ROOT / "zygote.log", "w")  # noqa: SIM115
                self._proc = subprocess.Popen(
                    [sys.executable, str(Path(__file__).with_name("_zygote.py"))],
                    cwd=REPO,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=self._log,
                    text=True,
                    start_new_session=True,
                )
                threading.Thread(target=self._read, name="fmr-zygote", daemon=True).start()
        if self._closing:
            return
        if not self._ready.wait(300) or self._dead:
            log = (_TMP_ROOT / "zygote.log").read_text()[-3000:]
            raise RuntimeError(f"the warm interpreter (tests/_zygote.py) did not start:\n{log}")

    def _read(self) -> None:
        for line in self._proc.stdout:
            message = json.loads(line)
            if message.get("ready"):
                self._ready.set()
                continue
            job = self._jobs[message["id"]]
            if "pid" in message:
                job["pid"] = message["pid"]
            else:
                job["returncode"] = message["returncode"]
                job["done"].set()
        self._dead = True  # EOF: release everyone still waiting
        self._ready.set()
        for job in list(self._jobs.values()):  # run() may add a job meanwhile
            job["done"].set()

    def run(self, argv: list[str], env: dict[str, str], timeout: float = SUBPROCESS_TIMEOUT):
        return self.start(argv, env).wait(timeout)

    def start(self, argv: list[str], env: dict[str, str]) -> WarmRun:
        """Start the run and return at once (see :class:`WarmRun`)."""
        self._start()
        if self._closing or self._dead:
            return WarmRun(argv, None, None, None)
        job_id = str(next(self._ids))
        folder = _TMP_ROOT / "zygote"
        folder.mkdir(exist_ok=True)
        out, err = folder / f"{job_id}.out", folder / f"{job_id}.err"
        job = {"done": threading.Event(), "pid": None, "returncode": None}
        self._jobs[job_id] = job
        if self._dead:  # the server went away between the check above and now
            return WarmRun(argv, None, None, None)
        request = {
            "id": job_id,
            "argv": argv,
            "cwd": str(REPO),
            "env": env,
            "stdout": str(out),
            "stderr": str(err),
        }
        with self._lock:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        return WarmRun(argv, job, out, err)

    def kill_running(self) -> None:
        for job in list(self._jobs.values()):
            if not job["done"].is_set() and job["pid"]:
                _killpg(job["pid"])

    def close(self) -> None:
        self._closing = True
        if self._proc is None:
            return
        self.kill_running()
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            _kill(self._proc)
        self._log.close()
        self._proc = None


class WarmRun:
    """A run in a forked child of the warm interpreter: ``pid`` (once the child exists), its output
    files, ``read()`` while it runs, ``wait()`` for the CompletedProcess. Tests that signal a running
    recipe use it through :func:`start_warm`."""

    def __init__(self, argv: list[str], job: dict | None, out: Path | None, err: Path | None) -> None:
        self.argv, self._job, self.out, self.err = argv, job, out, err

    @property
    def pid(self) -> int | None:
        return self._job["pid"] if self._job else None

    def read(self) -> tuple[str, str]:
        """(stdout, stderr) so far."""
        read = lambda p: p.read_text(errors="replace") if p is not None and p.exists() else ""  # noqa: E731
        return read(self.out), read(self.err)

    def wait(self, timeout: float = SUBPROCESS_TIMEOUT) -> subprocess.CompletedProcess:
        job = self._job
        if job is None:
            return subprocess.CompletedProcess([sys.executable, *self.argv], -9, "", "[tests] session ended")
        note = ""
        if not job["done"].wait(timeout):
            if job["pid"]:
                _killpg(job["pid"])
            job["done"].wait(30)
            note = f"\n[tests] killed after {timeout} s"
        if job["returncode"] is None:
            note += "\n[tests] the warm interpreter died: see the zygote log"
        returncode = job["returncode"] if job["returncode"] is not None else -9
        out, err = self.read()
        return subprocess.CompletedProcess([sys.executable, *self.argv], returncode, out, err + note)


_ZYGOTE = _Zygote()


def start_warm(argv: Sequence[str], env: dict[str, str]) -> WarmRun:
    """Start ``python *argv`` (a script and its arguments) as a forked child of the warm interpreter
    and return at once; ``FMR_TEST_COLD=1`` is not honoured here (see run_recipe_process for that)."""
    return _ZYGOTE.start([str(a) for a in argv], env)


@pytest.fixture
def run_recipe(tmp_path):
    """``run_recipe(name, *args)`` -> (CompletedProcess, parsed results JSON or None), run now."""

    def _run(name: str, *args: str):
        return run_recipe_process(name, args, tmp_path / "results", tmp_path / "logs")

    return _run


def describe(proc: subprocess.CompletedProcess) -> str:
    """Everything a failing assertion needs to show about a process."""
    return (
        f"\n$ {' '.join(map(str, proc.args))}\nexit {proc.returncode}\n"
        f"--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-3000:]}"
    )


# ------------------------------------------------------------------------------------- background jobs
_EXECUTOR: ThreadPoolExecutor | None = None
_JOBS: dict[str, Future] = {}


def session_dir(name: str) -> Path:
    """A fresh folder for a background job (removed at the end of the session)."""
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=_TMP_ROOT))


def submit(key: str, fn: Callable, *args) -> Future:
    """Start ``fn(*args)`` in the background (once per key)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="fmr-job")
    if key not in _JOBS:
        _JOBS[key] = _EXECUTOR.submit(fn, *args)
    return _JOBS[key]


def submit_recipe(
    key: str,
    name: str,
    args: Sequence[str] | Callable[[], Sequence[str]],
    results_dir: Path | None = None,
    warm: bool = True,
) -> Future:
    """Run ``recipes/<name>.py *args`` in the background; ``result(key)`` -> (process, JSON, results_dir).

    ``args`` may be a function (called in the background): an error computing them, e.g. a recipe that
    cannot be imported, then fails the test that waits for this job instead of the whole session.
    """
    results_dir = results_dir or session_dir(f"results-{key.replace(':', '-')}")

    def job():
        argv = args() if callable(args) else args
        return (*run_recipe_process(name, argv, results_dir, warm=warm), results_dir)

    return submit(key, job)


_START_ERRORS: dict[str, Exception] = {}


def result(key: str):
    """Wait for a background job's result (what its function returned)."""
    if key not in _JOBS:
        errors = "".join(f"\n  {m}: {e!r}" for m, e in _START_ERRORS.items())
        raise KeyError(f"background job {key!r} was never submitted{errors or ''}")
    return _JOBS[key].result()


def pytest_collection_finish(session):
    """Start the selected modules' background processes as soon as the test list is known.

    ``start_background_jobs()`` may take one argument: it then gets the names of its module's selected
    tests (``test_x[param]``) and can start only the jobs they need.
    """
    if session.config.option.collectonly:
        return
    selected: dict = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        # a module may name the tests that need its jobs (BACKGROUND_TESTS); otherwise any selected test
        needs = getattr(module, "BACKGROUND_TESTS", None)
        if needs is None or getattr(item, "originalname", item.name) in needs:
            selected.setdefault(module, []).append(item.name)
    # longest chains first, so they do not end up alone at the end of the session
    for module in sorted(selected, key=lambda m: getattr(m, "BACKGROUND_PRIORITY", 100)):
        start = getattr(module, "start_background_jobs", None)
        if start is None:
            continue
        try:
            takes_names = len(inspect.signature(start).parameters) > 0
            start(selected[module]) if takes_names else start()
        except Exception as exc:  # noqa: BLE001 - reported by the tests that wait for these jobs
            _START_ERRORS[module.__name__] = exc


def pytest_sessionfinish(session, exitstatus):
    if _EXECUTOR is not None:
        _EXECUTOR.shutdown(wait=False, cancel_futures=True)
        with _LIVE_LOCK:
            live = list(_LIVE)
        for proc in live:
            _kill(proc)
        _ZYGOTE.close()  # ends its running children: the jobs waiting for them return now
        _EXECUTOR.shutdown(wait=True)
    _ZYGOTE.close()
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


@pytest.fixture(autouse=True)
def _restore_matmul_precision():
    """Recipes' main() sets torch's float32 matmul precision globally; keep tests independent."""
    torch = sys.modules.get("torch")
    before = torch.get_float32_matmul_precision() if torch else "highest"
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_float32_matmul_precision(before)

"""Child processes: one command per process, with this checkout's code, a log and a timeout.

Every tool that measures (compare_reference, ab_ladder, planner_proof, model_proof, check_equivalence,
convergence, same_parameters, fit_proof) and ``fmr-estimate --fit --measure`` (planning/your_model/measure.py)
run recipes or scripts as processes of their own: a run's memory and its
failures stay its own, and a hung run can be killed with everything it started. What they share is here:
the environment (:func:`project_env`, :func:`run_env`), one planned process (:class:`Run`) and running it
(:func:`execute`), and asking a child which GPU is there (:func:`gpu_probe`).
"""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# What an installed wheel lacks: the recipes are scripts of the repository, beside the package in a checkout.
NEEDS_CHECKOUT = (
    "The commands above run in a checkout of the repository: the recipes are scripts beside the package, not"
    " part of the installed wheel (clone the repository, then in it: python3 -m pip install -e .)"
)


def in_checkout(repo: Path = REPO) -> bool:
    """Whether the package runs from a checkout (``recipes/`` and ``run_all.sh`` beside it), not a wheel."""
    return (repo / "recipes").is_dir() and (repo / "run_all.sh").is_file()


def project_env(code: Path | str = REPO, **extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``, with ``code`` (a checkout whose package the child
    must import) first on ``PYTHONPATH`` and what was there kept after it: packages installed on
    ``PYTHONPATH`` (a carried torchao, say) stay importable in the child."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code), os.environ.get("PYTHONPATH")) if p)
    return env


def run_env(log_dir: str) -> dict[str, str]:
    """The project runs' environment: this checkout first on PYTHONPATH, offline, logs in ``log_dir``."""
    return project_env(PYTHONUNBUFFERED="1", FMR_OFFLINE="1", FMR_LOG_DIR=log_dir)


@dataclass
class Run:
    """One process: an article script (serving one or more rows) or one rung in one mode."""

    kind: str  # "reference" | "project"
    name: str  # reference: the script; project: the rung
    mode: str | None  # project: eager | fast; reference: what was swapped in, or None
    cmd: list[str]
    json: Path  # what it writes (rank 0)
    log: Path
    rows: list[str] = field(default_factory=list)
    result: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        if self.kind == "reference":
            return f"reference {self.name}" + (f" ({self.mode})" if self.mode else "")
        return f"{self.name} {self.mode}"


def last_line(text: str | None) -> str | None:
    """The last non-empty line of a log (where a traceback's error is), at most 300 characters."""
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else None


def execute(run: Run, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run one process (its own process group, output to its log); kill the group on timeout."""
    for stale in (run.json, *run.json.parent.glob(f"{run.json.stem}.rank*.json")):
        stale.unlink(missing_ok=True)  # a failed run must not be read as an older file
    run.log.parent.mkdir(parents=True, exist_ok=True)  # logs may sit beside not-yet-made run folders
    start = time.perf_counter()
    with open(run.log, "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(run.cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            run.cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
            status = "ok" if code == 0 else "oom" if code == 3 else "error"  # recipes: 2 bad flags, 3 OOM
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code, status = None, "timeout"
        finally:
            _kill_group(proc)  # whatever it left behind (DataLoader workers, ranks)
    wall = time.perf_counter() - start
    tail = run.log.read_text(encoding="utf-8", errors="replace")[-4000:]
    error = f"killed after {timeout:.0f} s" if status == "timeout" else None
    if status not in ("ok", "timeout"):
        error = last_line(tail)
    return {"status": status, "exit_code": code, "wall_s": wall, "error": error, "tail": tail}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group started for this run, nothing else
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def gpu_probe(python: str) -> tuple[int, str | None]:
    """(CUDA devices, name of the first) from a short child process: this process stays off the GPU."""
    code = (
        "import torch;n=torch.cuda.device_count();print(n);print(torch.cuda.get_device_name(0) if n else '')"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        count, name = (out.stdout.strip().splitlines() + ["", ""])[:2]
        return int(count), name or None
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0, None


class DeviceSlots:
    """Places for child processes on GPUs, ``per_gpu`` on each: ``gpus`` is a count (GPUs 0..N-1) or the
    GPU indices to use. :meth:`take` hands out a free GPU's ``CUDA_VISIBLE_DEVICES`` (a count of one:
    the environment unchanged), :meth:`release` gives it back. Thread-safe; a benchmark runs
    ``len(gpus) * per_gpu`` workers."""

    def __init__(self, gpus: int | list[str], per_gpu: int) -> None:
        self.pinned = not isinstance(gpus, int)  # indices named: always set CUDA_VISIBLE_DEVICES
        ids = list(gpus) if self.pinned else list(range(gpus))
        self.gpus, self.free = len(ids), queue.Queue()
        for _ in range(per_gpu):
            for gpu in ids:
                self.free.put(gpu)

    def take(self, env: dict[str, str]) -> tuple[int | str, dict[str, str]]:
        gpu = self.free.get()
        return gpu, (env | {"CUDA_VISIBLE_DEVICES": str(gpu)} if self.gpus > 1 or self.pinned else env)

    def release(self, gpu: int | str) -> None:
        self.free.put(gpu)

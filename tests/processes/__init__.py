"""Starting the tests' processes: as from a terminal, each in a session of its own, remembered so that an
aborted session can end them, at a lower priority from a background job's thread, and a Python process from
the pre-imported zygote where that is the same as a fresh interpreter (:mod:`tests.processes.zygote`)."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tests.processes.zygote import Zygote, kill_worker

REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT = 400


_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()


def as_from_a_terminal() -> None:
    """``preexec_fn`` of the processes the tests start: SIGINT and SIGHUP at their defaults, as a terminal's
    shell starts a command. A suite started in the background (``pytest &``, a CI runner) has SIGINT
    ignored, one started under ``nohup`` SIGHUP, which its children inherit: Python then installs no
    KeyboardInterrupt, a run keeps an ignored SIGHUP ignored (as it should under nohup), and the Ctrl-C and
    hang-up tests would see nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def from_a_terminal(argv: Sequence[str]) -> tuple[list[str], dict]:
    """(The command line, Popen's keyword arguments) that start ``argv`` as :func:`as_from_a_terminal`
    does, through GNU env where it can (coreutils >= 8.31: it resets the two, then execs ``argv``): without
    a preexec_fn, subprocess starts the child with vfork instead of forking this process (over a GB: ~0.1 s
    of CPU per start, in page tables and copy-on-write faults)."""
    argv = [str(a) for a in argv]
    return ([*_RESET, *argv], {}) if _RESET else (argv, {"preexec_fn": as_from_a_terminal})


_RESET = [shutil.which("env") or "env", "--default-signal=INT,HUP"]
if not shutil.which("env") or subprocess.run([*_RESET, "true"], capture_output=True).returncode:
    _RESET = None


def run_process(
    cmd: Sequence[str], env: dict[str, str], timeout: float = SUBPROCESS_TIMEOUT, cwd: Path = REPO,
    fresh: bool = False,
):  # fmt: skip
    """subprocess.run (in ``cwd``, the repository unless said), in its own process group, remembered so
    that an aborted session can end it. A Python process starts from the zygote where that is the same
    (tests/processes/zygote.py); ``fresh``: always a fresh interpreter."""
    proc = _start(cmd, env, cwd, fresh, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    return subprocess.CompletedProcess([str(c) for c in cmd], proc.returncode, out, err)


ZYGOTE = Zygote()
_WORKER_FILES = itertools.count()


def _start(cmd: Sequence[str], env: dict[str, str], cwd: Path, fresh: bool, **popen) -> subprocess.Popen:
    """Popen ``cmd`` as from a terminal in a session of its own: through the zygote's launcher where it
    runs it as a fresh interpreter would (unless ``fresh``), at the jobs' priority from a job's thread."""
    background, launcher = getattr(_JOB_THREAD, "background", False), None
    if not fresh and ZYGOTE.folder is not None:
        worker_file = ZYGOTE.folder / f"worker-{next(_WORKER_FILES)}"
        launcher = ZYGOTE.command(cmd, env, cwd, worker_file, _autogroup_nice() if background else None)
    argv, terminal = from_a_terminal(launcher or cmd)
    proc = subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True, **terminal, **popen)
    proc.worker_file = worker_file if launcher else None
    background_priority(proc)
    return proc


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the process group we started (it may have children)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(proc: subprocess.Popen) -> None:
    _killpg(proc.pid)
    kill_worker(getattr(proc, "worker_file", None))  # the zygote's worker runs in a session of its own


class Started:
    """A process started now, its output going to files: watched (``read``), signalled, waited for.
    The signal tests use it (a real process: real signal handlers, real exit codes)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], folder: Path, fresh: bool = False) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        stem = folder / f"run-{time.monotonic_ns()}"
        self.out, self.err = stem.with_suffix(".out"), stem.with_suffix(".err")
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.argv = [sys.executable, *map(str, argv)]
            self.proc = _start(self.argv, env, REPO, fresh, stdout=out, stderr=err)
        with _LIVE_LOCK:
            _LIVE.add(self.proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self) -> tuple[str, str]:
        """(stdout, stderr) so far."""
        return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float = SUBPROCESS_TIMEOUT) -> subprocess.CompletedProcess:
        note = ""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            note = f"\n[tests] killed after {timeout} s"
        finally:
            _kill(self.proc)  # what it launched and left behind (its process group) goes with it
            with _LIVE_LOCK:
                _LIVE.discard(self.proc)
        out, err = self.read()
        return subprocess.CompletedProcess(self.argv, self.proc.wait(), out, err + note)


# How much lower the priority of the background jobs' processes is than this process's: the in-process tests
# are the session's longest chain, and with two jobs running on 2 cores the scheduler gave this process two
# thirds of a core; lowered, the jobs take what this process leaves (a whole core, and both while it waits).
BACKGROUND_NICE = 5


# The same for a job's process in a session of its own (its autogroup, below): 3 is enough for two such
# sessions together (weight 2 x 526) to weigh about as much as this process (1024), so that the scheduler
# keeps this process on a core of its own; less low than 5 (335), so that they are not starved by another
# user's sessions at nice 0 (with 5, the README's Qwen2 --fit got ~0.3 of a core and hit its 400 s timeout
# while another suite ran on the same 2 cores).
AUTOGROUP_NICE = 3

_JOB_THREAD = threading.local()


def lower_this_threads_priority() -> None:
    """Run in each job's thread before its first job: Linux keeps a nice value per thread, and the processes a
    thread starts inherit it."""
    _JOB_THREAD.background = True
    with contextlib.suppress(AttributeError, OSError):  # not Linux: as before
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))


def _autogroup_nice() -> int:
    return 0 if _WAITING.is_set() else AUTOGROUP_NICE


def _set_autogroup_nice(pid: int, nice: int) -> None:
    for _ in range(20):  # without CAP_SYS_ADMIN the kernel takes one change in 0.1 s (EAGAIN)
        try:
            Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")
            return
        except BlockingIOError:
            time.sleep(0.05)
        except OSError:  # no autogroups (another kernel, another OS), or the process ended
            return


def background_priority(proc: subprocess.Popen) -> None:
    """A process a background job started in a session of its own (``start_new_session``), at the jobs'
    lower priority. A thread's nice value reaches such a process but no longer counts: with Linux's
    autogroups (``/proc/sys/kernel/sched_autogroup_enabled``), the scheduler first shares the cores between
    sessions, each at its autogroup's nice value (0 for a new one), and only then between the processes of
    a session by theirs. Measured over the suite on 2 cores: this process got ~60 % of a core while two jobs
    ran, and finished its in-process tests last (~510 s), one core idle; with the jobs' autogroups lowered,
    ~357 s. The autogroup's nice value (:data:`AUTOGROUP_NICE`, for every process of the session) is set
    here; a process started from this process's own thread (which this process waits for) keeps 0."""
    if getattr(_JOB_THREAD, "background", False):
        proc.background = True
        _set_autogroup_nice(proc.pid, _autogroup_nice())


_WAITING = threading.Event()


def this_process_waits() -> None:
    """Called when this process waits for a job (the tests that read the jobs' results run last): from then
    on the jobs' sessions run at nice 0 again, as they would without :func:`background_priority` (on a core
    shared with other users' processes they then get their full share)."""
    if _WAITING.is_set():
        return
    _WAITING.set()
    with _LIVE_LOCK:
        live = [p for p in _LIVE if getattr(p, "background", False)]
    for proc in live:
        _set_autogroup_nice(proc.pid, 0)
        worker = getattr(proc, "worker_file", None)  # the zygote's worker: a session of its own
        if worker is not None:
            with contextlib.suppress(OSError, ValueError):
                _set_autogroup_nice(int(worker.read_text()), 0)

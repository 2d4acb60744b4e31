"""Faults that must lose nothing: stop requests (signals), bad input files, outputs that cannot be
written, two runs of one rung at once, a GPU-sized run on a machine without a GPU.

Stopping. ``lifecycle.run_recipe`` installs handlers for SIGINT (Ctrl-C), SIGTERM (what SLURM and Kubernetes send
on preemption), SIGUSR1 (what SLURM's ``--signal`` can send ahead of a time limit) and SIGHUP (the terminal
closed, an ssh session dropped; after it, output that would go to the closed terminal goes to /dev/null,
and a SIGHUP ignored at the start, as under ``nohup``, stays ignored). The first signal
only records a stop request; the training loop acts on it at the next optimizer-step boundary, where
every process agrees on it (``training.loop_plumbing.StopCheck``), saves a checkpoint when the run
checkpoints, and raises :class:`Interrupted`. ``lifecycle.run_recipe`` then writes the results JSON with ``"status": "interrupted"``
and the measurements so far, prints one line, and the process exits with 128 + the signal number.
Evaluation (``training.loop.evaluate_splits``) acts on a request between its batches the same way: the
results keep the training and the accuracy over the batches evaluated (``extra.evaluation``):

==========  =========  ==========================================================================
signal      exit code  meaning
==========  =========  ==========================================================================
SIGINT      130        Ctrl-C; a second Ctrl-C exits at once (130), writing nothing more
SIGTERM     143        terminated (preemption, ``kill``, ``scancel``)
SIGUSR1     138        the scheduler's warning ahead of a time limit (requeue and resume)
SIGHUP      129        the terminal closed (a dropped ssh session, a closed window)
==========  =========  ==========================================================================

Outside a run (while a recipe imports torch, after its results are written, in a tool) these signals
end the process at once in one line with the same exit codes (``console.one_line_ctrl_c``).

This module needs neither torch nor Lightning: the report and the tools that read results use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence

from fabric_memory_recipes import paths
from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.console import detach_from_terminal, program

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
EXIT_CODES = {int(s): 128 + int(s) for s in STOP_SIGNALS}  # the shell's convention: 130, 143, 138, 129
_pending: int | None = None  # the signal of the stop request, set by the handler
_boundary = "optimizer-step boundary"  # where the running phase acts on a stop request (stopping_at)


class BadInput(ValueError):
    """An input file (data, archive, checkpoint) or an output place that cannot be used; reported as
    one line naming it, exit code 2 (like a bad flag)."""


class Interrupted(BaseException):
    """A stop request honoured at an optimizer-step boundary (a BaseException, like KeyboardInterrupt:
    a recipe's ``except Exception`` must not swallow it)."""

    def __init__(
        self, signum: int, step: int, total: int, checkpoint: str | None, during: str | None = None
    ) -> None:
        where = f"during {during}" if during else f"at step {step} of {total}"
        super().__init__(f"{signal_name(signum)} {where}")
        self.signum, self.step, self.total, self.checkpoint = signum, step, total, checkpoint
        self.during = (
            during  # None: training; else what was running (e.g. "val evaluation (3 of 20 batches)")
        )

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 128 + self.signum)

    def record(self) -> dict:
        """What the results JSON keeps about the stop (``extra.stopped``)."""
        return {
            "signal": signal_name(self.signum),
            "step": self.step,
            "planned_steps": self.total,
            "checkpoint": self.checkpoint,
            "during": self.during or "training",
        }


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ---------------------------------------------------------------------------------------- stop requests
def _write(fd: int, text: str) -> None:
    """Write from a signal handler: os.write, not print (print may be in the middle of a write)."""
    with contextlib.suppress(OSError):
        os.write(fd, text.encode())


def first_process() -> bool:
    """True in the process that speaks for the run (global rank 0), from the launchers' variables:
    it is known before Fabric has launched anything."""
    return all(
        os.environ.get(v, "0") in ("", "0") for v in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
    )


def _handle(signum: int, frame) -> None:
    global _pending
    if _pending is not None:
        if signum == signal.SIGINT:  # the second Ctrl-C: the user will not wait for the step to end
            _write(
                2, f"\n{program()}: interrupted again: exiting at once; this run's results are not written\n"
            )
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            os._exit(EXIT_CODES[signal.SIGINT])
        return  # already stopping: a further SIGTERM/SIGUSR1 changes nothing
    _pending = signum
    if first_process():
        again = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
        _write(1, f"\n[stop] {signal_name(signum)}: stopping at the next {_boundary}{again}\n")
    if signum == signal.SIGHUP:  # a closed terminal fails every write: the stop must not fail with it
        detach_from_terminal()


def request_stop(signum: int | None) -> None:
    """Record a stop request as the signal handler does (for callers without a signal, and tests);
    None withdraws it."""
    global _pending
    _pending = signum


def stop_requested() -> int | None:
    """The signal of the pending stop request, or None."""
    return _pending


@contextlib.contextmanager
def stopping_at(boundary: str) -> Iterator[None]:
    """While the body runs, a stop request is acted on at the next ``boundary`` (what the first
    signal's line promises): evaluation stops between batches, not at an optimizer step."""
    global _boundary
    before, _boundary = _boundary, boundary
    try:
        yield
    finally:
        _boundary = before


@contextlib.contextmanager
def handling_signals() -> Iterator[None]:
    """Handle the stop signals for the duration (the main thread only: Python delivers signals there;
    elsewhere nothing is installed), then restore the previous handlers and forget the request."""
    global _pending
    _pending = None
    previous = {}
    try:
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # nohup: the run goes on when the terminal closes
            previous[sig] = signal.signal(sig, _handle)
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _pending = None


def resume_command(argv: Sequence[str] | None = None) -> str:
    """How to continue a stopped run: its own command line with ``--resume auto``."""
    argv = list(sys.argv if argv is None else argv)
    args, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            args.append(arg)
    args += ["--resume", "auto"]
    if os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        return "the same launch command with " + shlex.join(args[-2:])
    script = argv[0] if argv else "recipe.py"
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(script)
        script = relative if not relative.startswith("..") else script
    return shlex.join(["python", script, *args])


def interrupted_line(stop: Interrupted, argv: Sequence[str] | None = None) -> str:
    """The one line a stopped run prints on stderr."""
    if stop.during:
        return (
            f"{program()}: interrupted during {stop.during} ({signal_name(stop.signum)}), after all"
            f" {stop.step} training steps; the results keep the training's measurements and the accuracy"
            " of the batches evaluated"
        )
    where = (
        f"interrupted at step {stop.step} of {stop.total}"
        if stop.step
        else f"interrupted before the first of {stop.total} steps"
    )
    head = f"{program()}: {where} ({signal_name(stop.signum)})"
    if stop.checkpoint:
        return f"{head}; checkpoint {stop.checkpoint}; resume with: {resume_command(argv)}"
    if stop.step:
        return f"{head}; no checkpoint was saved (--checkpoint-on-stop saves one when stopped), a rerun starts over"
    return f"{head}; nothing to resume"


# --------------------------------------------------------------------------------------------- outputs
def results_file(path: str, status: str) -> str:
    """Where a run's results JSON goes: ``path``, unless the run did not succeed and ``path`` holds a
    result it must not replace (a successful one, or a file that is not a results JSON). Such a run is
    written beside it as ``<recipe>[-<tag>].<status>.json``, e.g. ``01_baseline.interrupted.json``."""
    if status == "ok" or not os.path.exists(path):
        return path
    try:
        with open(path, encoding="utf-8") as f:
            previous = json.load(f)
        replaceable = (
            isinstance(previous, dict) and "schema_version" in previous and previous.get("status") != "ok"
        )
    except (OSError, UnicodeDecodeError, ValueError):
        replaceable = False
    return path if replaceable else f"{path[: -len('.json')]}.{status}.json"


def check_writable(directory: str, flag: str) -> None:
    """Create ``directory`` and write (then remove) a file in it, before anything is trained: a run
    must not find out at its end that its results cannot be written. A folder inside
    ``results/published/`` is refused unless publishing (``fabric_memory_recipes.paths``)."""
    try:
        paths.check_output_folder(directory, flag)
    except UsageError as e:
        raise BadInput(str(e)) from None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise BadInput(f"{flag} {directory}: cannot write there ({e.strerror or e})") from None


class RunLock:
    """One run of a rung (recipe and tag) at a time per results directory.

    A second run started while the first is running refuses at its start, in one line naming the
    other's process id, rather than overwriting the first one's results or checkpoints. The lock is an
    ``flock`` on ``<results_dir>/.<recipe>[-<tag>].lock``: the kernel releases it when the process ends
    however it ends, so a killed run leaves no stale lock (at most an empty file, reused next time).
    """

    def __init__(self, directory: str, name: str) -> None:
        self.path = os.path.join(directory, f".{name}.lock")
        self.name = name
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:  # the folder was checked (check_writable); a name too long, say
                raise BadInput(
                    f"cannot create the lock {paths.shown(self.path)} ({e.strerror or e})"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                where = os.path.dirname(self.path) or "."
                raise BadInput(
                    f"another run of {self.name} (pid {holder}) is writing to {where}: wait for it to end,"
                    " or give this run another --tag or --results-dir"
                ) from None
            # The previous holder may have removed the file between our open and our lock: retry then.
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still holding it: nobody can lock the file we remove
        os.close(self._fd)
        self._fd = None


# ------------------------------------------------------------------------------------------ the machine
def wrong_machine(cfg) -> str | None:
    """The one-line refusal for a GPU-sized run that would start on the CPU only because no GPU was
    found (``--accelerator auto``), with the quick CPU command that does work; None otherwise.

    ``cfg`` is the parsed :class:`~fabric_memory_recipes.config.RunConfig`. A model whose name ends in "tiny" is the
    CPU size (``vit_tiny``, ``distilbert-tiny``, ...). An explicit ``--accelerator cpu`` runs whatever
    was asked for. ``cfg.cpu_variant`` names the recipe to suggest instead when this one cannot run on
    a CPU at all.
    """
    if cfg.accelerator != "auto" or str(cfg.model).endswith("tiny"):
        return None
    quick = getattr(cfg, "CPU_QUICK", None)  # a runner of any model (recipes/your_model.py): its own, small
    if quick is not None:
        flags = ["--accelerator", "cpu", "--model", cfg.model, *quick, *cfg.technique_flags()]
        command = shlex.join(["python", f"recipes/{cfg.recipe}.py", *flags])
        return (
            f"no CUDA GPU found: {cfg.recipe} would train {cfg.model} on the CPU at seconds to minutes per step;"
            f" a quick CPU run: {command} (pass --accelerator cpu to train it on the CPU as asked)"
        )
    tiny = next((m for m in cfg.model_choices if m.endswith("tiny")), None)
    if tiny is None:
        return None
    recipe, cpu_variant = cfg.recipe, cfg.cpu_variant
    flags = ["--accelerator", "cpu", "--model", tiny, "--data", "synthetic", "--weights", "none"]
    flags += ["--max-steps", "5", "--eval-batches", "2"]
    if cfg.precision in ("16-mixed", "bf16-mixed"):  # fp16 autocast needs CUDA; bf16's is the CPU analogue
        flags += ["--precision", "bf16-mixed"]  # said even when asked for: rung 02's default is 16-mixed
    if cfg.devices > 1 or cpu_variant:  # a sharding rung keeps its two processes (gloo)
        flags += ["--devices", "2"]
    command = shlex.join(["python", f"recipes/{cpu_variant or recipe}.py", *flags])
    if cpu_variant:
        return f"no CUDA GPU found: {recipe} needs CUDA GPUs; on a CPU, {cpu_variant} runs the same sharding: {command}"
    return (
        f"no CUDA GPU found: {recipe} would train {cfg.model} on the CPU at seconds per step;"
        f" a quick CPU run: {command} (pass --accelerator cpu to train {cfg.model} on the CPU anyway)"
    )

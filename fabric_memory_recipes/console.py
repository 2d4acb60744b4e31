"""What a run says on the terminal outside its results: rank-0 notices, and the one-line refusal.

Both follow the project's contract for messages: a notice is one line, printed once per run (by
global rank 0 when several processes run the recipe); a refusal is one line on stderr naming the
script, and exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import os
import signal
import sys
from typing import NoReturn

# Lightning's own rank-zero switch (the same object: Lightning sets its ``rank`` when it launches or
# joins processes), from the small package that defines it, so that printing a notice does not need
# Lightning itself imported (the estimator's command line does not import it).
from lightning_utilities.core.rank_zero import rank_zero_only


def notice(message: str) -> None:
    """Print a one-line notice (rank 0 only when several processes run the recipe)."""
    if getattr(rank_zero_only, "rank", 0) == 0:
        print(message, flush=True)


PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
SCRIPT_PREFIX = "fmr-"  # the console scripts that pyproject.toml installs: fmr-ladder, fmr-estimate, ...


def program(argv0: str | None = None) -> str:
    """The command as the user typed it, for messages and ``--help``: ``01_baseline.py`` for a recipe,
    ``fmr-report`` for an installed console script, ``python -m fabric_memory_recipes.measurement.report.render``
    for a module of this package run with ``-m`` (whose ``sys.argv[0]`` is the module's file path)."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if argv0 == "-m":  # python -m MODULE while MODULE's packages are still being imported
        orig = getattr(sys, "orig_argv", [])
        if "-m" in orig[:-1]:
            return "python -m " + orig[orig.index("-m") + 1]
    name = os.path.basename(argv0)
    path = os.path.abspath(argv0)
    if name.endswith(".py") and path.startswith(PACKAGE_DIR + os.sep):
        parts = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[: -len(".py")].split(os.sep)
        return "python -m " + ".".join(parts[:-1] if parts[-1] == "__main__" else parts)
    return name or "recipe"


def fail(message: str) -> NoReturn:
    """Print ``<script>: error: <message>`` on stderr and exit with code 2 (the contract for bad input)."""
    print(f"{program()}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with every flag's default: ``(default: X)`` after its help, ``(default: not set)`` for
    a flag that is off unless given a value, nothing where the help already says what the default is
    (or for a plain on/off switch). The description keeps its own line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)  # store_true
        positional = not action.option_strings and action.nargs not in (
            argparse.OPTIONAL,
            argparse.ZERO_OR_MORE,
        )
        if "default" in text or action.default is argparse.SUPPRESS or switch or positional:
            return text
        return f"{text} (default: {'not set' if action.default is None else '%(default)s'})"


class Parser(argparse.ArgumentParser):
    """argparse for the project's commands: a bad flag is one line and exit 2 (:func:`fail`), and
    ``--help`` shows every default (:class:`HelpFormatter`)."""

    def __init__(self, *args, formatter_class: type = HelpFormatter, **kwargs) -> None:
        prog = kwargs.get("prog")
        typed = os.path.basename(sys.argv[0])
        if prog is None:
            kwargs["prog"] = program()
        elif prog.startswith("python -m ") and typed.startswith(SCRIPT_PREFIX):
            # run as an installed console script: its name, then what follows the module (e.g. "--fit")
            rest = prog[len("python -m ") :].partition(" ")[2]
            kwargs["prog"] = f"{typed} {rest}".strip()
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str) -> NoReturn:
        fail(message)


def comma_list(choices: tuple[str, ...] | None = None):
    """An argparse ``type``: ``"a,b"`` -> ``("a", "b")``; with ``choices``, anything else is refused."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        if not items or (choices is not None and any(x not in choices for x in items)):
            expected = f"of {', '.join(choices)}" if choices is not None else "of values"
            raise argparse.ArgumentTypeError(f"expected a comma-separated list {expected}")
        return items

    return parse


_ctrl_c = False  # a Ctrl-C came: what it breaks on its way out (a half-imported numpy) is its doing
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # outside a run they end the process, in one line
_HANDLER_PID = os.getpid()  # a process forked from this one (a data worker) keeps the default


class Ended(BaseException):
    """SIGTERM (``kill``, a scheduler) or SIGHUP (the terminal closed) outside a run, where there is
    nothing to save: raised where the program is, so that its ``finally`` blocks run (a tool's child
    processes are ended), then :func:`one_line_ctrl_c` says so in one line and exits 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _note_ctrl_c(signum, frame) -> None:
    """Python's own SIGINT behaviour (raise KeyboardInterrupt), remembering that it happened."""
    global _ctrl_c
    _ctrl_c = True
    raise KeyboardInterrupt


def _note_end(signum, frame) -> None:
    if os.getpid() != _HANDLER_PID:  # inherited by a fork: end as the signal's default does
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if signum == signal.SIGHUP:
        detach_from_terminal()
    raise Ended(signum)


def detach_from_terminal(fds: tuple[int, ...] = (1, 2)) -> None:
    """After SIGHUP: point the output descriptors that are a terminal at /dev/null. A closed terminal
    makes every write fail (EIO), which would turn the rest of a stop, the results included, into an
    error. Safe in a signal handler (open, dup2, close)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                os.dup2(null, fd)
    os.close(null)


def _say(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # a closed terminal or stream takes nothing
        sys.stderr.write(text)


def one_line_ctrl_c(kind, value, tb, previous=sys.excepthook) -> None:
    """``sys.excepthook``: a Ctrl-C that no run handles (while torch and Lightning load, most of a CPU
    rung's seconds; in a tool) ends with one line and exit code 130, not a 70-line traceback; SIGTERM and
    SIGHUP likewise (143, 129). Installed when the package is imported, which every recipe does first and
    every console script does by being in it. Inside a run, ``faults.handling_signals`` owns these
    signals: it stops at a step or batch boundary."""
    if isinstance(value, Ended):
        _say(f"\n{program()}: stopped by {value}\n")
        code = 128 + value.signum
    elif issubclass(kind, KeyboardInterrupt) or _ctrl_c:  # a Ctrl-C mid-import may end as another error
        _say(f"\n{program()}: interrupted (Ctrl-C)\n")
        code = 130
    else:
        return previous(kind, value, tb)
    try:  # what a normal exit runs; a module the Ctrl-C left half-imported may fail in it: say nothing
        with contextlib.redirect_stderr(io.StringIO()):
            atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream has nothing left to say
            pass
    os._exit(code)


sys.excepthook = one_line_ctrl_c
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an ignored SIGINT stays ignored
    with contextlib.suppress(ValueError):  # imported outside the main thread: Python's own stays
        signal.signal(signal.SIGINT, _note_ctrl_c)
for _signal in ENDING_SIGNALS:
    if signal.getsignal(_signal) == signal.SIG_DFL:  # nohup's ignored SIGHUP stays ignored
        with contextlib.suppress(ValueError):
            signal.signal(_signal, _note_end)

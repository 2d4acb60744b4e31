"""Many runs of one recipe, each in its own process, without paying the imports once per run.

This process imports the recipe (torch, Lightning, the package) and the modules named by ``--preload``
(transformers' model classes, timm, torchao) once, then reads rows from stdin, one a line (``NAME ARGS...``),
and runs each as a child forked from itself: a fresh process for CUDA (its own context, allocator and
whole-device measurement; this process never touches CUDA), with its imports already done. A child runs the
recipe as ``python RECIPE ARGS`` would (``lifecycle.run_recipe``), its output in ``LOGS/NAME.log``, its PID
in ``--pid-file`` while it runs (a watchdog may stop it), and no row starts once ``--stop-file`` exists.
Each row's end is one line on stdout: ``end NAME EXIT_CODE``, flushed, so that a caller can summarise as
rows finish. Rows arrive as they are written (a caller may add some later).

If a forked child cannot use CUDA (the driver was initialised here after all), the row runs again as a
fresh ``python RECIPE ARGS`` process, and so do the rows after it. ``--no-fork`` starts every row that way.

    printf 'a --infer --model hf:gpt2 ...\\nb ...\\n' | python -m devtools.your_model.forked_runs recipes/your_model.py \\
        --logs /tmp/runs --preload transformers.models.gpt2.modeling_gpt2
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

import torch

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.training import lifecycle

# What a child that cannot use CUDA after the fork says (torch's refusal, the driver's error).
NO_CUDA = "forked child: no CUDA"  # what a child that finds no device says (--expect-cuda)
CUDA_FORK_FAILURES = ("Cannot re-initialize CUDA in forked subprocess", "CUDA driver initialization failed",
                      "initialization error", "cudaErrorInitializationError", NO_CUDA)  # fmt: skip


def cuda_devices() -> int:
    """CUDA's own device count, asked afresh (``cudaGetDeviceCount``: the driver, no context, no memory), 0
    where CUDA cannot start in this process."""
    try:
        return int(torch._C._cuda_getDeviceCount())
    except Exception:
        return 0


def load_recipe(path: str) -> ModuleType:
    """The recipe file as a module (its ``__main__`` block not run)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe_runner(path: str) -> Callable[[list[str]], int]:
    """``argv -> exit code``: the recipe's own ``__main__`` (``lifecycle.run_recipe`` of its ``main`` and ``RUNG``)."""
    recipe = load_recipe(path)

    def run(argv: list[str]) -> int:
        sys.argv = [path, *argv]  # what the results' provenance records as the command
        return lifecycle.run_recipe(recipe.main, recipe.RUNG, recipe.__doc__, argv)

    return run


def _child(run: Callable[[list[str]], int], argv: list[str], log: Path, expect_cuda: bool) -> None:
    """In the forked child: output to ``log``, run, leave with the exit code (no cleanup of the parent's)."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # whatever sys.stdout was (a capture)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        if expect_cuda and not cuda_devices():
            print(f"{NO_CUDA} device can be used after the fork", flush=True)
        else:
            code = run(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fresh(recipe: str, argv: list[str], log: Path, pid_file: Path | None) -> int:
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, recipe, *argv], stdout=out, stderr=subprocess.STDOUT)
        if pid_file:
            pid_file.write_text(str(proc.pid))
        return proc.wait()


def run_rows(rows: Iterable[str], run: Callable[[list[str]], int], logs: Path, *, recipe: str | None = None,
             pid_file: Path | None = None, stop_file: Path | None = None, fork: bool = True, expect_cuda: bool = False,
             say: Callable[[str], None] = print) -> dict[str, int]:  # fmt: skip
    """Run each row (``NAME ARGS...``) in a forked child (``run(ARGS)``), or, without ``fork`` or once a
    forked child could not use CUDA, as ``python RECIPE ARGS``; the exit code of each, by name."""
    logs.mkdir(parents=True, exist_ok=True)
    codes: dict[str, int] = {}
    for line in rows:
        words = shlex.split(line)
        if not words or words[0].startswith("#"):
            continue
        name, argv = words[0], words[1:]
        if stop_file is not None and stop_file.exists():
            say(f"skip {name}")
            continue
        log = logs / f"{name}.log"
        if fork:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(run, argv, log, expect_cuda)
            if pid_file:
                pid_file.write_text(str(pid))
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if code != 0 and recipe and any(s in log.read_text(errors="replace") for s in CUDA_FORK_FAILURES):
                say(
                    f"note {name} a forked child could not use CUDA: this row and the rest run as fresh processes"
                )
                fork = False
                code = _fresh(recipe, argv, log, pid_file)
        else:
            code = _fresh(recipe, argv, log, pid_file)
        if pid_file:
            pid_file.write_text("")
        codes[name] = code
        say(f"end {name} {code}")
    return codes


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m devtools.your_model.forked_runs", description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="the recipe file, e.g. recipes/your_model.py")
    p.add_argument("--logs", type=Path, required=True, help="each row's output: LOGS/NAME.log")
    p.add_argument("--preload", nargs="*", default=[], help="modules to import before the first fork")
    p.add_argument("--pid-file", type=Path, help="the running row's PID (empty between rows)")
    p.add_argument("--stop-file", type=Path, help="no row starts once this file exists")
    p.add_argument("--no-fork", action="store_true", help="start every row as a fresh process")
    p.add_argument("--expect-cuda", action="store_true", help="a forked child that finds no CUDA device runs its"
                   " row again as a fresh process, and so do the rows after it")  # fmt: skip
    args = p.parse_args(argv)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # a device count here without starting CUDA
    run = recipe_runner(args.recipe)
    for name in args.preload:
        try:
            importlib.import_module(name)
        except Exception as e:  # a missing optional package: its rows say so themselves
            print(f"note preload {name}: {type(e).__name__}: {e}", flush=True)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        print("note CUDA was initialised while importing: every row runs as a fresh process", flush=True)
        args.no_fork = True
    print(f"note imported once: {time.process_time():.1f} s of CPU that no row pays again", flush=True)
    say = lambda text: print(text, flush=True)  # noqa: E731
    codes = run_rows(sys.stdin, run, args.logs, recipe=args.recipe, pid_file=args.pid_file,
                     stop_file=args.stop_file, fork=not args.no_fork, expect_cuda=args.expect_cuda, say=say)  # fmt: skip
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

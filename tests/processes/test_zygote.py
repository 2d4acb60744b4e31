"""The zygote's worker behaves as ``python ARGS`` (tests/processes/zygote.py): the same exit codes, output and
tracebacks, signals, ``sys.argv``/``sys.path``/``__main__`` as a fresh interpreter given the same command,
environment and folder; and only the programs that import Lightning first are sent to it.

Each program here runs twice, fresh and through the launcher (asked directly: they import nothing, which
:meth:`Zygote.command` would refuse), and the two outcomes must be equal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, ZYGOTE, from_a_terminal, run_process, subprocess_env  # noqa: F401 - run_process: the session starts the zygote for modules that start processes
from tests.processes.zygote import LAUNCHER, lightning_first

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote runs on Linux only")

PROGRAMS = {
    "where.py": (
        "import signal, sys, __main__\n"
        "print(sys.argv, sys.orig_argv[1:], sys.path[0], __file__, __spec__, __package__, type(__loader__))\n"
        "print(sorted(vars(__main__)), sys.modules['__main__'] is __main__)\n"
        "print([(int(s), signal.getsignal(s)) for s in sorted(signal.valid_signals()) if s not in (9, 19)])\n"
        "print(signal.pthread_sigmask(signal.SIG_BLOCK, []), sys.flags, sys.stdout.write_through)\n"
    ),
    "exits.py": "import sys\nprint('out')\nsys.exit(sys.argv[1] if sys.argv[1:] else 3)\n",
    "raises.py": "def f():\n    raise ValueError('boom')\n\nprint('before')\nf()\n",
    "interrupted.py": "print('k', flush=True)\nraise KeyboardInterrupt\n",
    "killed.py": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n",
    "ending.py": (
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('atexit', file=sys.stderr))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
        "print('main')\n"
    ),
    "hooked.py": "import sys\nsys.excepthook = lambda t, v, tb: print('hook', t.__name__, tb.tb_frame.f_code.co_filename)\n1 / 0\n",
    "broken.py": "print('a'\n",
    "waits.py": (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s))\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    ),
}


def _run(argv: list[str], via_zygote: bool, tmp: Path, signal_when_ready: int | None = None):
    env = dict(ZYGOTE.env)
    if via_zygote:
        argv = [sys.executable, "-I", "-S", str(LAUNCHER), str(ZYGOTE.folder), "-", "-", *argv[1:]]
    command, terminal = from_a_terminal(argv)
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, **terminal,
    )  # fmt: skip
    if signal_when_ready is not None:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.2)
        os.kill(proc.pid, signal_when_ready)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("programs")
    for name, source in PROGRAMS.items():
        (folder / name).write_text(source)
    return folder


@LINUX
@pytest.mark.parametrize(
    "args",
    [["where.py", "a"], ["exits.py"], ["exits.py", "a message"], ["raises.py"], ["interrupted.py"],
     ["killed.py"], ["ending.py"], ["hooked.py"], ["broken.py"]],
    ids=lambda a: " ".join(a),
)  # fmt: skip
def test_a_worker_ends_and_prints_as_a_fresh_interpreter(programs, args, tmp_path):
    if not ZYGOTE.usable():
        pytest.skip("no zygote in this session")
    argv = [sys.executable, str(programs / args[0]), *args[1:]]
    assert _run(argv, True, tmp_path) == _run(argv, False, tmp_path)


@LINUX
@pytest.mark.parametrize(
    ("argv", "sig"),
    [
        (["-c", "import time; print('ready', flush=True); time.sleep(30)"], signal.SIGINT),
        (["waits.py"], signal.SIGTERM),
    ],
)
def test_a_signal_to_the_launcher_reaches_the_worker(programs, argv, sig, tmp_path):
    if not ZYGOTE.usable():
        pytest.skip("no zygote in this session")
    argv = [sys.executable, *(str(programs / a) if a.endswith(".py") else a for a in argv)]
    fresh, zygote = _run(argv, False, tmp_path, sig), _run(argv, True, tmp_path, sig)
    assert zygote == fresh and fresh[0] in (-signal.SIGINT, 128 + signal.SIGTERM), (fresh, zygote)


def test_only_programs_that_import_lightning_first_go_to_the_zygote(tmp_path):
    recipes = REPO / "recipes"
    assert lightning_first((recipes / "01_baseline.py").read_text(), [REPO])
    assert not lightning_first((recipes / "14_memory_floor.py").read_text(), [REPO])  # sets a variable first
    runner = REPO / "fabric_memory_recipes" / "tools" / "compare" / "runner.py"
    assert lightning_first(runner.read_text(), [REPO])  # through the project's modules
    assert not lightning_first("import torch\nprint(1)\n", [REPO])
    if not ZYGOTE.usable():
        return
    env, script = subprocess_env(), str(recipes / "01_baseline.py")
    worker = tmp_path / "worker"
    assert ZYGOTE.command([sys.executable, script], env, REPO, worker, None)
    refused = {
        "another interpreter option": ([sys.executable, "-u", script], env, REPO),
        "another folder": ([sys.executable, script], env, tmp_path),
        "a variable torch reads": ([sys.executable, script], {**env, "OMP_NUM_THREADS": "2"}, REPO),
        "Lightning's rank": ([sys.executable, script], {**env, "LOCAL_RANK": "1"}, REPO),
        "a program that imports torch only": (
            [sys.executable, "-m", "fabric_memory_recipes.planning"],
            env,
            REPO,
        ),
    }
    for why, (argv, env_, cwd) in refused.items():
        assert ZYGOTE.command(argv, env_, cwd, worker, None) is None, why
    assert ZYGOTE.command([sys.executable, script], {**env, "FMR_LOG_DIR": str(tmp_path)}, REPO, worker, None)

"""Which of the tests' Python processes start from the pre-imported zygote (server.py), and how.

A fresh interpreter spends ~6 s of CPU importing Lightning (its torchmetrics imports transformers and
torchvision) and ~1.5 s collecting those objects at its exit; the suite starts a few dozen recipe and tool
processes, on 2 cores. :meth:`Zygote.command` turns ``[sys.executable, ARGS...]`` into the launcher's command
line (launcher.py) where the zygote's worker runs it as ``python ARGS`` would, and returns None where only a
fresh interpreter is the same:

* a program that does not begin by importing Lightning (its first statements imports, Lightning among them,
  directly or through this project's modules): the worker holds what importing Lightning leaves (its
  modules, the variables it sets such as ``KMP_DUPLICATE_LIB_OK``, warnings filters), which a program that
  imports it later, or never, would not have at its start; the planner's command line imports torch only;
* another interpreter, or interpreter options (``-u``, ``-X``, ...): only ``SCRIPT.py``, ``-m MODULE`` and
  ``-c CODE`` are taken;
* another working folder, or an environment that differs from the zygote's in anything but the variables
  that no imported library reads (:data:`OWN_VARIABLES`): Lightning reads its rank at import (``LOCAL_RANK``,
  ``RANK``: a rank Lightning starts runs fresh), torch its threads and CUDA devices, Hugging Face its cache
  and offline mode, Python its ``PYTHONPATH``;
* a script whose folder holds a module the zygote imported (a fresh interpreter would have imported that);
* ``fresh=True`` at the call: what a test checks about a process's own start (a Ctrl-C while it imports,
  the pid it records being the one the test started: the worker's pid is not the launcher's).

The test still starts a real process with real pipes, pid, signals and exit status (the launcher's); the
launcher passes its signals on to the worker and ends as it ends. ``FMR_TEST_ZYGOTE=0`` turns it off.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVER, LAUNCHER = HERE / "server.py", HERE / "launcher.py"
# Read by this project's code only (which the zygote does not import), or by the scripts the tests fake.
OWN_VARIABLES = ("FMR_", "REFERENCE_RUNNER_")
OWN_NAMES = frozenset({"PYTHON"})  # run_all.sh's interpreter (Python reads PYTHONPATH & co., not PYTHON)
ENABLED = os.environ.get("FMR_TEST_ZYGOTE", "1") != "0"
# The server runs as ``python -c BOOTSTRAP FOLDER``: its code in a module of its own, the interpreter's __main__
# left for the programs the workers run.
BOOTSTRAP = (
    "import importlib.util, sys; s = importlib.util.spec_from_file_location('fmr_tests_zygote', {path!r}); "
    "m = importlib.util.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); m.main(sys.argv[1])"
)


def server_argv(folder: Path) -> list[str]:
    return [sys.executable, "-c", BOOTSTRAP.format(path=str(SERVER)), str(folder)]


class Zygote:
    """The session's zygote: started once (:meth:`start`), asked per process (:meth:`command`)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder, self.proc, self.env, self.cwd = folder, None, None, None
        self._modules: frozenset[str] | None = None

    def start(self, argv_and_kwargs, env: dict[str, str], cwd: Path) -> None:
        """Start the server (``argv_and_kwargs``: (argv, Popen keywords) for ``[python, server, folder]``
        started as from a terminal); the launchers wait for its socket while it imports."""
        if self.proc is not None or not ENABLED:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        argv, kwargs = argv_and_kwargs
        with open(self.folder / "log", "w") as log:
            self.proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdout=log, stderr=log, start_new_session=True, **kwargs
            )
        (self.folder / "pid").write_text(f"{self.proc.pid}\n")
        self.env, self.cwd = dict(env), Path(cwd).resolve()

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            (self.folder / "failed").write_text("stopped\n")  # the launchers run Python themselves

    def usable(self, wait: float = 120) -> bool:
        """Whether it runs and listens (waiting up to ``wait`` s while it imports: a fresh interpreter would
        spend that time importing too)."""
        deadline = time.monotonic() + wait
        while self.proc is not None and self.proc.poll() is None and not (self.folder / "failed").exists():
            if (self.folder / "socket").exists():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return False

    def command(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        cwd: Path,
        worker_file: Path,
        autogroup_nice: int | None,
    ) -> list[str] | None:
        """The launcher's command line for ``argv``, or None where a fresh interpreter must run it."""
        argv = [str(a) for a in argv]
        if not self.usable() or len(argv) < 2 or argv[0] != sys.executable:
            return None
        if Path(cwd).resolve() != self.cwd or not self._same_imports(env):
            return None
        first, cwd = argv[1], Path(cwd)
        if first == "-c" and len(argv) > 2:
            source, packages = argv[2], []
        elif first == "-m" and len(argv) > 2:
            found = module_file(argv[2], [cwd])
            if found is None:
                return None
            source, packages = found.read_text(), package_files(argv[2], [cwd])
        elif not first.startswith("-") and first.endswith(".py") and (cwd / first).is_file():
            if self._shadowed(Path(os.path.realpath(cwd / first)).parent):
                return None
            source, packages = (cwd / first).read_text(), []
        else:
            return None
        if not (any(imports_lightning(p, [cwd]) for p in packages) or lightning_first(source, [cwd])):
            return None
        nice = "-" if autogroup_nice is None else str(autogroup_nice)
        return [
            sys.executable,
            "-I",
            "-S",
            str(LAUNCHER),
            str(self.folder),
            str(worker_file),
            nice,
            *argv[1:],
        ]

    def _same_imports(self, env: dict[str, str]) -> bool:
        differ = {k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)}
        return all(k.startswith(OWN_VARIABLES) or k in OWN_NAMES for k in differ)

    def _shadowed(self, folder: Path) -> bool:
        """Whether ``folder`` (the program's sys.path[0]) holds a module named as one the zygote imported."""
        if self._modules is None:
            try:
                self._modules = frozenset(json.loads((self.folder / "modules.json").read_text()))
            except (OSError, ValueError):
                return True
        for entry in os.scandir(folder):
            name = entry.name.split(".")[0]
            if name in self._modules and (
                entry.name.endswith((".py", ".so", ".pyc"))
                or (entry.is_dir() and Path(entry.path, "__init__.py").exists())
            ):
                return True
        return False


def kill_worker(worker_file: Path | None) -> None:
    """The process group of the worker a launcher named (what it started goes with it), if any."""
    if worker_file is None:
        return
    try:
        pid = int(worker_file.read_text())
    except (OSError, ValueError):
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------ what a program imports first
PROJECT = ("fabric_memory_recipes", "devtools")


def module_file(name: str, path: list[Path]) -> Path | None:
    """The file of module ``name`` (a package: its ``__main__.py`` as ``-m`` runs it) under ``path``."""
    for root in path:
        base = root.joinpath(*name.split("."))
        for candidate in (base.with_suffix(".py"), base / "__main__.py"):
            if candidate.is_file():
                return candidate
    return None


def package_files(name: str, path: list[Path]) -> list[Path]:
    """The ``__init__.py`` files importing ``name`` runs first."""
    parts, found = name.split("."), []
    for root in path:
        for i in range(1, len(parts) + 1):
            init = root.joinpath(*parts[:i], "__init__.py")
            if init.is_file():
                found.append(init)
        if found:
            return found
    return found


def _imported(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return []


_PARSING = (
    threading.Lock()
)  # ast.parse in two threads at once: "AST constructor recursion depth mismatch" (3.11)


@functools.cache
def _parsed(source: str) -> ast.Module | None:
    with _PARSING:
        try:
            return ast.parse(source)
        except (SyntaxError, ValueError):
            return None


def imports_lightning(file: Path, path: list[Path], seen: set | None = None) -> bool:
    """Whether importing ``file`` imports Lightning (its module-level imports, through this project's
    modules)."""
    seen = set() if seen is None else seen
    if file in seen:
        return False
    seen.add(file)
    try:
        tree = _parsed(file.read_text())
    except OSError:
        return False
    names = [n for node in (tree.body if tree else []) for n in _imported(node)]
    return _through(names, path, seen)


def _through(names: list[str], path: list[Path], seen: set) -> bool:
    for name in names:
        if name.split(".")[0] == "lightning":
            return True
        if name.split(".")[0] in PROJECT:
            files = package_files(name, path)
            mod = module_file(name, path)
            if mod is not None and mod.name != "__main__.py":
                files.append(mod)
            if any(imports_lightning(f, path, seen) for f in files):
                return True
    return False


def lightning_first(source: str, path: list[Path]) -> bool:
    """Whether a program begins with imports only (a docstring first may be) and Lightning is among them,
    directly or through this project's modules: a fresh interpreter then imports it before anything the
    program does, and a worker of the zygote, which imported it already, is the same from there on."""
    tree = _parsed(source)
    if tree is None:
        return False
    seen: set = set()
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            break
        if _through(_imported(node), path, seen):
            return True
    return False

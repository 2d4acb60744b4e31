"""A warm interpreter that runs recipe scripts in forked children: ``python recipes/X.py ARGS`` without
paying ~6 s of imports (torch, lightning, torchvision, torchmetrics) per run. Used by conftest.py.

Only third-party packages are imported here, never ``common``: every child imports the project's code
fresh, executes the recipe file as ``__main__`` (runpy, sys.argv and sys.path[0] as ``python X.py``
sets them) with its own environment, working directory, stdout/stderr files and exit code, so what a
test sees is what a fresh process would do. It must stay single-threaded until it forks (conftest
starts it with OMP_NUM_THREADS=1, so no BLAS/OpenMP thread pool exists).

Protocol (one JSON object a line): requests on stdin ``{id, argv, cwd, env, stdout, stderr}``; on stdout
``{"ready": true}`` once, then ``{id, pid}`` when a child starts and ``{id, returncode}`` when it ends
(negative: killed by that signal).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys

PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)  # kept apart from fd 1, which children redirect


def send(message: dict) -> None:
    PROTOCOL.write(json.dumps(message) + "\n")
    PROTOCOL.flush()


def warm_up() -> None:
    import lightning  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torchvision  # noqa: F401
    import torchvision.models  # noqa: F401
    import tqdm.auto  # noqa: F401
    from lightning.fabric.loggers import CSVLogger  # noqa: F401
    from torchmetrics.classification import MulticlassAccuracy  # noqa: F401

    assert not any(name == "common" or name.startswith("common.") for name in sys.modules), (
        "the zygote must not import the project's code: children import it fresh"
    )


def child(job: dict) -> None:
    """In the forked child: become ``python <argv[0]> <argv[1:]>`` and exit with its code."""
    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills it with the ranks it launched
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        out = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in (devnull, out, err):
            os.close(fd)
        PROTOCOL.close()
        script = os.path.abspath(job["argv"][0])
        sys.argv = list(job["argv"])
        extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(script), *extra, *[p for p in sys.path[1:] if p not in extra]]
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        try:
            import atexit

            atexit._run_exitfuncs()  # what interpreter exit would run (loggers flushing, ...)
        except BaseException:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF if code >= 0 else 1)


def main() -> None:
    warm_up()
    send({"ready": True})
    children: dict[int, str] = {}
    pending = b""
    open_input = True
    while open_input or children:
        if open_input:
            readable, _, _ = select.select([0], [], [], 0.05)
            if readable:
                chunk = os.read(0, 1 << 16)  # raw reads: a buffered reader would hide lines from select
                if not chunk:
                    open_input = False
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if not line.strip():
                        continue
                    job = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        child(job)
                    children[pid] = job["id"]
                    send({"id": job["id"], "pid": pid})
        else:
            select.select([], [], [], 0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            job_id = children.pop(pid, None)
            try:  # what the run launched and left behind (its process group, see setsid) goes too
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if job_id is not None:
                send({"id": job_id, "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()

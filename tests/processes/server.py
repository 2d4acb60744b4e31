"""The tests' pre-imported Python (a "zygote"): started by tests/processes/zygote.py, it imports Lightning
(and with it torch, torchmetrics, torchvision, transformers: ~6 s of CPU that every recipe or tool process
spends again), then forks a worker for each request that tests/processes/launcher.py sends. The worker becomes
``python <script>|-m <module>|-c <code> args...`` as a fresh interpreter would run it: its argv, environment,
working folder, standard streams (the launcher's descriptors), signal dispositions and mask (the launcher's,
as exec would leave them), a session of its own, the interpreter's ``__main__`` emptied as Python sets it up;
Python's own exit (SystemExit,
tracebacks without this file's frames, threads joined, atexit, flushes, death by SIGINT after an uncaught
KeyboardInterrupt). tests/processes/zygote.py says which processes may start this way and which need a real
interpreter.

Where a worker differs from a fresh interpreter: its pid and parent; it has imported Lightning already
(zygote.py sends it only programs that begin by importing it); the objects those imports made are frozen
(``gc.freeze``: the cyclic collector, at the exit too, leaves them alone); ``sys.modules`` holds the same
modules at the program's start as a fresh one after importing Lightning, under another hash seed shared by
the workers (numpy's and torch's generators are seeded again, Python's random module does so itself).

Protocol, per connection: the launcher sends a length-prefixed JSON request with its descriptors 0, 1, 2
(SCM_RIGHTS); this process answers ``pid N`` once the worker runs, then ``status S`` (its wait status) when
it ends. If the launcher goes away first (it was killed), the worker's process group is killed.
"""

import array
import builtins
import json
import os
import selectors
import signal
import socket
import struct
import sys
import traceback
from importlib.machinery import BuiltinImporter

HERE = os.path.abspath(__file__)
_ENV_BEFORE = dict(os.environ)
_ORIGINAL_PARENT = os.getppid()


def preload() -> None:
    """What every recipe and tool imports; nothing of the project (it reads its settings at import)."""
    import lightning  # noqa: F401


class Job:
    """A request taken by a forked worker: what it runs, set up as a fresh interpreter would be."""

    def __init__(self, request: dict) -> None:
        self.args, self.cwd, self.env = request["args"], request["cwd"], request["env"]
        self.request = request

    def setup(self, fds: list[int]) -> None:
        os.setsid()  # as Popen(start_new_session=True) started the launcher
        with _quiet():
            os.setpriority(os.PRIO_PROCESS, 0, self.request["nice"])
        if self.request.get("autogroup_nice") is not None:
            with _quiet(), open("/proc/self/autogroup", "w") as f:
                f.write(f"{self.request['autogroup_nice']}\n")
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(self.cwd)
        env = dict(self.env)
        env.update({k: v for k, v in IMPORT_DELTA.items() if v is not None})
        for k in [k for k, v in IMPORT_DELTA.items() if v is None]:
            env.pop(k, None)
        os.environb.clear()  # both views (and the C environment, which children and C code read)
        os.environb.update({os.fsencode(k): os.fsencode(v) for k, v in env.items()})
        os.environ.clear()
        os.environ.update(env)
        ignored = set(self.request["ignored"])
        for sig in signal.valid_signals():
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            with _quiet():
                signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
        # Python's own start: SIGPIPE and SIGXFSZ ignored, SIGINT raising KeyboardInterrupt unless ignored
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if signal.SIGINT not in ignored:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        # seeded from the OS at import (each fresh process its own): seeded again here (Python's random
        # module does it itself after a fork)
        sys.modules["numpy"].random.seed()
        sys.modules["torch"].default_generator.seed()

    def run(self):
        """Run the program; return the exception to end with at the top level (None: exit 0)."""
        # the interpreter's own __main__ (started with -c: nothing of this file in it), as it is before a
        # program runs: every reference to it (sys.modules' "__mp_main__", dill's) stays right
        sys.modules.pop("fmr_tests_zygote", None)  # this file (its functions keep what they use)
        main = sys.modules["__main__"]
        main.__dict__.clear()
        main.__dict__.update(
            __name__="__main__", __doc__=None, __package__=None, __loader__=BuiltinImporter, __spec__=None,
            __annotations__={}, __builtins__=builtins,
        )  # fmt: skip
        args = self.args
        sys.orig_argv = [sys.executable, *args]
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.request["mask"])  # blocked since the fork
            if args[0] == "-c":
                sys.argv, _ = ["-c", *args[2:]], sys.path.insert(0, "")
                exec(compile(args[1], "<string>", "exec"), main.__dict__)
            elif args[0] == "-m":
                import runpy

                sys.argv, _ = ["-m", *args[2:]], sys.path.insert(0, os.getcwd())
                runpy._run_module_as_main(args[1], alter_argv=True)
            else:
                from importlib.machinery import SourceFileLoader

                path = os.path.join(os.getcwd(), args[0])
                sys.argv = list(args)
                sys.path.insert(0, os.path.dirname(os.path.realpath(args[0])))
                main.__dict__.update(__file__=path, __cached__=None)
                main.__loader__ = SourceFileLoader("__main__", path)
                with open(path, "rb") as f:
                    source = f.read()
                try:
                    exec(compile(source, path, "exec"), main.__dict__)
                finally:  # as Python's run of a file does, before it finalizes
                    main.__dict__.pop("__file__", None)
                    main.__dict__.pop("__cached__", None)
        except SystemExit as e:
            return e
        except BaseException as e:  # noqa: B036 - the interpreter's top level: print it as Python does
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename == HERE:
                tb = tb.tb_next
            e.__traceback__ = tb  # as the interpreter's top level has it: from the program's first frame
            sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
            try:
                sys.excepthook(type(e), e, tb)
            except BaseException as hook_error:  # noqa: B036 - as PyErr_Print reports it
                print("Error in sys.excepthook:", file=sys.stderr)
                traceback.print_exception(hook_error)
                print("\nOriginal exception was:", file=sys.stderr)
                traceback.print_exception(type(e), e, tb)
            if isinstance(e, KeyboardInterrupt):
                return KeyboardInterrupt()
            return SystemExit(1)
        return None


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, OSError)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(30)
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    (size,) = struct.unpack("!I", data[:4])
    data = data[4:]
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the launcher closed mid-request")
        data += chunk
    conn.settimeout(None)
    return json.loads(data), list(fds)


def serve(listener: socket.socket):
    """Answer requests until the parent goes; in a forked worker, return its Job (set up)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    workers: dict[int, socket.socket] = {}  # pid -> its launcher's connection
    while os.getppid() == _ORIGINAL_PARENT:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                if [os.isatty(fd) for fd in fds] != TTYS:  # Python set its streams up for other kinds
                    for fd in fds:
                        os.close(fd)
                    with _quiet():
                        conn.sendall(b"fresh\n")
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
                pid = os.fork()
                if pid != 0:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                else:
                    signal.set_wakeup_fd(-1)
                    selector.close()
                    for fd in (wake_r, wake_w, listener.fileno(), *(c.fileno() for c in workers.values())):
                        os.close(fd)
                    conn.close()
                    job = Job(request)
                    job.setup(fds)
                    return job
                for fd in fds:
                    os.close(fd)
                workers[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
                with _quiet():
                    conn.sendall(f"pid {pid}\n".encode())
            elif key.fileobj == wake_r:
                with _quiet():
                    os.read(wake_r, 4096)
                _reap(workers, selector)
            else:  # a launcher went away (killed) while its worker runs: the worker goes too
                with _quiet():
                    if key.fileobj.recv(1):
                        continue
                selector.unregister(key.fileobj)
                with _quiet():
                    os.killpg(key.data, signal.SIGKILL)
    for pid in workers:
        with _quiet():
            os.killpg(pid, signal.SIGKILL)
    sys.exit(0)


def _reap(workers: dict, selector) -> None:
    while workers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = workers.pop(pid, None)
        if conn is not None:
            with _quiet():
                selector.unregister(conn)
            with _quiet():
                conn.sendall(f"status {status}\n".encode())
            conn.close()


def start(folder: str) -> socket.socket:
    """Import, check that the imports left nothing a fresh interpreter would not have, and listen."""
    global IMPORT_DELTA
    preload()
    import gc
    import threading

    # What the imports made stays out of the cyclic collector's way in the workers: a fresh interpreter
    # spends ~1.5 s of CPU at its exit collecting it (and the workers would copy every page it touched).
    gc.freeze()

    out, err = os.fstat(1), os.fstat(2)
    problems = []
    if threading.active_count() != 1:
        problems.append(f"{threading.active_count() - 1} Python threads running after the imports")
    if (out.st_size or err.st_size) and not sys.stderr.isatty():
        problems.append("the imports printed something")
    if problems:
        with open(os.path.join(folder, "failed"), "w") as f:
            f.write("; ".join(problems) + "\n")
        sys.exit(1)
    with open(os.path.join(folder, "modules.json"), "w") as f:  # what a program's folder must not shadow
        json.dump(sorted({name.split(".")[0] for name in sys.modules}), f)
    after = dict(os.environ)
    IMPORT_DELTA = {
        k: after.get(k) for k in set(after) | set(_ENV_BEFORE) if after.get(k) != _ENV_BEFORE.get(k)
    }
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = os.path.join(folder, "socket")
    listener.bind(path + ".new")
    os.rename(path + ".new", path)  # connectable once it is there
    listener.listen(64)
    return listener


IMPORT_DELTA: dict = {}
TTYS = [os.isatty(fd) for fd in (0, 1, 2)]


def main(folder: str) -> None:
    """The zygote's life (started as ``python -c BOOTSTRAP FOLDER``, tests/processes/zygote.py); in a worker, the
    program's: it ends as Python ends after running it."""
    del sys.path[0]  # -c's '': the imports find what a program would (its own sys.path[0] comes later)
    job = serve(start(folder))
    ending = job.run()
    del job
    if isinstance(ending, KeyboardInterrupt):  # Python then finalizes and dies by SIGINT (exit -2)
        sys.excepthook = lambda *_: None
    if ending is not None:
        raise ending

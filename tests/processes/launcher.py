"""The process a test starts in place of ``python ARGS`` when the zygote (tests/processes/server.py) may run it:
``python -I -S tests/processes/launcher.py FOLDER WORKER_FILE AUTOGROUP_NICE ARGS...`` (~20 ms, the standard
library only). It hands the zygote its argv, environment, working folder, signal dispositions and mask and
its descriptors 0-2, writes the worker's pid to WORKER_FILE, passes on every signal it gets to the worker,
and ends as the worker ended: its exit code, or death by the same signal. Where the zygote cannot take the
request (not running, failed, or it says so), it becomes ``python ARGS`` itself (exec: the same pid).
"""

import array
import json
import os
import signal
import socket
import struct
import sys
import time

NOT_PASSED_ON = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD}


def fresh(args: list[str]) -> None:
    """``python ARGS`` in this process, with the dispositions this process started with (Python set
    SIGPIPE and SIGXFSZ to ignored at its start; a handler is reset by exec)."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    os.execv(sys.executable, [sys.executable, *args])


def connect(folder: str) -> socket.socket | None:
    """The zygote's socket; None when there is none to wait for (it failed, or its process is gone)."""
    path, deadline = os.path.join(folder, "socket"), time.monotonic() + 120
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
        if os.path.exists(os.path.join(folder, "failed")) or time.monotonic() > deadline:
            return None
        try:
            with open(os.path.join(folder, "pid")) as f:
                os.kill(int(f.read()), 0)
        except (OSError, ValueError):
            return None
        time.sleep(0.05)  # still importing


def main() -> None:
    folder, worker_file, autogroup_nice, *args = sys.argv[1:]
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    # as exec would have left them for the program (SIGINT: Python installs its handler only where it
    # found the default; SIGPIPE and SIGXFSZ it ignores whatever it found)
    own = (signal.SIGPIPE, signal.SIGXFSZ)
    ignored = [
        s
        for s in signal.valid_signals()
        if s not in (*NOT_PASSED_ON, *own) and signal.getsignal(s) == signal.SIG_IGN
    ]
    passed_on = [s for s in signal.valid_signals() if s not in (*NOT_PASSED_ON, *own, *ignored)]
    signal.pthread_sigmask(signal.SIG_BLOCK, passed_on)  # until the worker runs: then passed on to it

    def fallback() -> None:  # a signal that came meanwhile ends this process as it would a fresh one
        if signal.SIGINT in passed_on:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        fresh(args)

    sock = connect(folder)
    if sock is None:
        fallback()
    request = {
        "args": args,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "ignored": [int(s) for s in ignored],
        "mask": [int(s) for s in mask],
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "autogroup_nice": None if autogroup_nice == "-" else int(autogroup_nice),
    }
    payload = json.dumps(request).encode()
    try:
        fds = array.array("i", [0, 1, 2])
        sock.sendmsg([struct.pack("!I", len(payload))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        sock.sendall(payload)
        answers = sock.makefile("rb")
        line = answers.readline()
    except OSError:
        line = b""
    if not line.startswith(b"pid "):  # "fresh": it cannot run this one as Python would
        fallback()
    worker = int(line.split()[1])
    if worker_file != "-":
        with open(worker_file, "w") as f:
            f.write(f"{worker}\n")

    def pass_on(sig, frame):
        try:
            os.kill(worker, sig)
        except ProcessLookupError:
            pass

    for sig in passed_on:
        signal.signal(sig, pass_on)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    line = answers.readline()
    if not line.startswith(b"status "):
        sys.stderr.write("[tests] the zygote went away before its worker ended\n")
        os._exit(1)
    status = int(line.split()[1])
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        time.sleep(1)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


main()

"""Simulations run ahead of ``fmr-estimate --fit``'s search in worker processes (planning/your_model/sets.py),
so that a plan for a model whose simulated step takes seconds uses the machine's cores.

The search stays what it is, one process that visits the sets in its order and takes each simulation's
result when it needs it. The workers, forked from that process once its model is built, simulate the
sets it will most likely ask for next (the heads of its queue); when it asks for one of these it takes the
worker's result, for any other it simulates in its own process, as it did alone. A simulated step does not
depend on the process that ran it, so the plan is the one the search makes alone; what the workers
simulated and the search never asked for is dropped.

The search's first simulation runs in one worker: a model whose step takes :data:`SLOW_S` CPU seconds or
more gets the others, a quicker one (a tiny model's) is simulated in the search's process from then on.
Workers fork before the search's process runs any backward pass (autograd refuses to run in a process
forked after its own engine started): a worker that finds autograd unusable leaves its sets to the search.

``FMR_PLAN_WORKERS`` sets how many: 0 none; unset, as many as the cores this process may run on (none on one
core; at most :data:`MOST`); a number: that many, from the first simulation on. With several workers the
search's process hands them its own simulations too and feeds them while it waits; with one, it simulates
beside it. Workers fork, which only Linux does safely here; elsewhere the search runs alone.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

WORKERS_ENV = "FMR_PLAN_WORKERS"
MOST = 8  # each worker holds its own copy of the simulation's state (hundreds of MB for a 0.5 B model)
SLOW_S = 1.0  # CPU seconds of one simulation from which more workers pay for their start

_JOB: Callable[..., Any] | None = None  # what the workers run: set before they fork, inherited


def wanted(env: dict[str, str] | None = None) -> tuple[int, bool]:
    """(how many workers, whether all start at once) as ``FMR_PLAN_WORKERS`` asks (the module's docstring)."""
    value = (os.environ if env is None else env).get(WORKERS_ENV, "").strip()
    if value and not value.isdigit():
        raise ValueError(f"{WORKERS_ENV}={value!r}: expected a number of worker processes (0: none)")
    if not sys.platform.startswith("linux"):
        return 0, False
    if value:
        return int(value), True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return (min(cores, MOST) if cores > 1 else 0), False


def _autograd_works() -> bool:
    """Whether a backward pass runs in this process (not in one forked after its parent's engine started)."""
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:
        return False
    return True


def _serve(connection: Any, autograd: bool) -> None:
    """A worker: each message (key, args) answered (key, (status, result, CPU seconds)); None ends it.
    ``autograd``: its jobs run backward passes, so it answers none where autograd cannot run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the search's to handle: it ends the workers
    usable = _autograd_works() if autograd else True
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        key, args = message
        cpu = time.process_time()
        try:
            answer = ("ok", _JOB(*args)) if usable else ("error", "autograd does not run in this fork")
        except Exception as e:  # the search simulates it again in its own process, which says what failed
            answer = ("error", f"{type(e).__name__}: {e}")
        connection.send((key, (*answer, time.process_time() - cpu)))


class Workers:
    """Forked processes that run ``job(*args)`` ahead of the search, each result by its key (``autograd``: the
    job runs backward passes, as a simulation does)."""

    def __init__(self, job: Callable[..., Any], count: int, autograd: bool = True) -> None:
        self.job, self.autograd = job, autograd
        self._processes: list[tuple[Any, Any]] = []
        self._idle: list[Any] = []
        self._running: dict[Hashable, Any] = {}  # key -> the connection of the worker that runs it
        self._done: dict[Hashable, tuple] = {}  # key -> (status, result, CPU seconds), not taken yet
        self.grow(count)

    def grow(self, count: int) -> None:
        """Fork ``count`` more workers."""
        global _JOB
        _JOB = self.job
        context = multiprocessing.get_context("fork")
        for _ in range(count):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs, self.autograd), daemon=True)
            process.start()
            theirs.close()
            self._processes.append((process, ours))
            self._idle.append(ours)

    def __len__(self) -> int:
        return len(self._processes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._running or key in self._done

    @property
    def idle(self) -> int:
        for connection in list(self._running.values()):
            self._receive(connection, wait=False)
        return len(self._idle)

    def submit(self, key: Hashable, *args: Any) -> bool:
        """Start ``job(*args)`` on an idle worker; False if none is idle or ``key`` is already there."""
        if key in self or not self.idle:
            return False
        connection = self._idle.pop()
        try:
            connection.send((key, args))
        except (OSError, ValueError):  # the worker is gone: one fewer
            return False
        self._running[key] = connection
        return True

    def take(self, key: Hashable, feed: Callable[[], None] = lambda: None) -> tuple[bool, Any, float]:
        """(True, the result of ``key``, its CPU seconds), waiting for it if it runs (``feed()`` whenever
        another worker is done meanwhile: to give it more); (False, None, 0) if it was never submitted or did
        not end well (the caller then runs it itself)."""
        while key in self._running:
            for connection in multiprocessing.connection.wait(list(self._running.values())):
                self._receive(connection, wait=True)
            feed()
        status, result, cpu = self._done.pop(key, ("missing", None, 0.0))
        return (True, result, cpu) if status == "ok" else (False, None, 0.0)

    def _receive(self, connection: Any, wait: bool) -> bool:
        """Take one answer from ``connection`` if there is one (``wait``: until there is); False when its worker
        died (what it ran is then lost)."""
        try:
            if not wait and not connection.poll():
                return True
            key, answer = connection.recv()
        except (EOFError, OSError):
            for k in [k for k, c in self._running.items() if c is connection]:
                del self._running[k]
            return False
        del self._running[key]
        self._done[key] = answer
        self._idle.append(connection)
        return True

    def close(self) -> None:
        """End every worker now (what they run is not needed any more)."""
        for process, connection in self._processes:
            if process.is_alive():
                process.kill()
            process.join()
            connection.close()
        self._processes, self._idle, self._running, self._done = [], [], {}, {}


class Ahead:
    """One search's workers: ``job(*args)`` for the search (:meth:`run`), and ahead of it what ``wanted()``
    lists, (key, args) in the order the search will most likely ask for them; ``count``, ``immediate``: as
    :func:`wanted` says."""

    def __init__(
        self,
        job: Callable[..., Any],
        wanted: Callable[[], Iterable[tuple[Hashable, tuple]]],
        count: int,
        immediate: bool,
    ) -> None:
        self.job, self.wanted, self.count, self.immediate = job, wanted, count, immediate
        self.workers: Workers | None = None
        self.forkable = count > 0  # until the search's process simulates (then autograd runs in it)

    def __len__(self) -> int:
        return len(self.workers) if self.workers is not None else 0

    def run(self, key: Hashable, args: tuple) -> Any:
        """``job(*args)``: a worker's result if one ran it, else run in this process."""
        if self.forkable and self.workers is None:  # the search's first simulation
            self.workers = Workers(self.job, self.count if self.immediate else 1)
            self.workers.submit(key, *args)
        if self.workers is not None and len(self.workers) > 1 and key not in self.workers:
            self.workers.submit(key, *args)  # many workers: this process waits for it and feeds the others
        self.offer(key)
        found = self.workers.take(key, self.offer) if self.workers is not None else None
        taken, result, cpu = found or (False, None, 0.0)
        if self.forkable and not self.immediate and taken and cpu >= SLOW_S:  # a slow step: the cores help
            self.workers.grow(self.count - 1)
        elif self.forkable and not self.immediate:  # a quick step (or no usable worker): this process alone
            self.close()
        self.forkable = False
        if not taken:
            result = self.job(*args)
        self.offer(key)
        return result

    def offer(self, running: Hashable = None) -> None:
        """Give idle workers what the search will most likely ask for next, but ``running``."""
        if self.workers is None or not self.workers.idle:
            return
        for key, args in self.wanted():
            if key != running and key not in self.workers and not self.workers.submit(key, *args):
                if not self.workers.idle:
                    return

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None

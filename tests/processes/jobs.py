"""The session's background jobs: functions that run in threads of their own (their processes at a lower
priority, tests/processes/__init__.py) while the in-process tests run; a test waits for its job's result.
conftest.py starts them once the tests are collected (:func:`start_selected`) and orders the tests that
wait for them last (:func:`order`)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tests.processes import _LIVE, _LIVE_LOCK, _kill, lower_this_threads_priority, this_process_waits

WORKERS = int(os.environ.get("FMR_TEST_WORKERS", "0")) or max(2, min(4, os.cpu_count() or 2))

_EXECUTOR: ThreadPoolExecutor | None = None
_JOBS: dict[str, Future] = {}
_START_ERRORS: dict[str, Exception] = {}


def submit(key: str, fn: Callable, *args) -> Future:
    """Start ``fn(*args)`` in the background (once per key), its processes at a lower priority
    (:data:`tests.processes.BACKGROUND_NICE`)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(
            max_workers=WORKERS, thread_name_prefix="fmr-job", initializer=lower_this_threads_priority
        )
    if key not in _JOBS:
        _JOBS[key] = _EXECUTOR.submit(fn, *args)
    return _JOBS[key]


def result(key: str):
    """Wait for a background job's result (what its function returned)."""
    if key not in _JOBS:
        errors = "".join(f"\n  {m}: {e!r}" for m, e in _START_ERRORS.items())
        raise KeyError(f"background job {key!r} was never submitted{errors or ''}")
    if not _JOBS[key].done():
        this_process_waits()
    return _JOBS[key].result()


def waits_for_a_job(item) -> bool:
    """Whether a test waits for one of its module's background jobs (its BACKGROUND_TESTS, or every test
    of a module that starts jobs and names none)."""
    module = getattr(item, "module", None)
    if module is None or not hasattr(module, "start_background_jobs"):
        return False
    needs = getattr(module, "BACKGROUND_TESTS", None)
    return needs is None or getattr(item, "originalname", item.name) in needs


def order(items: list) -> None:
    """The tests that wait for background jobs last, in the order their jobs start; until then the
    in-process tests keep this process busy while the jobs use the other cores. (In file order, the
    first such wait came early and left this process idle for over a minute on 2 cores.)"""

    def key(pair):
        index, item = pair
        if not waits_for_a_job(item):
            return (0, 0, index)
        return (1, getattr(item.module, "BACKGROUND_PRIORITY", 100), index)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def start_selected(items: list) -> None:
    """Call each selected module's ``start_background_jobs()``, longest chains (``BACKGROUND_PRIORITY``)
    first. It may take one argument: it then gets the names of its module's selected tests
    (``test_x[param]``) and can start only the jobs they need."""
    selected: dict = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        # a module may name the tests that need its jobs (BACKGROUND_TESTS); otherwise any selected test
        needs = getattr(module, "BACKGROUND_TESTS", None)
        if needs is None or getattr(item, "originalname", item.name) in needs:
            selected.setdefault(module, []).append(item.name)
    # longest chains first, so they do not end up alone at the end of the session
    for module in sorted(selected, key=lambda m: getattr(m, "BACKGROUND_PRIORITY", 100)):
        start = getattr(module, "start_background_jobs", None)
        if start is None:
            continue
        try:
            takes_names = len(inspect.signature(start).parameters) > 0
            start(selected[module]) if takes_names else start()
        except Exception as exc:
            _START_ERRORS[module.__name__] = exc


def shutdown() -> None:
    """The jobs not started are dropped, the processes still running killed, the threads joined."""
    if _EXECUTOR is not None:
        _EXECUTOR.shutdown(wait=False, cancel_futures=True)
        with _LIVE_LOCK:
            live = list(_LIVE)
        for proc in live:
            _kill(proc)
        _EXECUTOR.shutdown(wait=True)

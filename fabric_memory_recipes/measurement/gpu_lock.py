"""One GPU, several recipe processes: ``./run_all.sh --quick`` starts up to ``--jobs`` recipes at once, and
each trains with the GPU to itself.

A recipe process spends most of its life outside the training loop: starting Python, importing torch and
Lightning, starting CUDA, building the model, simulating its memory estimate, evaluating. Those parts
may overlap with another recipe's training; the training loop (warm-up and compilation included) may
not, or its speed would be shared. ``run_all.sh`` names a lock file in ``FMR_GPU_LOCK``, and the
``train`` phase of :class:`~fabric_memory_recipes.measurement.results.RunResults` holds it
(:func:`exclusive`): an exclusive ``flock``, released when the phase ends or the process dies. Peak
memory is per process (the caching allocator's statistics, and NVML's per-process entry for the whole
device), so the concurrent start-ups do not mix into it; without ``FMR_GPU_LOCK`` nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

ENV = "FMR_GPU_LOCK"


@contextlib.contextmanager
def exclusive(waited: dict | None = None) -> Iterator[None]:
    """Hold the lock named by ``FMR_GPU_LOCK`` (if set); ``waited["gpu_lock_wait_s"]``: the seconds spent
    waiting for it."""
    path = os.environ.get(ENV)
    if not path:
        yield
        return
    with open(path, "a") as f:
        start = time.perf_counter()
        fcntl.flock(f, fcntl.LOCK_EX)
        if waited is not None:
            waited["gpu_lock_wait_s"] = round(time.perf_counter() - start, 3)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

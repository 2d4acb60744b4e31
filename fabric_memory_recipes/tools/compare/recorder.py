"""The step recorder of fabric_memory_recipes.tools.compare.runner: a global optimizer step post-hook that marks
every optimizer step (a CUDA event, or ``time.perf_counter`` when CUDA is not in use), counts the images
the model saw between steps, reads the peak memory, and stops the script after the requested steps by
raising :class:`StopRun`. The runner's docstring says what is measured and why."""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from fabric_memory_recipes.measurement.results_file import GB, WARMUP_STEPS


class StopRun(Exception):
    """Raised from the step hook once the requested steps are done: ends the script early."""


def _memory_now() -> dict[str, float]:
    if torch.cuda.is_initialized():
        return {
            "peak_reserved_gb": torch.cuda.max_memory_reserved() / GB,
            "peak_allocated_gb": torch.cuda.max_memory_allocated() / GB,
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_reserved_gb": rss / GB, "peak_allocated_gb": rss / GB}


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def script_constants(script: Path) -> dict[str, int]:
    """Upper-case integer globals of the running script (BATCHSIZE, ACCUMULATION_STEPS, ...), read from
    the frames on the stack; {} when the script defines none."""
    frame = sys._getframe()
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename) == str(script):
            return {
                k: v
                for k, v in frame.f_globals.items()
                if k.isupper() and isinstance(v, int) and not isinstance(v, bool)
            }
        frame = frame.f_back
    return {}


class StepRecorder:
    """Marks every optimizer step and counts the images between steps; stops the script after ``steps``."""

    def __init__(self, script: Path, steps: int, warmup: int = WARMUP_STEPS) -> None:
        self.script, self.steps, self.warmup = script, steps, warmup
        self.marks: list[Any] = []  # CUDA events or perf_counter values, one per optimizer step
        self.images: list[int] = []  # images through the model since the previous step, per step
        self.images_since = 0
        self.counting = False  # a model built by a patched builder counts its training-mode forwards
        self.cuda = False
        self.constants: dict[str, int] = {}
        self.memory_warmup: dict[str, float] | None = None
        self.memory_end: dict[str, float] | None = None
        self.memory_kind = "cpu_rss"

    def count_forward(self, module: torch.nn.Module, args: tuple) -> None:
        if module.training and args and hasattr(args[0], "shape") and len(args[0].shape) > 0:
            self.images_since += int(args[0].shape[0])

    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.counting and self.marks and self.images_since == 0:
            return  # another optimizer stepping in the same iteration (one optimizer per parameter)
        if not self.marks:
            self.cuda = torch.cuda.is_initialized()
            self.memory_kind = "cuda" if self.cuda else "cpu_rss"
            self.constants = script_constants(self.script)
        self.images.append(self.images_since)
        self.images_since = 0
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        done = len(self.marks)
        if done == self.warmup + 1 and done < self.steps:  # this mark starts the first timed interval
            self.memory_warmup = _memory_now()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()  # host-side counters only: no allocation changes
        if done >= self.steps:
            self.memory_end = _memory_now()
            raise StopRun

    def intervals(self) -> list[float]:
        if len(self.marks) < 2:
            return []
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]

    def summary(self) -> dict[str, Any]:
        """Timing and memory as the results JSON records them."""
        rank, world = _world()
        intervals = self.intervals()
        skip = min(
            self.warmup, max(0, len(intervals) - 1)
        )  # as fabric_memory_recipes.measurement.results.RunResults.steady_intervals
        steady = intervals[skip:]
        per_interval = self.images[1:]  # images[k + 1] went through the model during interval k
        timed_images = per_interval[skip:]
        batch = Counter(timed_images).most_common(1)[0][0] if timed_images else None
        source = "counted" if self.counting else None
        if not self.counting and self.constants.get("BATCHSIZE"):  # a model the builders did not make
            batch, source = self.constants["BATCHSIZE"], "script constant BATCHSIZE"
        median = statistics.median(steady) if steady else None
        end = self.memory_end or _memory_now()
        warm = self.memory_warmup
        peak = {k: max(m[k] for m in (warm, end) if m) for k in ("peak_reserved_gb", "peak_allocated_gb")}
        return {
            "rank": rank,
            "world_size": world,
            "steps": len(self.marks),
            "warmup_steps": skip,
            "timed_intervals": len(steady),
            "median_step_s": median,
            "effective_batch": batch,
            "images_per_s": batch * world / median if batch and median else None,
            "batch_source": source,
            "script_constants": self.constants,
            "step_intervals_s": intervals,
            "images_per_interval": per_interval,
            **peak,
            "memory": {
                "kind": self.memory_kind,
                "unit": "GB",
                "warmup": warm,
                "steady": end if warm is not None else None,
            },
        }

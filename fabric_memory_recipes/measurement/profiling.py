"""Measured memory anatomy: ``--memory-timeline`` (torch.profiler) and ``--snapshot`` (CUDA allocator).

Both flags record the first ``--profile-steps`` optimizer steps of the training loop (default 3), so a
workshop sees the whole story: step 1 without optimizer state, Adam's state appearing at the first
``optimizer.step()``, then steady-state steps. Every recipe gets them through ``fabric_memory_recipes.training.loop.fit``;
nothing changes in the recipes.

``--memory-timeline`` profiles with ``profile_memory=True, record_shapes=True, with_stack=True`` and
uses the profiler's memory categoriser (``torch.profiler._memory_profiler``), which labels every tensor
as parameter, gradient, optimizer state, activation, input, temporary or autograd detail from how it is
used. Files beside the results JSON:

* ``<recipe>-timeline.html``: PyTorch's own plot (``MemoryProfileTimeline.export_memory_timeline_html``)
* ``<recipe>-timeline.png``: the same data drawn here, in GB (1e9 bytes), with forward / backward /
  optimizer spans shaded and the estimator's predicted peak as a dashed line
* ``<recipe>-timeline.json``: the plotted points (times in ms, GB per category) and per-step phase times
  (from ``fabric_memory_recipes.measurement.timeline.phase_ranges``, the one phase timer, which the experiments in experiments/ use
  too: GPU-side on CUDA, with the kernels' own time beside it; host-side on a CPU)

It works on a CPU too (the CPU allocator's events, ``device="cpu"``), which is how the tests run it.

``--snapshot`` needs CUDA: ``torch.cuda.memory._record_memory_history`` records every allocation and
free of the caching allocator with its stack, and ``_dump_snapshot`` writes ``<recipe>-snapshot.pickle``,
which https://pytorch.org/memory_viz opens (drag the file in). On a CPU the flag exits 2 (``RunConfig.checked``).

Profiling costs time (the python tracer records every call): use these flags on a separate run, not on
the one whose img/s you report.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

from fabric_memory_recipes.measurement.timeline import export_timeline, phase_ms_from_trace

PHASES = ("forward", "backward", "optimizer")


PHASES = ("forward", "backward", "optimizer")


def artifact_path(results: Any, suffix: str) -> str:
    """``<results_dir>/<recipe>[-<tag>]-<suffix>``: beside the results JSON."""
    return os.path.join(results.cfg.results_dir, f"{results.cfg.run_name}-{suffix}")


class Recorder:
    """What ``fabric_memory_recipes.training.loop.fit`` records its first steps with. Inactive unless a flag asks for it.

    ``start()`` before the loop; ``region(name)`` marks forward / backward / optimizer for the profiler
    (a ``record_function``); ``step()`` after every optimizer step (recording stops and the files are
    written after ``steps`` of them); ``close()`` after the loop (writes what was recorded if the run
    had fewer steps).

    Without ``results`` (the experiments), ``predicted`` is the dashed line of the timeline plot, and
    ``time_phases=True`` records the steps with a light profiler (no memory, no stacks) only to time the
    phases: ``phase_ms`` is then :func:`phase_ms_from_trace` of those steps.
    """

    def __init__(
        self,
        device: torch.device,
        timeline_prefix: str | None = None,
        snapshot_path: str | None = None,
        steps: int = 3,
        results: Any = None,
        title: str = "",
        predicted: float | None = None,
        time_phases: bool = False,
    ) -> None:
        self.device = device
        self.timeline_prefix = timeline_prefix
        self.snapshot_path = snapshot_path
        self.steps = max(1, steps)
        self.results = results
        self.title = title
        self.predicted = predicted
        self.time_phases = time_phases
        self.active = bool(timeline_prefix or snapshot_path or time_phases)
        self._profiler = None
        self._done = 0
        self._snapshot_on = False
        self.timeline_files: dict[str, Any] | None = None
        self.phase_ms: tuple[dict[str, list[float]], dict[str, list[float]]] = ({}, {})

    @classmethod
    def for_run(cls, fabric: Any, results: Any) -> Recorder:
        """From the recipe's flags (``--memory-timeline``, ``--snapshot``, ``--profile-steps``); rank 0
        records, the other ranks get an inactive recorder."""
        cfg = results.cfg
        want_timeline, want_snapshot = cfg.memory_timeline, cfg.snapshot
        if not (want_timeline or want_snapshot) or not fabric.is_global_zero:
            return cls(fabric.device)
        return cls(
            fabric.device,
            timeline_prefix=artifact_path(results, "timeline") if want_timeline else None,
            snapshot_path=artifact_path(results, "snapshot.pickle") if want_snapshot else None,
            steps=cfg.profile_steps,
            results=results,
            title=cfg.run_name,
        )

    # -------------------------------------------------------------------------------- loop interface
    def region(self, name: str):
        """A labelled range in the profile (forward / backward / optimizer); free when not recording."""
        if self._profiler is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"## {name} ##")

    def step(self) -> None:
        if not self.active:
            return
        self._done += 1
        if self._profiler is not None:
            if self._done >= self.steps:
                self._sync()  # the last step's kernels finish inside the trace
            self._profiler.step()
        if self._done >= self.steps:
            self._finish_snapshot()
            if self._profiler is not None:  # the schedule has exported by now; stop recording
                self._profiler.__exit__(None, None, None)
                self._profiler = None

    def start(self) -> Recorder:
        if not self.active:
            return self
        if self.snapshot_path:
            if self.device.type != "cuda":
                raise RuntimeError("--snapshot needs CUDA (the caching allocator records the history)")
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            self._snapshot_on = True
        if self.timeline_prefix or self.time_phases:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            memory = bool(self.timeline_prefix)
            self._profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=0, warmup=0, active=self.steps, repeat=1),
                profile_memory=memory,
                record_shapes=memory,
                with_stack=memory,
                on_trace_ready=self._export_timeline if memory else self._time_phases,
            )
            self._profiler.__enter__()
        return self

    def close(self) -> None:
        if self._profiler is not None:  # fewer steps than --profile-steps: export what was recorded
            self._sync()
            self._profiler.__exit__(None, None, None)
            self._profiler = None
        self._finish_snapshot()
        if self.results is not None:
            if self.timeline_files is not None:
                self.results.memory_files["timeline"] = self.timeline_files
            if self.snapshot_path and os.path.exists(self.snapshot_path):
                self.results.memory_files["snapshot"] = self.snapshot_path

    # ---------------------------------------------------------------------------------------- export
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time_phases(self, prof: Any) -> None:
        self.phase_ms = phase_ms_from_trace(prof)

    def _finish_snapshot(self) -> None:
        if not self._snapshot_on:
            return
        self._snapshot_on = False
        os.makedirs(os.path.dirname(os.path.abspath(self.snapshot_path)), exist_ok=True)
        torch.cuda.memory._dump_snapshot(self.snapshot_path)
        torch.cuda.memory._record_memory_history(enabled=None)
        print(f"[snapshot] {self.snapshot_path}: open it in https://pytorch.org/memory_viz", flush=True)

    def _export_timeline(self, prof: Any) -> None:
        start = time.perf_counter()
        try:
            self.timeline_files = export_timeline(
                prof, self.timeline_prefix, str(self.device), title=self.title, predicted=self._predicted()
            )
            print(
                f"[memory-timeline] {self.timeline_files['png']} and .html "
                f"({time.perf_counter() - start:.0f} s to categorise)",
                flush=True,
            )
        except Exception as e:
            self.timeline_files = {"error": f"{type(e).__name__}: {e}"}
            print(f"[memory-timeline] export failed: {e}", flush=True)

    def _predicted(self) -> float | None:
        if self.predicted is not None:
            return self.predicted
        est = getattr(self.results, "estimate", None)
        return getattr(est, "peak_gb", None)

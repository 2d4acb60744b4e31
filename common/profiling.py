"""Measured memory anatomy: ``--memory-timeline`` (torch.profiler) and ``--snapshot`` (CUDA allocator).

Both flags record the first ``--profile-steps`` optimizer steps of the training loop (default 3), so a
workshop sees the whole story: step 1 without optimizer state, Adam's state appearing at the first
``optimizer.step()``, then steady-state steps. Every recipe gets them through ``common.loop.fit``;
nothing changes in the recipes.

``--memory-timeline`` profiles with ``profile_memory=True, record_shapes=True, with_stack=True`` and
uses the profiler's memory categoriser (``torch.profiler._memory_profiler``), which labels every tensor
as parameter, gradient, optimizer state, activation, input, temporary or autograd detail from how it is
used. Files beside the results JSON:

* ``<recipe>-timeline.html``: PyTorch's own plot (``MemoryProfileTimeline.export_memory_timeline_html``)
* ``<recipe>-timeline.png``: the same data drawn here, in GB (1e9 bytes), with forward / backward /
  optimizer spans shaded and the estimator's predicted peak as a dashed line
* ``<recipe>-timeline.json``: the plotted points (times in ms, GB per category) and per-step phase times
  (from :func:`phase_ranges`, the one phase timer, which the seed-000 experiments use too: GPU-side on
  CUDA, with the kernels' own time beside it; host-side on a CPU)

It works on a CPU too (the CPU allocator's events, ``device="cpu"``), which is how the tests run it.

``--snapshot`` needs CUDA: ``torch.cuda.memory._record_memory_history`` records every allocation and
free of the caching allocator with its stack, and ``_dump_snapshot`` writes ``<recipe>-snapshot.pickle``,
which https://pytorch.org/memory_viz opens (drag the file in). On a CPU the flag exits 2 (``cli.validate``).

Profiling costs time (the python tracer records every call): use these flags on a separate run, not on
the one whose img/s you report.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import tempfile
import time
import warnings
from typing import Any

import torch

PHASES = ("forward", "backward", "optimizer")
MAX_POINTS = 4000  # points kept in the timeline JSON (the plot uses all of them)
CATEGORY_NAMES = {  # torch.profiler._memory_profiler.Category -> label in our plots
    "PARAMETER": "parameters",
    "OPTIMIZER_STATE": "optimizer state",
    "INPUT": "inputs",
    "TEMPORARY": "temporaries",
    "ACTIVATION": "activations",
    "GRADIENT": "gradients",
    "AUTOGRAD_DETAIL": "autograd detail",
    None: "unknown",
}
PHASE_COLORS = {"forward": "#fd8d3c", "backward": "#6baed6", "optimizer": "#969696"}


def artifact_path(log: Any, suffix: str) -> str:
    """``<results_dir>/<recipe>[-<tag>]-<suffix>``: beside the results JSON."""
    args = log.args
    stem = log.recipe + (f"-{args.tag}" if getattr(args, "tag", None) else "")
    return os.path.join(getattr(args, "results_dir", "results"), f"{stem}-{suffix}")


class Recorder:
    """What ``common.loop.fit`` records its first steps with. Inactive unless a flag asks for it.

    ``start()`` before the loop; ``region(name)`` marks forward / backward / optimizer for the profiler
    (a ``record_function``); ``step()`` after every optimizer step (recording stops and the files are
    written after ``steps`` of them); ``close()`` after the loop (writes what was recorded if the run
    had fewer steps).

    Without a ``log`` (the experiments), ``predicted`` is the dashed line of the timeline plot, and
    ``time_phases=True`` records the steps with a light profiler (no memory, no stacks) only to time the
    phases: ``phase_ms`` is then :func:`phase_ms_from_trace` of those steps.
    """

    def __init__(
        self,
        device: torch.device,
        timeline_prefix: str | None = None,
        snapshot_path: str | None = None,
        steps: int = 3,
        log: Any = None,
        title: str = "",
        predicted: float | None = None,
        time_phases: bool = False,
    ) -> None:
        self.device = device
        self.timeline_prefix = timeline_prefix
        self.snapshot_path = snapshot_path
        self.steps = max(1, steps)
        self.log = log
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
    def for_run(cls, fabric: Any, log: Any) -> Recorder:
        """From the recipe's flags (``--memory-timeline``, ``--snapshot``, ``--profile-steps``); rank 0
        records, the other ranks get an inactive recorder."""
        args = getattr(log, "args", None)
        want_timeline = bool(getattr(args, "memory_timeline", False))
        want_snapshot = bool(getattr(args, "snapshot", False))
        if not (want_timeline or want_snapshot) or not fabric.is_global_zero:
            return cls(fabric.device)
        return cls(
            fabric.device,
            timeline_prefix=artifact_path(log, "timeline") if want_timeline else None,
            snapshot_path=artifact_path(log, "snapshot.pickle") if want_snapshot else None,
            steps=int(getattr(args, "profile_steps", 3) or 3),
            log=log,
            title=log.recipe + (f"-{args.tag}" if getattr(args, "tag", None) else ""),
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
        if self.log is not None:
            if self.timeline_files is not None:
                self.log.memory_files["timeline"] = self.timeline_files
            if self.snapshot_path and os.path.exists(self.snapshot_path):
                self.log.memory_files["snapshot"] = self.snapshot_path

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
        except Exception as e:  # noqa: BLE001 - a failed export must not cost the run's measurements
            self.timeline_files = {"error": f"{type(e).__name__}: {e}"}
            print(f"[memory-timeline] export failed: {e}", flush=True)

    def _predicted(self) -> float | None:
        if self.predicted is not None:
            return self.predicted
        est = getattr(self.log, "estimate", None)
        return getattr(est, "peak_gb", None)


# Trace categories of work that runs on the GPU, and of the host calls that launch it.
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}


def phase_ranges(trace: Any) -> list[tuple[str, float, float, float, float | None]]:
    """Every ``## phase ##`` range of a Chrome trace (a path, or a profiler to export one from), in host
    order: ``(phase, host start us, host end us, ms, kernel ms)``. Host times are on the profiler's clock
    (the memory timeline's).

    ``ms`` is how long the phase took; ``kernel ms`` (``None`` when the trace has no GPU work) is the sum
    of its kernels' own durations, the GPU's busy time: where it is much smaller than ``ms``, the GPU sat
    waiting for the host to launch work.

    On CUDA ``ms`` is GPU-side: from the start of the first kernel to the end of the last kernel
    *launched* while the range was open on the host. Kernels are matched to their launch call through the
    trace's correlation ids, and the launch to the range by its host timestamp, whichever thread launched
    it. That matters for backward: autograd launches its kernels from its own device thread, so the
    profiler's ``gpu_user_annotation`` span of the main thread's range is empty there. A range that
    launched no kernel, and every range on a CPU-only trace, is timed on the host.

    A profiler is exported to a temporary Chrome trace and read back: kineto's JSON (categories,
    ``args.correlation``) is the form whose CUDA shape is known and tested.
    """
    if not isinstance(trace, (str, os.PathLike)):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            trace.export_chrome_trace(path)
            return phase_ranges(path)
    with open(trace) as f:
        doc = json.load(f)
    base = float(doc.get("baseTimeNanoseconds", 0)) / 1000.0  # newer traces: ts relative to this
    ranges: list[tuple[str, float, float]] = []  # (phase, host start, host end), in microseconds
    launches: dict[int, float] = {}  # correlation id -> host time of the launch call
    kernels: list[tuple[int, float, float]] = []  # (correlation id, GPU start, GPU end)
    for e in doc.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        name, cat = e.get("name", ""), e.get("cat")
        ts, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        corr = (e.get("args") or {}).get("correlation")
        if cat == "user_annotation" and name.startswith("## ") and name.endswith(" ##"):
            ranges.append((name[3:-3], ts, ts + dur))
        elif cat in _LAUNCH_CATS and corr is not None:
            launches[int(corr)] = ts
        elif cat in _GPU_CATS and corr is not None:
            kernels.append((int(corr), ts, ts + dur))
    ranges.sort(key=lambda r: r[1])
    gpu: list[list[float]] = [[] for _ in ranges]  # per range: [first start, last end, busy]
    starts = [r[1] for r in ranges]
    for corr, k0, k1 in kernels:
        t = launches.get(corr)
        i = -1 if t is None else bisect.bisect_right(starts, t) - 1
        if i < 0 or t > ranges[i][2]:
            continue
        g = gpu[i]
        if g:
            g[0], g[1], g[2] = min(g[0], k0), max(g[1], k1), g[2] + (k1 - k0)
        else:
            g.extend((k0, k1, k1 - k0))
    return [
        (
            phase,
            h0 + base,
            h1 + base,
            ((g[1] - g[0]) if g else (h1 - h0)) / 1000.0,
            ((g[2] if g else 0.0) / 1000.0) if kernels else None,
        )
        for (phase, h0, h1), g in zip(ranges, gpu, strict=True)
    ]


def phase_ms_from_trace(trace: Any) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``(span, kernel)``: :func:`phase_ranges`' ms and kernel ms per phase, one entry per occurrence
    (``kernel`` is empty without GPU work)."""
    span: dict[str, list[float]] = {}
    kernel: dict[str, list[float]] = {}
    for phase, _, _, ms, busy in phase_ranges(trace):
        span.setdefault(phase, []).append(ms)
        if busy is not None:
            kernel.setdefault(phase, []).append(busy)
    return span, kernel


def phase_times_ms(times: list[tuple[str, float]]) -> list[dict[str, float]]:
    """Milliseconds of forward / backward / optimizer per optimizer step, from ``(phase, ms)`` in host
    order (a step's micro-batches add up; a step ends with its 'optimizer' range)."""
    steps: list[dict[str, float]] = []
    current: dict[str, float] = {}
    for name, ms in times:
        if name == "forward" and "optimizer" in current:
            steps.append(current)
            current = {}
        current[name] = current.get(name, 0.0) + ms
    if current:
        steps.append(current)
    return steps


def export_timeline(
    prof: Any, prefix: str, device: str, title: str = "", predicted: float | None = None
) -> dict[str, Any]:
    """Categorise the profile's memory events and write ``prefix``.html / .png / .json; return paths."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    timeline = MemoryProfileTimeline(prof._memory_profile())
    html = f"{prefix}.html"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timeline.export_memory_timeline_html(html, device, title=title or None)
    times, sizes = timeline._coalesce_timeline(device)
    if not times:
        raise RuntimeError(f"no memory events recorded on {device}")
    t0 = min(times)
    ms = [(t - t0) / 1000.0 for t in times]
    names = [CATEGORY_NAMES.get(getattr(c, "name", None), "unknown") for c in _CATEGORY_TO_INDEX]
    per_category = {
        names[i]: [s[_CATEGORY_TO_INDEX[c] + 1] / 1e9 for s in sizes]
        for i, c in enumerate(_CATEGORY_TO_INDEX)
    }
    ranges = phase_ranges(prof)
    spans = [(n, (a - t0) / 1000.0, (b - t0) / 1000.0) for n, a, b, _, _ in ranges]
    kernel = [(n, k) for n, _, _, _, k in ranges if k is not None]
    totals = [sum(v[j] for v in per_category.values()) for j in range(len(ms))]
    png = f"{prefix}.png"
    _plot(ms, per_category, spans, png, title, predicted, device)
    keep = max(1, len(ms) // MAX_POINTS)
    data = {
        "device": device,
        "unit": "GB",
        "time_ms": ms[::keep],
        "categories": {k: v[::keep] for k, v in per_category.items() if any(v)},
        "peak_gb": max(totals),
        "peak_by_category_gb": {k: v[totals.index(max(totals))] for k, v in per_category.items() if any(v)},
        "phases_ms": [(n, round(a, 3), round(b, 3)) for n, a, b in spans],
        "step_phase_times_ms": phase_times_ms([(n, ms) for n, _, _, ms, _ in ranges]),
        "step_phase_kernel_ms": phase_times_ms(kernel) if kernel else None,
        "phase_times": "gpu" if kernel else "host",
        "predicted_peak_gb": predicted,
    }
    path = f"{prefix}.json"
    with open(path, "w") as f:
        json.dump(data, f)
    return {
        "html": html,
        "png": png,
        "json": path,
        "device": device,
        "peak_gb": data["peak_gb"],
        "steps": len(data["step_phase_times_ms"]),
    }


def _plot(
    ms: list[float],
    per_category: dict[str, list[float]],
    spans: list[tuple[str, float, float]],
    path: str,
    title: str,
    predicted: float | None,
    device: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torch.profiler._memory_profiler import _CATEGORY_TO_COLORS

    colors = {
        CATEGORY_NAMES.get(getattr(c, "name", None), "unknown"): col for c, col in _CATEGORY_TO_COLORS.items()
    }
    names = [n for n, v in per_category.items() if any(v)]
    fig, ax = plt.subplots(figsize=(12, 5.5))
    ax.stackplot(
        ms,
        [per_category[n] for n in names],
        labels=names,
        colors=[colors.get(n, "grey") for n in names],
        alpha=0.85,
        step="post",
    )
    seen = set()
    for name, start, end in spans:  # a strip along the top: which phase the loop was in
        ax.axvspan(
            start,
            end,
            ymin=0.95,
            ymax=1.0,
            color=PHASE_COLORS.get(name, "#eeeeee"),
            lw=0,
            label=None if name in seen else f"{name} (host span)",
        )
        seen.add(name)
    if predicted:
        ax.axhline(predicted, color="black", ls="--", lw=1, label=f"predicted peak {predicted:.2f} GB")
    top = max(max(sum(v[j] for v in per_category.values()) for j in range(len(ms))), predicted or 0.0)
    ax.set_ylim(0, top * 1.12)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel(f"memory on {device} (GB, 1e9 bytes)")
    ax.set_title(f"{title} — measured memory timeline by category (torch.profiler)".strip(" —"))
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.grid(alpha=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

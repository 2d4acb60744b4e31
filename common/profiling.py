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

It works on a CPU too (the CPU allocator's events, ``device="cpu"``), which is how the tests run it.

``--snapshot`` needs CUDA: ``torch.cuda.memory._record_memory_history`` records every allocation and
free of the caching allocator with its stack, and ``_dump_snapshot`` writes ``<recipe>-snapshot.pickle``,
which https://pytorch.org/memory_viz opens (drag the file in). On a CPU the flag exits 2 (``cli.validate``).

Profiling costs time (the python tracer records every call): use these flags on a separate run, not on
the one whose img/s you report.
"""

from __future__ import annotations

import contextlib
import json
import os
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
    """

    def __init__(
        self,
        device: torch.device,
        timeline_prefix: str | None = None,
        snapshot_path: str | None = None,
        steps: int = 3,
        log: Any = None,
        title: str = "",
    ) -> None:
        self.device = device
        self.timeline_prefix = timeline_prefix
        self.snapshot_path = snapshot_path
        self.steps = max(1, steps)
        self.log = log
        self.title = title
        self.active = bool(timeline_prefix or snapshot_path)
        self._profiler = None
        self._done = 0
        self._snapshot_on = False
        self.timeline_files: dict[str, Any] | None = None

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
        if self.timeline_prefix:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=0, warmup=0, active=self.steps, repeat=1),
                profile_memory=True,
                record_shapes=True,
                with_stack=True,
                on_trace_ready=self._export_timeline,
            )
            self._profiler.__enter__()
        return self

    def close(self) -> None:
        if self._profiler is not None:  # fewer steps than --profile-steps: export what was recorded
            self._profiler.__exit__(None, None, None)
            self._profiler = None
        self._finish_snapshot()
        if self.log is not None:
            if self.timeline_files is not None:
                self.log.memory_files["timeline"] = self.timeline_files
            if self.snapshot_path and os.path.exists(self.snapshot_path):
                self.log.memory_files["snapshot"] = self.snapshot_path

    # ---------------------------------------------------------------------------------------- export
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
        est = getattr(self.log, "estimate", None)
        return getattr(est, "peak_gb", None)


def _phase_spans(prof: Any) -> list[tuple[str, float, float]]:
    """(phase, start_us, end_us) of every ``## phase ##`` range, on the memory timeline's clock."""
    spans = []

    def walk(event: Any) -> None:
        name = event.name
        if name.startswith("## ") and name.endswith(" ##"):
            spans.append((name[3:-3], event.start_time_ns / 1000.0, event.end_time_ns / 1000.0))
            return
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return sorted(spans, key=lambda s: s[1])


def phase_times_ms(spans: list[tuple[str, float, float]]) -> list[dict[str, float]]:
    """Host-side milliseconds of forward / backward / optimizer per optimizer step, from spans in ms (a
    step's micro-batches add up; a step ends with its 'optimizer' range)."""
    steps: list[dict[str, float]] = []
    current: dict[str, float] = {}
    for name, start, end in spans:
        if name == "forward" and "optimizer" in current:
            steps.append(current)
            current = {}
        current[name] = current.get(name, 0.0) + (end - start)
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
    spans = [(n, (a - t0) / 1000.0, (b - t0) / 1000.0) for n, a, b in _phase_spans(prof)]
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
        "step_phase_times_ms": phase_times_ms(spans),
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

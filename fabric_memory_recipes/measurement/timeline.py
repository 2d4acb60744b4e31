"""Reading a torch.profiler run: the time of each ``## phase ##`` range (forward / backward / optimizer,
GPU-side on CUDA) and the memory timeline by category, exported as HTML, PNG and JSON. ``Recorder``
(fabric_memory_recipes/measurement/profiling.py) records the steps; the experiments use the phase timer too.
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
import warnings
from typing import Any

from torch.profiler._memory_profiler import _CATEGORY_TO_COLORS, _CATEGORY_TO_INDEX, MemoryProfileTimeline

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
    # What the profiler could not attribute to a tensor's role: on a CPU mostly the optimizer kernel's own
    # scratch (the fused Adam step's temporaries), whose size follows the CPU's kernels, not the model.
    attributed = [t - u for t, u in zip(totals, per_category.get("unknown", [0.0] * len(ms)), strict=True)]
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
        "peak_attributed_gb": max(attributed),
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
        "peak_attributed_gb": data["peak_attributed_gb"],
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

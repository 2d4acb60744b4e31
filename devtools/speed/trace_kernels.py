"""What the kernels of a profiled step did, read from the Chrome trace ``devtools.speed.rung_profile`` wrote:
kernels and busy GPU time per step, the gaps between consecutive kernels (inside a CUDA graph's replay: what
the GPU spends starting the next node), time by class of kernel, and with ``--results`` the bandwidth
BatchNorm's two forward passes reached (each layer's kernels paired in order with the simulation's
BatchNorm ops of the same run's configuration, which give the bytes).

    python -m devtools.speed.trace_kernels DIR/trace-TAG.json.gz [...] [--steps 4]
    python -m devtools.speed.trace_kernels DIR/trace-TAG.json.gz --results DIR/runs/TAG/your_model.json

``--results`` pairs a step's forward BatchNorm kernels with the simulated ops: a run without checkpointing
or accumulation (each layer's forward once per step).
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections import defaultdict
from typing import Any

from fabric_memory_recipes.console import Parser

GAP_US = 100.0  # a longer gap between kernels is the host's (a new step, a launch), not the graph's
CLASSES = (  # (class, words of the kernel's name), the first match wins
    ("BatchNorm statistics", ("collect_statistics",)),
    ("BatchNorm forward elementwise", ("transform_input", "batch_norm_elementwise")),
    ("BatchNorm backward reduce", ("backward_reduce",)),
    ("BatchNorm backward elementwise", ("backward_elemt",)),
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("convolution", ("conv", "dgrad", "wgrad")),
    ("matmul", ("gemm", "nvjet", "cutlass")),
    ("optimizer", ("multi_tensor_apply",)),
)


def kernel_class(name: str) -> str:
    return next((c for c, words in CLASSES if any(w in name for w in words)), "other")


def kernels(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU's kernels, copies and fills of ``trace``, in the order they ran."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    return sorted((e for e in trace["traceEvents"] if e.get("cat") in kinds), key=lambda e: e["ts"])


def summary(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per step: kernels, busy ms, the short gaps between kernels (count, ms, mean us), ms and count by class."""
    gaps = [b["ts"] - a["ts"] - a["dur"] for a, b in zip(events, events[1:], strict=False)]
    short = [g for g in gaps if g < GAP_US]
    by_class: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in events:
        row = by_class[kernel_class(e["name"])]
        row[0] += 1 / steps
        row[1] += e["dur"] / 1e3 / steps
    return {
        "kernels": len(events) / steps,
        "busy_ms": sum(e["dur"] for e in events) / 1e3 / steps,
        "short_gaps": len(short) / steps,
        "short_gap_ms": sum(short) / 1e3 / steps,
        "mean_short_gap_us": statistics.fmean(short) if short else 0.0,
        "by_class": {
            k: {"kernels": v[0], "ms": v[1]} for k, v in sorted(by_class.items(), key=lambda kv: -kv[1][1])
        },
    }


def batch_norm_rates(events: list[dict[str, Any]], input_bytes: list[float]) -> list[dict[str, float]]:
    """Each forward BatchNorm layer (``input_bytes``: its input's bytes, in the order the layers ran) paired
    with the first step's statistics and elementwise kernels: their microseconds and the GB/s each reached
    (the statistics pass reads the input; the elementwise pass reads it and writes as much)."""
    stats = [e for e in events if kernel_class(e["name"]) == "BatchNorm statistics"]
    elementwise = [e for e in events if kernel_class(e["name"]) == "BatchNorm forward elementwise"]
    rows = []
    for b, s, t in zip(input_bytes, stats, elementwise, strict=False):
        rows.append(
            {
                "input_mb": b / 1e6,
                "statistics_us": s["dur"],
                "statistics_gb_s": b / s["dur"] / 1e3,
                "elementwise_us": t["dur"],
                "elementwise_gb_s": 2 * b / t["dur"] / 1e3,
            }
        )
    return rows


def simulated_batch_norm_inputs(results: str) -> list[float]:
    """The input bytes of each forward BatchNorm op of the run ``results`` describes, in order, from the step-time
    fit's own simulation of that run (its first micro-batch's statistics passes issued by the forward)."""
    from fabric_memory_recipes.planning.your_model import step_calibration

    config = json.loads(open(results).read())["config"]
    mode = step_calibration.run_mode(config)
    run = step_calibration.Run(results, "your_model", config["model"], mode, config, 0.0, 1)
    first = step_calibration.run_costs(run).micro[0]
    return [float(b) for b in first.reduced[first.python & (first.reduced > 0)]]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="trace-TAG.json.gz files of devtools.speed.rung_profile")
    parser.add_argument("--steps", type=int, default=4, help="steps the profile recorded")
    parser.add_argument("--results", help="the profiled run's results JSON: BatchNorm's pass rates")
    args = parser.parse_args(argv)
    for path in args.traces:
        with gzip.open(path) as f:
            events = kernels(json.load(f))
        s = summary(events, args.steps)
        print(
            f"{path}: {s['kernels']:.0f} kernels/step, busy {s['busy_ms']:.2f} ms, short gaps"
            f" {s['short_gap_ms']:.2f} ms (mean {s['mean_short_gap_us']:.2f} us)"
        )
        for name, row in s["by_class"].items():
            print(f"    {name:32s} {row['kernels']:7.1f} kernels {row['ms']:8.2f} ms")
        if args.results:
            print("    input MB  statistics us  GB/s  elementwise us  GB/s")
            for r in batch_norm_rates(events, simulated_batch_norm_inputs(args.results)):
                print(
                    f"    {r['input_mb']:8.1f} {r['statistics_us']:14.1f} {r['statistics_gb_s']:5.0f}"
                    f" {r['elementwise_us']:15.1f} {r['elementwise_gb_s']:5.0f}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

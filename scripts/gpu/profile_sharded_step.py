"""Where a sharded rung's step goes, on rank 0: compute kernels, all-gathers and reduce-scatters (their kernel
time and the part of it no compute kernel overlaps: what the step waits for), copies, the GPU idle (waiting for
the host), and the forward / backward / optimizer phases.

    python scripts/gpu/profile_sharded_step.py --out DIR [--wait 5] [--active 3] -- recipes/08_fsdp2.py \\
        --devices 4 --data synthetic --weights none --max-steps 10 --eval-batches 1 --results-dir DIR
    python scripts/gpu/profile_sharded_step.py --table DIR [DIR ...]    # the profiles side by side

The recipe runs as written (its own launcher starts the other ranks, which run the recipe alone). In this
process, rank 0, the loop's recorder is replaced by a profiler (CPU and CUDA activity, no memory, no stacks)
that skips ``--wait`` steps (compilation, warm-up), warms up one more and records ``--active`` steps; give
the recipe ``--max-steps`` of at least their sum. DIR gets ``trace.json.gz`` (rank 0's Chrome trace) and
``profile.json`` (:func:`summarise`); ``--table`` writes ``profile_summary.md`` beside the first DIR's
parent and prints it. Profiling slows the host: compare its runs with each other, not with timed runs.
Exit code: 0, 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import runpy
import shutil
import sys
from pathlib import Path

import torch

from fabric_memory_recipes.measurement import profiling
from fabric_memory_recipes.measurement.timeline import phase_ranges

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
COMM_KINDS = (("all_gather", "allgather"), ("reduce_scatter", "reducescatter"), ("all_reduce", "allreduce"))
PHASES = ("forward", "backward", "optimizer")


# ------------------------------------------------------------------------------------------- intervals
def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merged(intervals))


def minus(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """How long ``intervals`` run while nothing of ``cover`` does."""
    cover, total = merged(cover), 0.0
    for a, b in merged(intervals):
        covered = sum(max(0.0, min(b, d) - max(a, c)) for c, d in cover if c < b and d > a)
        total += (b - a) - covered
    return total


def comm_kind(name: str) -> str | None:
    """'all_gather', 'reduce_scatter', 'all_reduce' or 'other_comm' for an NCCL kernel, else None."""
    low = name.lower().replace("_", "")
    if "nccl" not in low:
        return None
    return next((kind for kind, key in COMM_KINDS if key in low), "other_comm")


# --------------------------------------------------------------------------------------------- summary
def summarise(doc: dict, phases: list[tuple] | None = None, top: int = 8) -> dict:
    """Per step (ms) over the trace's ``ProfilerStep#`` spans: ``step`` (host), GPU ``busy`` (any kernel,
    copy or set), ``compute`` (kernels other than NCCL's), each NCCL kind's kernel time and its ``exposed``
    part (no compute kernel running), ``copies``, ``idle`` (no GPU work at all), the phases' GPU spans
    (``phases``: :func:`~fabric_memory_recipes.measurement.timeline.phase_ranges` of the same trace) and the
    ``top`` kernels by time. GPU work is clipped to the steps' window."""
    events = [e for e in doc.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    if not steps:
        raise ValueError("no ProfilerStep# span in the trace: the profiler recorded no active step")
    t0, t1, n = min(a for a, _ in steps), max(b for _, b in steps), len(steps)
    compute, copies, every = [], [], []
    comm: dict[str, list[tuple[float, float]]] = {}
    kernels: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        a, b = max(float(e["ts"]), t0), min(float(e["ts"]) + float(e.get("dur", 0)), t1)
        if b <= a:
            continue
        name, span = str(e.get("name", "")), (a, b)
        every.append(span)
        kind = comm_kind(name) if e["cat"] == "kernel" else None
        if e["cat"] != "kernel":
            copies.append(span)
        elif kind:
            comm.setdefault(kind, []).append(span)
        else:
            compute.append(span)
        kernels.setdefault(name, []).append(b - a)
    per = 1000.0 * n  # microseconds over n steps -> ms per step
    out = {
        "steps": n,
        "step": (t1 - t0) / per,
        "busy": length(every) / per,
        "compute": length(compute) / per,
        "copies": length(copies) / per,
        "idle": ((t1 - t0) - length(every)) / per,
    }
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "other_comm"):
        spans = comm.get(kind, [])
        out[kind] = length(spans) / per
        out[f"{kind}_exposed"] = minus(spans, compute) / per
    base = float(doc.get("baseTimeNanoseconds", 0)) / 1000.0
    for phase in PHASES:  # GPU-side spans of the ranges opened on the host inside the window
        spans = [ms for p, h0, _, ms, _ in phases or [] if p == phase and t0 + base <= h0 <= t1 + base]
        out[phase] = sum(spans) / n if spans else None
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    out["top_kernels"] = [{"name": k[:100], "ms": sum(v) / per, "calls": len(v) / n} for k, v in ranked]
    return out


COLUMNS = (
    ("step", "step"),
    ("busy", "GPU busy"),
    ("compute", "compute"),
    ("all_gather", "all-gather"),
    ("reduce_scatter", "reduce-scatter"),
    ("all_reduce", "all-reduce"),
    ("copies", "copies"),
    ("idle", "GPU idle"),
    ("forward", "forward"),
    ("backward", "backward"),
    ("optimizer", "optimizer"),
)


def table(profiles: list[dict]) -> str:
    """The profiles side by side, ms per step; NCCL columns show kernel time (exposed: not overlapped)."""
    head = "| run | GPUs | " + " | ".join(label for _, label in COLUMNS) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(COLUMNS)]
    for p in profiles:
        s, cells = p["summary"], []
        for key, _ in COLUMNS:
            v = s.get(key)
            cell = "" if v is None else f"{v:.1f}"
            if f"{key}_exposed" in s and v:
                cell += f" ({s[f'{key}_exposed']:.1f})"
            cells.append(cell)
        lines.append(f"| {p['label']} | {p['devices']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "ms per step on rank 0 over the recorded steps; all-gather / reduce-scatter / all-reduce: NCCL"
        " kernel time (in brackets: the part with no compute kernel running, what the step waits for);"
        " GPU idle: no kernel, copy or set running (the GPU waits for the host); forward / backward /"
        " optimizer: GPU-side spans of the loop's phases.",
        "",
    ]
    for p in profiles:
        lines.append(
            f"{p['label']} ({p['devices']} GPUs), top kernels: "
            + "; ".join(f"{k['name'][:60]} {k['ms']:.1f} ms" for k in p["summary"]["top_kernels"][:5])
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- the profiler
class StepTracer:
    """What the loop records with on rank 0 (the interface of ``profiling.Recorder``): a profiler over
    ``active`` steps after ``wait`` + 1, whose trace is summarised into ``out``."""

    def __init__(
        self, device: torch.device, out: Path, wait: int, active: int, label: str, devices: int
    ) -> None:
        self.device, self.out, self.wait, self.active = device, out, wait, active
        self.label, self.devices, self.done, self._profiler = label, devices, 0, None

    def start(self) -> StepTracer:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=self.wait, warmup=1, active=self.active, repeat=1),
            on_trace_ready=self._ready,
        )
        self._profiler.__enter__()
        return self

    def region(self, name: str):
        return torch.profiler.record_function(f"## {name} ##") if self._profiler else contextlib.nullcontext()

    def step(self) -> None:
        if self._profiler is None:
            return
        self.done += 1
        last = self.done >= self.wait + 1 + self.active
        if last and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last step's kernels end inside its span
        self._profiler.step()
        if last:
            self.close()

    def close(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.__exit__(None, None, None)

    def _ready(self, prof) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "trace.json"
        prof.export_chrome_trace(str(path))
        doc = json.loads(path.read_text())
        summary = summarise(doc, phase_ranges(str(path)))
        record = {"label": self.label, "devices": self.devices, "wait": self.wait, "summary": summary}
        (self.out / "profile.json").write_text(json.dumps(record, indent=1))
        with path.open("rb") as f, gzip.open(self.out / "trace.json.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        path.unlink()
        print(
            f"[profile] {self.label} x{self.devices}: {summary['step']:.1f} ms a step, compute"
            f" {summary['compute']:.1f}, idle {summary['idle']:.1f} -> {self.out}",
            flush=True,
        )


def install(out: Path, wait: int, active: int) -> None:
    """Rank 0's loop records with a :class:`StepTracer`; the other ranks with the usual (inactive) recorder."""
    usual = profiling.Recorder.for_run

    def for_run(cls, fabric, results):
        if not fabric.is_global_zero:
            return usual(fabric, results)
        cfg = results.cfg
        return StepTracer(fabric.device, out, wait, active, f"{cfg.recipe} {cfg.mode}", fabric.world_size)

    profiling.Recorder.for_run = classmethod(for_run)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="profile_sharded_step.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder for trace.json.gz and profile.json")
    p.add_argument("--wait", type=int, default=5, help="steps before the profiler warms up (default 5)")
    p.add_argument("--active", type=int, default=3, help="steps recorded (default 3)")
    p.add_argument(
        "--table", nargs="+", type=Path, metavar="DIR", help="tabulate these folders' profile.json"
    )
    p.add_argument("recipe", nargs=argparse.REMAINDER, help="-- recipes/NN.py [its flags]")
    args = p.parse_args(argv)
    if args.table:
        try:
            profiles = [json.loads((d / "profile.json").read_text()) for d in args.table]
        except (OSError, ValueError) as e:
            print(f"profile_sharded_step.py: error: --table: {e}", file=sys.stderr)
            return 2
        text = table(profiles)
        (args.table[0].parent / "profile_summary.md").write_text(text)
        print(text, end="")
        return 0
    recipe = args.recipe[1:] if args.recipe[:1] == ["--"] else args.recipe
    if args.out is None or not recipe or not Path(recipe[0]).is_file() or args.wait < 0 or args.active < 1:
        print(
            "profile_sharded_step.py: error: give --out DIR, --wait >= 0, --active >= 1 and -- RECIPE.py"
            " [flags] (an existing recipe file)",
            file=sys.stderr,
        )
        return 2
    install(args.out, args.wait, args.active)
    sys.argv = [
        os.path.abspath(recipe[0]),
        *recipe[1:],
    ]  # Fabric's launcher starts the other ranks with these
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

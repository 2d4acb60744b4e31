"""Where a run's peak reserved goes, against the estimate's allocator replay. Reads a snapshot that
``recipes/your_model.py --snapshot`` wrote (the caching allocator's own record of its first steps;
scripts/gpu/reserved_snapshots.sh makes them) and prints:

* the GPU's reserved bytes over the recording (its segments created and released) and their peak, and at
  the peak each stream's reserved and allocated bytes (FSDP's side streams hold segments of their own);
* the recorded trace replayed through the estimate's allocator model
  (planning/simulation/allocator.py: :func:`replay_recorded`): the model right on the real sequence of
  requests reserves what the GPU did;
* with ``--estimate FLAGS``: the estimate's own simulated step for the same flags, its replayed peak
  reserved, and the request sizes of one step side by side with the GPU's (bytes requested per size, the
  largest differences first): what the simulation asks for that the GPU did not, and the reverse.

    python -m devtools.your_model.reserved_trace SNAPSHOT.pickle.gz [--estimate --model ... --fused-loss ...]
    python -m devtools.your_model.reserved_trace --strip SNAPSHOT.pickle   # writes SNAPSHOT.pickle.gz
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fabric_memory_recipes.planning import __main__ as estimate_cli
from fabric_memory_recipes.planning.simulation import simulate
from fabric_memory_recipes.planning.simulation.allocator import in_use_before, replay_recorded, round_size

GB = 1e9


# Python frames worth keeping of a request's stack: who asked for the memory (FSDP, the optimizer, the model)
WHERE = (
    "distributed/fsdp",
    "torch/optim",
    "fabric_memory_recipes",
    "transformers/",
    "lightning/",
    "checkpoint",
)


def where(frames: list[dict[str, Any]] | None) -> str:
    """The innermost two frames of ``frames`` (innermost first) from :data:`WHERE`: 'file:line name; ...'."""
    kept = [f for f in frames or [] if any(w in f.get("filename", "") for w in WHERE)][:2]
    return "; ".join(
        f"{'/'.join(f['filename'].split('/')[-2:])}:{f.get('line')} {f.get('name')}" for f in kept
    )


def strip(path: Path) -> Path:
    """The snapshot without its stack frames (the sizes, the streams and the order are what this reads; each
    request keeps :func:`where` it came from), gzip'd."""
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    for trace in snapshot["device_traces"]:
        for event in trace:
            event["where"] = where(event.pop("frames", None))
    for segment in snapshot["segments"]:
        segment.pop("frames", None)
        for block in segment["blocks"]:
            block.pop("frames", None)
    out = path.with_name(path.name + ".gz")
    with gzip.open(out, "wb") as f:
        pickle.dump(snapshot, f)
    return out


def gpu_reserved(snapshot: dict[str, Any]) -> tuple[float, float, float]:
    """(reserved when the recording started, its peak over the recording, at its end), GB."""
    trace = snapshot["device_traces"][0]
    created_here = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    freed_here = {e["addr"]: e["size"] for e in trace if e["action"] == "segment_free"}
    at_end = sum(s["total_size"] for s in snapshot["segments"])
    start = sum(s["total_size"] for s in snapshot["segments"] if s["address"] not in created_here)
    start += sum(n for a, n in freed_here.items() if a not in created_here)
    reserved = peak = start
    for e in trace:
        if e["action"] == "segment_alloc":
            reserved += e["size"]
        elif e["action"] == "segment_free":
            reserved -= e["size"]
        peak = max(peak, reserved)
    return start / GB, peak / GB, at_end / GB


def by_stream_at_peak(snapshot: dict[str, Any]) -> tuple[dict[int, int], dict[int, int]]:
    """(reserved, allocated) bytes per stream when the GPU's reserved memory peaked over the recording
    (the segments that existed when it started, with their blocks in use, included)."""
    trace = snapshot["device_traces"][0]
    created = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    reserved: collections.Counter = collections.Counter()
    allocated: collections.Counter = collections.Counter()
    for segment in snapshot["segments"]:
        if segment["address"] not in created:
            reserved[segment.get("stream", 0)] += segment["total_size"]
    segments = [(seg["address"], seg["total_size"], seg.get("stream", 0)) for seg in snapshot["segments"]]
    for address, size in in_use_before(snapshot).items():
        allocated[next((st for a, n, st in segments if a <= address < a + n), 0)] += size
    live: dict[int, tuple[int, int]] = {}
    peak, at_peak = sum(reserved.values()), (dict(reserved), dict(allocated))
    for e in trace:
        action, stream = e["action"], e.get("stream", 0)
        if action == "segment_alloc":
            reserved[stream] += e["size"]
        elif action == "segment_free":
            reserved[stream] -= e["size"]
        elif action == "alloc":
            allocated[stream] += e["size"]
            live[e["addr"]] = (stream, e["size"])
        elif action == "free_completed" and e["addr"] in live:
            s, n = live.pop(e["addr"])
            allocated[s] -= n
        if sum(reserved.values()) > peak:
            peak, at_peak = sum(reserved.values()), (dict(reserved), dict(allocated))
    return at_peak


def requests_of_one_step(sizes: list[int], steps: int) -> collections.Counter:
    """Bytes requested per rounded size, per step."""
    out: collections.Counter = collections.Counter()
    for n in sizes:
        out[round_size(n)] += round_size(n)
    return collections.Counter({k: v / steps for k, v in out.items()})


@contextlib.contextmanager
def step_events() -> Iterator[dict[str, Any]]:
    """Inside: the allocator events of each simulated step (the last one's), caught where the simulation
    hands them to the allocator replay; the dict yielded gets ``events`` and ``marks``."""
    caught: dict[str, Any] = {}
    original = simulate.peaks_reserved

    def keep(events, marks, *args, **kwargs):
        caught["events"], caught["marks"] = list(events), dict(marks)
        return original(events, marks, *args, **kwargs)

    simulate.peaks_reserved = keep
    try:
        yield caught
    finally:
        simulate.peaks_reserved = original


def simulated(flags: list[str]) -> tuple[list, dict[str, int]]:
    """The simulated step's allocation events for ``fmr-estimate FLAGS`` (the estimate runs in process)."""
    with step_events() as caught:
        estimate_cli.main(flags)
    return caught["events"], caught["marks"]


def report(path: Path, flags: list[str], steps: int) -> None:
    with gzip.open(path) if path.suffix == ".gz" else open(path, "rb") as f:
        snapshot = pickle.load(f)
    start, peak, end = gpu_reserved(snapshot)
    model, grown, created = replay_recorded(snapshot)
    print(
        f"{path.name}: GPU reserved {start:.3f} GB when recording started, peak {peak:.3f}, at the end {end:.3f}"
    )
    print(f"  the recorded requests replayed in the allocator model: peak reserved {model.peak_reserved / GB:.3f} GB,"
          f" peak allocated {model.peak_allocated / GB:.3f}; segments made {len(grown)} (GPU {len(created)}),"
          f" the same sizes: {sorted(grown) == sorted(created)}")  # fmt: skip
    reserved, allocated = by_stream_at_peak(snapshot)
    for stream in sorted(reserved, key=lambda k: -reserved[k]):
        print(f"  at the peak, stream {stream}: {reserved[stream] / GB:.3f} GB reserved,"
              f" {allocated.get(stream, 0) / GB:.3f} GB allocated")  # fmt: skip
    trace = snapshot["device_traces"][0]
    gpu_sizes = [e["size"] for e in trace if e["action"] == "alloc"]
    if not flags:
        return
    events, marks = simulated(flags)
    sim_sizes = [n for kind, _, n in events[marks["step"] : marks["end"]] if kind == "alloc"]
    gpu, sim = requests_of_one_step(gpu_sizes, steps), requests_of_one_step(sim_sizes, 1)
    print(
        f"  requests per step: GPU {len(gpu_sizes) / steps:.0f} ({sum(gpu.values()) / GB:.2f} GB),"
        f" simulated {len(sim_sizes)} ({sum(sim.values()) / GB:.2f} GB)"
    )
    diff = sorted(set(gpu) | set(sim), key=lambda k: -abs(gpu.get(k, 0) - sim.get(k, 0)))
    print("  size MB | GPU GB per step | simulated GB | simulated - GPU")
    for k in diff[:25]:
        g, s = gpu.get(k, 0) / GB, sim.get(k, 0) / GB
        print(f"  {k / 2**20:10.3f} | {g:8.3f} | {s:8.3f} | {s - g:+8.3f}")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--strip"]:
        for p in args[1:]:
            print(strip(Path(p)))
        return 0
    if not args or args[0].startswith("-"):
        print(__doc__)
        return 2
    path, rest = Path(args[0]), args[1:]
    steps = 3
    if rest[:1] == ["--steps"]:
        steps, rest = int(rest[1]), rest[2:]
    flags = rest[1:] if rest[:1] == ["--estimate"] else []
    report(path, flags, steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

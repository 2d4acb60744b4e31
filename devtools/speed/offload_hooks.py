"""What rung 11's offload hooks cost the host in an eager step, and what the batched copies save.

Eager ViT-L/16 at micro-batch 4 is host-bound (docs/fast_mode.md), so every CUDA call a hook makes per
saved tensor is paid in step time. This runs the forward and backward passes of rung 11's micro-batches
(bf16-true through Fabric, synthetic uint8 images resized on the device as the recipes do; no optimizer
step: the hooks are what differs) under each way of offloading, one after another in one process:

- ``none``: no offload (the floor of the host time);
- ``compute``: the copies in the compute stream's order (no window: rungs 14 and 16, ``--offload-window-mb 0``);
- ``per-tensor``: side streams, one tensor at a time (``batched=False``: fast mode's, and eager's before);
- ``batched``: side streams, copies in batches of a quarter of the window (eager rung 11 now).

For each: milliseconds per micro-batch (the GPU done, over ``--micro-batches``, ``--repeats`` times:
median, min, max), the host's share (until the last kernel is queued), the hooks' own host time (a
timer around pack and unpack), the saved tensors counted, Python's garbage collections, and the peak
reserved memory. Then one
step of 4 micro-batches of ``per-tensor`` and ``batched`` under torch.profiler: its CPU ops and CUDA
runtime calls by self CPU time (``cudaEventRecord``, ``cudaStreamWaitEvent``, ``cudaMemcpyAsync`` ...),
with the hooks as ``offload.pack`` / ``offload.unpack`` ranges. Writes ``offload_hooks.json`` and
``profile-<mode>.txt`` to ``--out``.

    python -m devtools.speed.offload_hooks --out DIR                      # on a CUDA GPU, about a minute
    python -m devtools.speed.offload_hooks --device cpu --model vit_tiny --min-kb 1  # the mechanics, on a CPU
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.training import data, models
from fabric_memory_recipes.training.techniques.offload import offload_activations

MODES = ("none", "compute", "per-tensor", "batched")


def make_hooks(mode: str, args, devices: tuple[str, ...]):
    if mode == "none":
        return None
    window = None if mode == "compute" else args.window_mb << 20
    return offload_activations(
        window, min_bytes=args.min_kb << 10, devices=devices, batched=mode == "batched"
    )


class HookTimer:
    """Wraps a hooks object's pack and unpack: their host seconds and calls, optionally as profiler ranges."""

    def __init__(self, hooks, ranges: bool = False) -> None:
        self.seconds = {"pack": 0.0, "unpack": 0.0}
        self.calls = {"pack": 0, "unpack": 0, "offloaded": 0}
        pack, unpack = hooks.pack_hook, hooks.unpack_hook

        def timed_pack(t):
            with record_function("offload.pack") if ranges else _nothing():
                start = time.perf_counter()
                packed = pack(t)
                self.seconds["pack"] += time.perf_counter() - start
            self.calls["pack"] += 1
            self.calls["offloaded"] += not isinstance(packed, torch.Tensor)
            return packed

        def timed_unpack(packed):
            with record_function("offload.unpack") if ranges else _nothing():
                start = time.perf_counter()
                t = unpack(packed)
                self.seconds["unpack"] += time.perf_counter() - start
            self.calls["unpack"] += 1
            return t

        hooks.pack_hook, hooks.unpack_hook = timed_pack, timed_unpack


class GcTimer:
    """Python's garbage collections while it is on: how many, and their milliseconds (each saved tensor's
    packed object is kept by autograd until backward, where tracked objects make collections longer)."""

    def __init__(self) -> None:
        self.collections, self.seconds, self._start = 0, 0.0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.collections += 1
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def micro_batches(fabric, model, batch_fn, hooks, batches: list) -> float:
    """Forward and backward of each batch (the loss divided by their number); returns the host seconds
    until the last one was queued."""
    start = time.perf_counter()
    for batch in batches:
        with hooks if hooks is not None else _nothing():
            loss, _, _ = batch_fn(model, batch)
        fabric.backward(loss / len(batches))
    return time.perf_counter() - start


def measure(mode: str, fabric, model, batch_fn, batches: list, args) -> dict:
    device = fabric.device
    hooks = make_hooks(mode, args, (device.type,))
    timer = HookTimer(hooks) if hooks is not None else None
    for _ in range(2):  # warm-up: host buffers, allocator, cuBLAS
        micro_batches(fabric, model, batch_fn, hooks, batches)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if timer is not None:
        timer.seconds = dict.fromkeys(timer.seconds, 0.0)
        timer.calls = dict.fromkeys(timer.calls, 0)
    walls, hosts, collector = [], [], GcTimer()
    for _ in range(args.repeats):
        sync(device)
        start = time.perf_counter()
        hosts.append(micro_batches(fabric, model, batch_fn, hooks, batches))
        sync(device)
        walls.append(time.perf_counter() - start)
    collector.close()
    n = len(batches) * args.repeats
    per_mb = [1000 * w / len(batches) for w in walls]
    row = {
        "mode": mode,
        "ms_per_micro_batch": {"median": statistics.median(per_mb), "min": min(per_mb), "max": max(per_mb)},
        "host_ms_per_micro_batch": 1000 * statistics.median(hosts) / len(batches),
        "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else None,
        "gc_per_micro_batch": {"collections": collector.collections / n, "ms": 1000 * collector.seconds / n},
    }
    if timer is not None:
        row["hook_ms_per_micro_batch"] = {k: 1000 * v / n for k, v in timer.seconds.items()}
        row["hook_calls_per_micro_batch"] = {k: v / n for k, v in timer.calls.items()}
        row["traffic_gb"] = hooks.traffic.summary()
    model.zero_grad(set_to_none=True)
    print(json.dumps(row), flush=True)
    return row


def profiled(mode: str, fabric, model, batch_fn, batches: list, args, out: Path) -> None:
    device = fabric.device
    hooks = make_hooks(mode, args, (device.type,))
    HookTimer(hooks, ranges=True)
    for _ in range(2):
        micro_batches(fabric, model, batch_fn, hooks, batches)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        micro_batches(fabric, model, batch_fn, hooks, batches)
        sync(device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50)
    (out / f"profile-{mode}.txt").write_text(table)
    print(f"== torch.profiler, one step of {len(batches)} micro-batches, {mode}\n{table}", flush=True)
    model.zero_grad(set_to_none=True)


def main(argv=None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="vit_l_16", choices=models.MODEL_NAMES)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4, help="per step (rung 11: 4)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window-mb", type=int, default=64)
    parser.add_argument("--min-kb", type=int, default=64, help="smaller saved tensors stay (the recipe's 64)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "offload_hooks: --device cuda: no CUDA GPU here (use --device cpu)\n")
    if any(m not in MODES for m in modes):
        parser.exit(2, f"offload_hooks: --modes: each one of {', '.join(MODES)}\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fabric = L.Fabric(accelerator=args.device, devices=1, precision="bf16-true")
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    with fabric.init_module(empty_init=False):
        model = models.build_model(args.model, None, data.NUM_CLASSES)
    model = fabric.setup(model)
    batch_fn = data.image_classification(model.image_size)
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 256, (args.micro_batch, 32, 32, 3), dtype=torch.uint8, generator=g).to(
                fabric.device
            ),
            torch.randint(0, data.NUM_CLASSES, (args.micro_batch,), generator=g).to(fabric.device),
        )
        for _ in range(args.micro_batches)
    ]
    rows = [measure(m, fabric, model, batch_fn, batches, args) for m in modes]
    for m in ("per-tensor", "batched"):
        if m in modes:
            profiled(m, fabric, model, batch_fn, batches, args, out)
    summary = {
        "what": "forward+backward of rung 11's micro-batches under each offload mode (devtools/speed/offload_hooks.py)",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": vars(args),
        "rows": rows,
    }
    (out / "offload_hooks.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

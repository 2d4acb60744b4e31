"""Where a rung's training step spends its GPU time: a recipe run as usual, with torch.profiler on for a
few of its steps after the warm-up, summarised by kind of kernel.

    python -m devtools.speed.rung_profile --out DIR [--start 8 --steps 4] [--knob NAME ...] -- \\
        recipes/15_speed.py --data synthetic --weights none --max-steps 14 --eval-batches 1

The recipe runs in this process (``runpy``, as ``python recipes/...`` would), with its own flags: fast mode
by default on CUDA, ``--no-cuda-graphs`` for the compiled model without the graph. After optimizer step
``--start`` (past compilation and the capture) the GPU is synchronised and the profiler records the next
``--steps`` steps; the loop's forward / backward / optimizer regions are marked (``## name ##``) while it
records. Under a CUDA graph the kernels are all launched by one ``cudaGraphLaunch``, so they are grouped
by kind only; without the graph, each kernel is also assigned to the phase whose range launched it.

Written to ``--out``: ``profile-<tag>.md`` (the table: GPU ms per step by kind - linear-layer matrix
products, attention, the patch convolution, Triton pointwise and reduction kernels (LayerNorm, GELU,
residual adds, casts), ATen elementwise kernels, copies, the GPU idle between kernels - the host's
kernel launches and its time in calls that wait for the GPU (synchronisations, device-to-host copies),
then the longest kernels, and the model's FLOPs by kind against the time of their kernels; none for
your model's), ``profile-<tag>.json`` and the
Chrome trace ``trace-<tag>.json.gz``. The recipe writes its results JSON as usual (its speed includes
the profiler: time the rung in a run of its own).

``--knob`` applies a setting before the recipe starts, to A/B it without changing the recipe:
``cudnn-attention`` (flash and memory-efficient SDPA off: cuDNN's attention), ``cudnn-benchmark``
(cuDNN times its algorithms for the patch convolution at the first step), ``coordinate-descent``
(inductor tunes its Triton kernels' launch configurations), ``max-autotune-gemm`` (inductor benchmarks
Triton templates against cuBLAS for every matrix product: minutes of compilation). ``--no-profile``:
only the knobs (the run's own img/s is then the measurement).
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import re
import runpy
import shutil
import sys
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.flop_counter import FlopCounterMode

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.training import models
from fabric_memory_recipes.training.loop_plumbing import TrainingRun
from fabric_memory_recipes.training.techniques import attention


def _cudnn_attention() -> None:
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)


def _inductor(**settings) -> None:
    for key, value in settings.items():
        setattr(inductor_config, key, value)


def _cudnn_benchmark() -> None:
    torch.backends.cudnn.benchmark = True


KNOBS = {
    "cudnn-attention": _cudnn_attention,
    "cudnn-benchmark": _cudnn_benchmark,
    "coordinate-descent": lambda: _inductor(coordinate_descent_tuning=True),
    "max-autotune-gemm": lambda: _inductor(max_autotune_gemm=True),
}

# kernel name (lower case) -> kind; the first match wins (a convolution's implicit GEMM is a convolution)
KINDS = [
    ("attention", r"flash|fmha|attention|sdpa|_attn"),
    ("patch convolution", r"fprop|dgrad|wgrad|conv|implicit_gemm|im2col"),
    ("linear matmul", r"gemm|nvjet|cutlass|xmma|matmul|triton_tem_fused|cublas|splitk"),
    ("optimizer (fused)", r"multi_tensor_apply|adam"),
    ("triton reduction (layernorm, softmax, loss)", r"^triton_(red|per)_"),
    ("triton pointwise (gelu, adds, casts, copies)", r"^triton_poi_"),
    (
        "aten elementwise / reduce",
        r"elementwise|reduce_kernel|layer_norm|softmax|cross_entropy|nll|index|cat",
    ),
]
GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "copies (memcpy)", "gpu_memset": "copies (memset)"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
# Runtime calls that launch a kernel, and those in which the host waits for the GPU (a device-to-host copy
# such as ``.item()`` or a boolean mask's size returns when the stream has run up to it)
KERNEL_LAUNCHES = re.compile(
    r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|cudaLaunchCooperativeKernel)"
)
HOST_WAITS = re.compile(
    r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy\b|cudaMemcpyAsync)"
)


def kind_of(name: str, cat: str) -> str:
    if cat != "kernel":
        return GPU_CATS[cat]
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def model_flops(name: str, batch: int) -> dict[str, float]:
    """Forward+backward FLOPs of the rung's model (fused-qkv attention) by kind, counted on the meta
    device: linear layers (mm/addmm), attention (its batched products or SDPA), the patch convolution;
    none for your model's (a ``SOURCE:NAME`` reference, recipes/your_model.py): its table is left out."""
    if ":" in name:
        return {}
    with torch.device("meta"):
        model = models.build_model(name, None)
        attention.fuse_attention(model)
        x = torch.empty(batch, 3, model.image_size, model.image_size)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    kinds: dict[str, float] = {}
    for op, flops in counter.get_flop_counts()["Global"].items():
        op = str(op)
        kind = (
            "attention"
            if "bmm" in op or "attention" in op
            else "patch convolution"
            if "conv" in op
            else "linear matmul"
        )
        kinds[kind] = kinds.get(kind, 0.0) + flops
    return kinds


def summarise(trace_path: str, steps: int, flops: dict[str, float], title: str) -> tuple[str, dict]:
    """The table of one profile: GPU ms per step by kind (and by phase where ranges exist)."""
    with open(trace_path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    ranges, launches, gpu, compiled = [], {}, [], 0
    kernel_launches, waits = 0, []
    for e in events:
        name, cat = e.get("name", ""), e.get("cat")
        ts, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        corr = (e.get("args") or {}).get("correlation")
        if cat in LAUNCH_CATS:
            kernel_launches += bool(KERNEL_LAUNCHES.match(name))
            if HOST_WAITS.match(name):
                waits.append(dur)
        if cat == "user_annotation" and name.startswith("## ") and name.endswith(" ##"):
            ranges.append((ts, ts + dur, name[3:-3]))
        elif cat in LAUNCH_CATS and corr is not None:
            launches[int(corr)] = (ts, name)
        elif cat in GPU_CATS:
            gpu.append((ts, ts + dur, name, cat, corr))
        elif cat == "cpu_op" and (name.startswith("CompiledFunction") or name.startswith("Torch-Compiled")):
            compiled += 1
    ranges.sort()
    starts = [r[0] for r in ranges]

    def phase_of(corr) -> str:
        launch = launches.get(int(corr)) if corr is not None else None
        if launch is None:
            return "unknown"
        if launch[1].startswith("cudaGraphLaunch"):
            return "CUDA graph"
        i = bisect.bisect_right(starts, launch[0]) - 1
        return ranges[i][2] if i >= 0 and launch[0] <= ranges[i][1] else "outside phases"

    by_kind: dict[str, dict[str, float]] = {}
    by_kernel: dict[str, list] = {}
    for k0, k1, name, cat, corr in gpu:
        kind, phase, ms = kind_of(name, cat), phase_of(corr), (k1 - k0) / 1000.0
        by_kind.setdefault(kind, {}).setdefault(phase, 0.0)
        by_kind[kind][phase] += ms
        entry = by_kernel.setdefault(name, [kind, 0, 0.0])
        entry[1] += 1
        entry[2] += ms
    spans = sorted((k0, k1) for k0, k1, *_ in gpu)
    busy, end = 0.0, None
    for k0, k1 in spans:  # the union of the GPU's work
        if end is None or k0 > end:
            busy += k1 - k0
            end = k1
        elif k1 > end:
            busy += k1 - end
            end = k1
    if not spans:
        return f"## {title}\n\nNo GPU work in the trace (a CPU run): nothing to summarise by kernel.\n", {}
    step_ms = (spans[-1][1] - spans[0][0]) / 1000.0 / steps
    phases = sorted({p for kinds in by_kind.values() for p in kinds})
    lines = [
        f"## {title}",
        "",
        f"{steps} steps profiled; GPU span {step_ms:.1f} ms per step (first kernel to last), busy"
        f" {busy / 1000.0 / steps:.1f} ms, idle {step_ms - busy / 1000.0 / steps:.1f} ms (the GPU waiting"
        f" for the host: launches, data, synchronisation); compiled-graph calls per step"
        f" {compiled / steps:.1f}",
        "",
        f"Host: {kernel_launches / steps:.0f} kernel launches per step; {len(waits) / steps:.1f} calls"
        " per step in which it waited for the GPU (synchronisations, device-to-host copies),"
        f" {sum(waits) / 1000.0 / steps:.1f} ms per step in them",
        "",
        "| kind | ms / step | % of step | " + " | ".join(phases) + " |",
        "|---|---:|---:|" + "---:|" * len(phases),
    ]
    total_by_kind = {k: sum(v.values()) / steps for k, v in by_kind.items()}
    for kind, ms in sorted(total_by_kind.items(), key=lambda kv: -kv[1]):
        cells = " | ".join(f"{by_kind[kind].get(p, 0.0) / steps:.2f}" for p in phases)
        lines.append(f"| {kind} | {ms:.2f} | {100 * ms / step_ms:.1f} | {cells} |")
    idle = step_ms - busy / 1000.0 / steps
    lines.append(f"| GPU idle | {idle:.2f} | {100 * idle / step_ms:.1f} |" + " |" * len(phases))
    lines += [
        "",
        "Model FLOPs per step against the time of their kernels (attention's backward recomputes,"
        " so its kernels do more than the model's count):",
        "",
        "| kind | model TFLOP / step | kernel ms / step | TFLOP/s |",
        "|---|---:|---:|---:|",
    ]
    for kind, f in sorted(flops.items(), key=lambda kv: -kv[1]):
        ms = total_by_kind.get(kind, 0.0)
        rate = f"{f / (ms / 1000.0) / 1e12:.0f}" if ms else "-"
        lines.append(f"| {kind} | {f / 1e12:.2f} | {ms:.2f} | {rate} |")
    lines += [
        "",
        "Longest kernels:",
        "",
        "| kernel | kind | calls / step | ms / step |",
        "|---|---|---:|---:|",
    ]
    for name, (kind, calls, ms) in sorted(by_kernel.items(), key=lambda kv: -kv[1][2])[:25]:
        lines.append(f"| `{name[:90]}` | {kind} | {calls / steps:.1f} | {ms / steps:.2f} |")
    data = {
        "steps": steps,
        "step_ms": step_ms,
        "busy_ms": busy / 1000.0 / steps,
        "idle_ms": idle,
        "compiled_calls_per_step": compiled / steps,
        "kernel_launches_per_step": kernel_launches / steps,
        "host_waits_per_step": len(waits) / steps,
        "host_wait_ms_per_step": sum(waits) / 1000.0 / steps,
        "ms_by_kind": total_by_kind,
        "ms_by_kind_and_phase": {k: {p: v / steps for p, v in d.items()} for k, d in by_kind.items()},
        "model_flops_per_step": flops,
    }
    return "\n".join(lines) + "\n", data


class StepProfiler:
    """Patches the training loop: the profiler on from step ``start`` for ``steps`` steps."""

    def __init__(self, out: Path, tag: str, start: int, steps: int) -> None:
        self.out, self.tag, self.start, self.steps = out, tag, start, steps
        self.prof = None
        self.done = False
        step_done, region = TrainingRun.step_done, TrainingRun.region
        profiler = self

        def patched_step_done(run, group):
            step_done(run, group)
            profiler.after_step(run)

        def patched_region(run, name):
            if profiler.prof is not None:
                return record_function(f"## {name} ##")
            return region(run, name)

        TrainingRun.step_done, TrainingRun.region = patched_step_done, patched_region

    def after_step(self, run) -> None:
        if self.done:
            return
        cuda = run.fabric.device.type == "cuda"
        if run.step == self.start:
            if cuda:
                torch.cuda.synchronize(run.fabric.device)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            self.prof = profile(activities=activities)
            self.prof.__enter__()
        elif self.prof is not None and run.step == self.start + self.steps:
            if cuda:
                torch.cuda.synchronize(run.fabric.device)
            prof, self.prof, self.done = self.prof, None, True
            prof.__exit__(None, None, None)
            self.write(run, prof)

    def write(self, run, prof) -> None:
        cfg = run.cfg
        trace = self.out / f"trace-{self.tag}.json"
        prof.export_chrome_trace(str(trace))
        flops = {
            k: v * cfg.accumulation_steps for k, v in model_flops(cfg.model, cfg.micro_batch_size).items()
        }
        mode = "CUDA graph" if cfg.cuda_graphs else ("compiled" if cfg.compile else "eager")
        title = (
            f"{cfg.run_name} ({self.tag}): {cfg.model}, batch {cfg.batch_size} ({cfg.accumulation_steps}"
            f" x {cfg.micro_batch_size}), {cfg.precision}, {mode}, steps {self.start + 1}-{self.start + self.steps}"
        )
        text, data = summarise(str(trace), self.steps, flops, title)
        data["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        (self.out / f"profile-{self.tag}.md").write_text(text)
        (self.out / f"profile-{self.tag}.json").write_text(json.dumps(data, indent=1))
        with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as z:
            shutil.copyfileobj(f, z)
        trace.unlink()
        print(text, flush=True)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("rung_profile: usage: ... -- recipes/NAME.py [recipe flags]")
    split = argv.index("--")
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--tag", default="run")
    parser.add_argument("--start", type=int, default=8, help="profile after this optimizer step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--knob", action="append", default=[], choices=sorted(KNOBS))
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args(argv[:split])
    recipe, recipe_args = argv[split + 1], argv[split + 2 :]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for knob in args.knob:
        KNOBS[knob]()
    if not args.no_profile:
        StepProfiler(out, args.tag, args.start, args.steps)
    sys.argv = [recipe, *recipe_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(recipe)))
    runpy.run_path(recipe, run_name="__main__")


if __name__ == "__main__":
    main()

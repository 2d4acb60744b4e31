"""What the experiments in experiments/ share: train a model variant for a few steps, measure its memory and its
forward / backward / optimizer times, and put the estimator's prediction next to the measurement.

Every variant is trained the same way (Fabric, synthetic CIFAR-shaped batches resized on the device,
Adam over the trainable parameters only, ``zero_grad(set_to_none=True)``), with the recipes' own training
step (``fabric_memory_recipes.training.step.train_step``). Measured per variant:

* ``peak_allocated_gb`` / ``peak_reserved_gb``: ``torch.cuda.max_memory_*`` over all training steps,
  reset when training starts (CUDA only; null on a CPU);
* ``saved_activations_gb``: bytes autograd saves in one real forward pass, counted with the same
  ``saved_tensors_hooks`` the estimator uses (works on a CPU too);
* ``phase_ms``: median milliseconds of forward, backward and optimizer per step, read from a
  torch.profiler trace (on CUDA, the GPU-side span of the kernels each ``## phase ##`` range launched;
  host-side on a CPU), and on CUDA ``phase_kernel_ms``: the sum of those kernels' own durations
  (``fabric_memory_recipes.measurement.timeline.phase_ranges``, the recipes' ``--memory-timeline`` timer too);
* optionally the memory timeline by category (``--timelines``, ``fabric_memory_recipes.measurement.profiling.Recorder``).

Experiments run eager (no torch.compile): the estimator models the eager graph.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python experiments/x.py` from a plain checkout finds the package
    sys.path.insert(0, str(REPO))

from fabric_memory_recipes import planning, techniques  # noqa: E402
from fabric_memory_recipes.console import Parser  # noqa: E402
from fabric_memory_recipes.measurement import results, results_file  # noqa: E402, F401 (results_file: for the experiments)
from fabric_memory_recipes.measurement.profiling import Recorder  # noqa: E402
from fabric_memory_recipes.paths import output_folder  # noqa: E402
from fabric_memory_recipes.training import data, models  # noqa: E402
from fabric_memory_recipes.training.step import Region, no_region, train_step  # noqa: E402

GB = 1e9


def parser(description: str, defaults: dict[str, Any]) -> argparse.ArgumentParser:
    """The flags both experiments take; ``defaults`` are the full-size GPU configuration."""
    p = Parser(description=description)
    p.add_argument("--accelerator", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--model", choices=models.MODEL_NAMES, default=defaults.get("model", "vit_l_16"))
    p.add_argument(
        "--precision", choices=techniques.PRECISIONS, default=defaults.get("precision", "bf16-true")
    )
    p.add_argument("--batch-size", type=int, default=defaults.get("batch_size", 32))
    p.add_argument("--steps", type=int, default=defaults.get("steps", 8), help="training steps per variant")
    p.add_argument("--profile-steps", type=int, default=3, help="last steps, timed by the profiler")
    p.add_argument(
        "--timelines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also record a memory timeline (PNG/HTML) of each variant (slower)",
    )
    p.add_argument(
        "--out",
        default="runs/experiments",
        type=output_folder("--out"),
        help="folder for the JSON and the plots",
    )
    p.add_argument("--seed", type=int, default=123)
    return p


def resolve_accelerator(name: str) -> str:
    """'auto' -> 'cuda' when a GPU is present, else 'cpu'; 'gpu' is an alias of 'cuda'."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "gpu":
        name = "cuda"
    if name == "cuda" and not torch.cuda.is_available():
        print("--accelerator cuda: no CUDA device available", file=sys.stderr)
        raise SystemExit(2)
    return name


def make_fabric(accelerator: str, precision: str):
    import lightning as L

    if accelerator == "cpu" and precision == "16-mixed":
        print("--precision 16-mixed needs CUDA; use bf16-mixed or bf16-true on a CPU", file=sys.stderr)
        raise SystemExit(2)
    fabric = L.Fabric(accelerator=accelerator, devices=1, precision=precision)
    fabric.launch()
    return fabric


def train_variant(
    name: str,
    build: Callable[[], torch.nn.Module],
    fabric: Any,
    args: argparse.Namespace,
    out_dir: Path,
    prefix: str,
) -> dict[str, Any]:
    """Build a variant, predict its peak, train it for ``args.steps`` steps and measure; return a row."""
    torch.manual_seed(args.seed)
    cuda = fabric.device.type == "cuda"
    with fabric.init_module(empty_init=False):
        model = build()
    trainable = [p for p in model.parameters() if p.requires_grad]
    plan = planning.Plan(
        precision=args.precision,
        micro_batch_size=args.batch_size,
        optimizer="adam",
        optimizer_impl="fused" if cuda else "for-loop",
        device=fabric.device.type,
    )
    predicted = planning.simulate(model, plan, model_name=f"{args.model} ({name})")
    optimizer = torch.optim.Adam(trainable, lr=1e-4, fused=cuda)
    model, optimizer = fabric.setup(model, optimizer)
    batch_fn = data.image_classification(model.image_size)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    images = torch.randint(0, 256, (args.batch_size, 32, 32, 3), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, data.NUM_CLASSES, (args.batch_size,), generator=g)
    batch = (images.to(fabric.device), labels.to(fabric.device))

    def step(rec: Recorder | None = None, region: Region = no_region) -> None:  # the recipes' step, k = 1
        train_step(fabric, model, optimizer, batch_fn, [batch], region=rec.region if rec else region)
        if rec:
            rec.step()

    baseline = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated() / GB  # weights (+ batch): a leak from a variant shows here
    # the first step's forward pass with the estimator's hooks: the bytes autograd saves
    saved_bytes = 0

    @contextlib.contextmanager
    def counting(name: str) -> Iterator[None]:
        nonlocal saved_bytes
        if name != "forward":
            yield
            return
        with planning.SavedTensorCounter([*model.parameters(), *model.buffers()]) as saved:
            yield
        saved_bytes = saved.rounded_nbytes  # read while the forward's graph is alive

    step(region=counting)
    for _ in range(max(0, args.steps - 1 - args.profile_steps)):
        step()
    # timed steps: a light profiler (no memory, no stacks), after the warm-up steps above
    timer = Recorder(fabric.device, steps=args.profile_steps, time_phases=True).start()
    for _ in range(args.profile_steps):
        step(timer)
    timer.close()
    phases, busy = timer.phase_ms
    measured_peak = torch.cuda.max_memory_allocated() / GB if cuda else None
    measured_reserved = torch.cuda.max_memory_reserved() / GB if cuda else None
    timeline = None
    if args.timelines:  # two steps with the memory categoriser
        prefix_path = str(out_dir / f"{prefix}-{name}-timeline")
        rec = Recorder(fabric.device, prefix_path, steps=2, title=name, predicted=predicted.peak_gb).start()
        for _ in range(2):
            step(rec)
        rec.close()
        timeline = rec.timeline_files
    row = {
        "variant": name,
        "parameters": predicted.parameters,
        "predicted": predicted.to_dict(),
        "measured": {
            "peak_allocated_gb": measured_peak,
            "peak_reserved_gb": measured_reserved,
            "allocated_before_training_gb": baseline,
            "saved_activations_gb": saved_bytes / GB,
            "phase_ms": {k: statistics.median(v) for k, v in phases.items()},
            "phase_ms_all": phases,
            "phase_kernel_ms": {k: statistics.median(v) for k, v in busy.items()},
            "timeline": timeline,
        },
    }
    return row


def release() -> None:
    """Between variants: drop the previous variant's memory so each peak is its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def provenance(fabric: Any, args: argparse.Namespace) -> dict[str, Any]:
    cuda = fabric.device.type == "cuda"
    return {
        "device": fabric.device.type,
        "gpu_name": torch.cuda.get_device_name(fabric.device) if cuda else None,
        **results.environment(),
        "model": args.model,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "data": "synthetic (random uint8 images; memory and speed do not depend on values)",
        "weights": "random init",
        "compile": False,
    }


def plot_rows(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Left: predicted components (stacked) next to the measured peak; right: phase times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    xs = range(len(rows))
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    bottoms = [0.0] * len(rows)
    for comp in planning.COMPONENTS:
        vals = [r["predicted"]["components_gb"].get(comp, 0.0) for r in rows]
        if not any(vals):
            continue
        ax_m.bar(
            [x - 0.2 for x in xs],
            vals,
            0.4,
            bottom=bottoms,
            color=planning.COMPONENT_COLORS[comp],
            label=f"predicted: {comp}",
        )
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    measured = [r["measured"]["peak_allocated_gb"] for r in rows]
    if any(m is not None for m in measured):
        bars = ax_m.bar([x + 0.2 for x in xs], [m or 0.0 for m in measured], 0.4, color="#444444")
        bars.set_label("measured peak allocated")
        ax_m.bar_label(bars, labels=[f"{m:.2f}" if m else "" for m in measured], fontsize=8)
    else:
        ax_m.text(0.5, 0.95, "no GPU: predicted only", transform=ax_m.transAxes, ha="center", va="top")
    ax_m.set_xticks(list(xs), names)
    ax_m.set_ylabel("GB (1e9 bytes)")
    ax_m.set_title("Peak memory: predicted components vs measured")
    ax_m.legend(fontsize=7)
    width = 0.25
    has_kernel = any(r["measured"].get("phase_kernel_ms") for r in rows)
    for i, phase in enumerate(("forward", "backward", "optimizer")):
        pos = [x + (i - 1) * width for x in xs]
        vals = [r["measured"]["phase_ms"].get(phase, 0.0) for r in rows]
        color = f"C{i}"
        if has_kernel:  # span, light; the GPU's kernel time inside it, solid
            ax_t.bar(pos, vals, width, color=color, alpha=0.35, label=f"{phase} (span)")
            busy = [r["measured"].get("phase_kernel_ms", {}).get(phase, 0.0) for r in rows]
            ax_t.bar(pos, busy, width * 0.6, color=color, label=f"{phase} (kernel time)")
        else:
            ax_t.bar(pos, vals, width, color=color, label=phase)
    ax_t.set_xticks(list(xs), names)
    ax_t.set_ylabel("ms per step (median)")
    ax_t.set_title("Phase times (profiler trace)")
    ax_t.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the rows (for the terminal and the docs)."""
    lines = [
        "| variant | trainable params | predicted peak GB | measured peak GB | predicted saved activations GB"
        " | measured saved activations GB | forward ms | backward ms | optimizer ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def num(v: float | None, spec: str = ".3g") -> str:
        return "—" if v is None else format(v, spec)

    def phase(m: dict, name: str) -> str:
        span, kernel = m["phase_ms"].get(name), m.get("phase_kernel_ms", {}).get(name)
        return num(span, ".1f") + ("" if kernel is None else f" ({kernel:.1f})")

    for r in rows:
        m, p = r["measured"], r["predicted"]
        lines.append(
            f"| {r['variant']} | {r['parameters']['trainable']:,} | {num(p['peak_allocated_gb'])} |"
            f" {num(m['peak_allocated_gb'])} | {num(p['activations_saved_gb'])} |"
            f" {num(m['saved_activations_gb'])} | {phase(m, 'forward')} | {phase(m, 'backward')} |"
            f" {phase(m, 'optimizer')} |"
        )
    if any(r["measured"].get("phase_kernel_ms") for r in rows):
        lines.append("")
        lines.append("Times: median span per step, in brackets the GPU's kernel time within it (CUDA).")
    return "\n".join(lines)

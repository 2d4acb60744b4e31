"""Predict a training run's peak GPU memory before running it: weights, gradients, optimizer state,
activations saved for backward, and the backward pass's working memory.

    python -m common.estimate --recipe 05_gradient_accumulation            # the rung's own defaults
    python -m common.estimate --recipe 01_baseline --batch-size 32 --json   # any recipe flag overrides
    python -m common.estimate --recipe 08_fsdp --devices 8                  # FSDP: per-GPU memory

Why simulate instead of a formula. Seed 004's arithmetic gets the static part exactly: weights x bytes,
gradients 1x the trainable parameters, Adam 2x, SGD 0, momentum 1x; with PEFT the weights are K+N, the
gradients N, Adam 2N. The activations are the hard part ("change the batch and look at the difference",
says the seed) and they are usually the largest. Here they are not guessed: one training step is run on
*fake* tensors (``FakeTensorMode``: shapes, dtypes and storages, no memory, no arithmetic), and every
storage the step creates is tracked from allocation to release. Tensors that autograd saves for backward
are recognised with ``saved_tensors_hooks`` and counted once per storage (views share it). Because the real
backward pass runs too (on fake tensors), the simulation also sees *when* things are freed: activations
drain block by block while gradients appear, and gradient accumulation keeps gradients across
micro-batches. The peak is the maximum of the live bytes over that timeline, as
``torch.cuda.max_memory_allocated`` measures it (each allocation rounded up to 512 bytes, like the CUDA
caching allocator does).

What the simulation models explicitly, because fake tensors on a CPU cannot show it:

* Attention kernel. On CUDA, ``scaled_dot_product_attention`` runs a fused kernel (flash for fp16/bf16,
  memory-efficient for fp32 or with a mask) that saves q, k, v, the output and a small log-sum-exp, never
  the (batch, heads, seq, seq) score matrix. Fake/meta tensors would take the math path, which saves the
  score matrix. ``attention="auto"`` routes SDPA to the fused kernel the target device runs (on a CPU:
  the CPU flash kernel, which torch picks for the ViT's training forward); ``"math"`` forces the math
  path (what CUDA falls back to when no fused kernel fits).
* Mixed precision. Fabric's ``16-mixed``/``bf16-mixed`` is ``torch.autocast``. CPU autocast casts a
  different set of ops than CUDA autocast (e.g. ``layer_norm`` and ``softmax`` run in fp16 on CPU, in fp32
  on CUDA), so for a CUDA target the CUDA policy for those ops is installed for the duration of the
  simulation. Autocast's cached fp16 copies of the weights are reported as their own component.
* Optimizer state exists from the first step on (Adam: 2 tensors per trainable parameter), so the
  simulated step is a steady-state step. Fused optimizers update in place; foreach Adam needs one
  temporary list as large as the trainable parameters.
* FSDP (``sharding="fsdp"``/``"fsdp2"`` over ``world_size`` ranks): parameters, gradients and optimizer
  state count 1/N; the units being all-gathered (the current and the prefetched one) and one unit's
  unsharded gradients count in full. ``cpu_offload=True`` moves parameters, gradients and optimizer state
  to host memory: they count 0 on the GPU.
* Rung-specific techniques: ``activation_offload`` (saved tensors in pinned host memory, as
  common/offload.py), ``optimizer_in_backward`` (each gradient freed in its hook), torchao's 8-bit AdamW
  state (``optimizer="adamw8bit"``), and activation checkpointing of named module classes.
* A fixed CUDA library workspace: cuBLAS's 32 MiB per (thread, stream) on Hopper, for the forward thread
  and autograd's backward thread, taken from the caching allocator at the first matrix product.

torch.compile: the simulation runs the *eager* graph. Inductor may save different tensors (it can recompute
cheap pointwise ops instead of saving them); the estimate records ``compile`` so a comparison says which
kind of run it is checked against. docs/memory_anatomy.md has the errors against the committed compiled
and eager runs (all within 3.6%).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

GB = 1e9
ALLOCATOR_ROUND = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes
# cuBLAS keeps a 32 MiB workspace per (thread, stream) on Hopper, taken from the caching allocator: one for
# the thread that runs the forward pass, one for autograd's device thread that runs the backward pass.
CUDA_WORKSPACE_BYTES = 2 * 32 * 2**20

# Component names, in table order. Each simulated storage belongs to exactly one of them.
COMPONENTS = (
    "parameters",
    "gathered_parameters",
    "weight_copies",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "inputs",
    "workspace",
)
COMPONENT_HELP = {
    "parameters": "model weights (trainable and frozen), in the run's parameter dtype",
    "gathered_parameters": "FSDP: full (all-gathered) weights of the units in use, unsharded gradients",
    "weight_copies": "low-precision copies of fp32 weights made by autocast, alive while saved",
    "gradients": ".grad of the trainable parameters",
    "optimizer_state": "Adam exp_avg + exp_avg_sq (2x trainable), SGD momentum (1x), none for SGD",
    "activations": "tensors saved by the forward pass for backward (one count per storage)",
    "temporaries": "working memory: gradients w.r.t. activations, recomputed blocks, kernel outputs",
    "inputs": "the micro-batch on the device",
    "workspace": "CUDA library workspace (cuBLAS) handed out by the caching allocator",
}
COMPONENT_COLORS = {
    "parameters": "darkgreen",
    "gathered_parameters": "yellowgreen",
    "weight_copies": "lightseagreen",
    "gradients": "mediumblue",
    "optimizer_state": "goldenrod",
    "activations": "red",
    "temporaries": "mediumpurple",
    "inputs": "black",
    "workspace": "grey",
}
OPTIMIZERS = ("adam", "adamw", "adamw8bit", "sgd", "sgd-momentum", "none")
OPTIMIZER_STATE_FACTOR = {"adam": 2, "adamw": 2, "adamw8bit": 2, "sgd": 0, "sgd-momentum": 1, "none": 0}
LOWBIT_BLOCK = 256  # torchao's 8-bit optimizer: one fp32 scale per block of 256 values
LOWBIT_MIN_NUMEL = 4096  # ...and smaller tensors keep full-precision state
OPTIMIZER_IMPLS = ("fused", "foreach", "for-loop")
ATTENTION_CHOICES = ("auto", "fused", "math")
SHARDING_CHOICES = ("none", "fsdp", "fsdp2")
CHECKPOINT_WRAPPERS = ("CheckpointedBlock", "CheckpointWrapper")  # modules that checkpoint their child
LOW_PRECISION = {
    "16-mixed": "float16",
    "bf16-mixed": "bfloat16",
    "16-true": "float16",
    "bf16-true": "bfloat16",
}


def _round(nbytes: int) -> int:
    return max(ALLOCATOR_ROUND, -(-nbytes // ALLOCATOR_ROUND) * ALLOCATOR_ROUND) if nbytes else 0


# ------------------------------------------------------------------------------------------------ plan
@dataclasses.dataclass
class Plan:
    """Everything besides the model that decides a run's memory. Recipes declare theirs as ``ESTIMATE``.

    ``checkpoint`` and ``shard_units`` name module classes (``"EncoderBlock"``): every module of that
    class is activation-checkpointed / is one FSDP unit (a model that checkpoints inside its own
    forward, like rung 10's, needs no ``checkpoint``: the simulation runs it). ``world_size`` only
    matters when sharding. ``activation_offload`` models common.offload.offload_activations (saved
    tensors of at least ``offload_min_bytes`` live in host memory); ``optimizer_in_backward`` models a
    per-parameter step in a post-accumulate-grad hook that frees each gradient at once (rung 12).
    """

    precision: str = "32-true"
    micro_batch_size: int = 1
    accumulation_steps: int = 1
    optimizer: str = "adam"
    optimizer_impl: str = "fused"
    checkpoint: tuple[str, ...] = ()
    sharding: str = "none"
    shard_units: tuple[str, ...] = ()
    world_size: int = 1
    cpu_offload: bool = False
    attention: str = "auto"
    device: str = "cuda"
    compile: bool = False
    prefetch_units: int = 2
    activation_offload: bool = False
    offload_min_bytes: int = 1 << 16
    optimizer_in_backward: bool = False

    def __post_init__(self) -> None:
        if self.precision == "32":
            self.precision = "32-true"
        if self.precision not in ("32-true", "64-true", *LOW_PRECISION):
            raise ValueError(f"precision {self.precision!r} is not supported by the estimator")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"optimizer_impl {self.optimizer_impl!r}: expected one of {OPTIMIZER_IMPLS}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention {self.attention!r}: expected one of {ATTENTION_CHOICES}")
        if self.sharding not in SHARDING_CHOICES:
            raise ValueError(f"sharding {self.sharding!r}: expected one of {SHARDING_CHOICES}")
        if self.cpu_offload and self.sharding == "none":
            raise ValueError("cpu_offload is modelled for FSDP only (sharding='fsdp')")
        if self.optimizer_in_backward and self.accumulation_steps > 1:
            raise ValueError("optimizer_in_backward frees every gradient at once: no accumulation")
        self.checkpoint = tuple(self.checkpoint)
        self.shard_units = tuple(self.shard_units)

    @property
    def attention_kernel(self) -> str:
        """'fused' or 'math': what scaled_dot_product_attention will run (both CUDA and CPU have fused
        kernels for the ViT's attention; 'math' is the meta device's path and the fallback)."""
        return "fused" if self.attention == "auto" else self.attention


def plan_from_args(args: Any, **recipe_plan: Any) -> Plan:
    """A Plan from a recipe's parsed flags (precision, micro-batch, accumulation, devices, compile)
    and the recipe's ``ESTIMATE`` declaration (optimizer, checkpointing, sharding, offload)."""
    world = int(getattr(args, "devices", 1) or 1) * int(getattr(args, "num_nodes", 1) or 1)
    accelerator = getattr(args, "accelerator", "cuda")
    fields = dict(
        precision=args.precision,
        micro_batch_size=getattr(args, "micro_batch_size", None)
        or args.batch_size // max(1, args.accumulation_steps),
        accumulation_steps=args.accumulation_steps,
        world_size=world,
        device="cpu" if accelerator == "cpu" else "cuda",
        compile=bool(getattr(args, "compile", False)),
    )
    fields.update(recipe_plan)
    if fields.get("sharding", "none") == "none":
        fields["world_size"] = 1  # data parallel without sharding replicates: per-GPU memory as for one
    return Plan(**fields)


# -------------------------------------------------------------------------------------------- estimate
@dataclasses.dataclass
class Estimate:
    """The prediction: components at the predicted peak (GB), the peak, and what it assumed."""

    peak_gb: float | None
    components_gb: dict[str, float]
    peak_phase: str
    static_gb: dict[str, float]
    activations_saved_gb: float | None
    parameters: dict[str, int]
    plan: Plan
    model: str
    seconds: float
    kernels: list[str] = dataclasses.field(default_factory=list)
    activations_host_gb: float = 0.0
    # the storages behind activations_saved_gb, unrounded: SavedTensorCounter.nbytes of a real forward pass
    activations_saved_bytes: int | None = None
    timeline: list[tuple[str, dict[str, float]]] = dataclasses.field(default_factory=list, repr=False)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``estimate`` key of the results JSON (documented in common/metrics.py)."""
        p = self.plan

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {
            "peak_allocated_gb": r(self.peak_gb),
            "components_gb": {k: r(v) for k, v in self.components_gb.items()},
            "peak_phase": self.peak_phase,
            "static_gb": {k: r(v) for k, v in self.static_gb.items()},
            "activations_saved_gb": r(self.activations_saved_gb),
            "activations_host_gb": r(self.activations_host_gb),
            "parameters": self.parameters,
            "assumptions": {
                "method": "one training step on fake tensors (eager graph), storages tracked",
                "device": p.device,
                "attention_kernel": p.attention_kernel,
                "compile": p.compile,
                "compile_modelled": False,
                "precision": p.precision,
                "micro_batch_size": p.micro_batch_size,
                "accumulation_steps": p.accumulation_steps,
                "optimizer": p.optimizer,
                "optimizer_impl": p.optimizer_impl,
                "checkpoint": list(p.checkpoint),
                "sharding": p.sharding,
                "shard_units": list(p.shard_units),
                "world_size": p.world_size,
                "cpu_offload": p.cpu_offload,
                "activation_offload": p.activation_offload,
                "optimizer_in_backward": p.optimizer_in_backward,
                "workspace_gb": (CUDA_WORKSPACE_BYTES / GB) if p.device == "cuda" else 0.0,
            },
            "kernels": self.kernels,
            "model": self.model,
            "seconds": round(self.seconds, 2),
            "error": self.error,
        }

    def table(self) -> str:
        """A component table for the terminal."""
        if self.error:
            return f"estimate failed: {self.error}"
        p = self.plan
        lines = [
            f"Memory estimate: {self.model} | precision {p.precision} | micro-batch {p.micro_batch_size}"
            f" x {p.accumulation_steps} | optimizer {p.optimizer} ({p.optimizer_impl})"
            + (f" | checkpoint {','.join(p.checkpoint)}" if p.checkpoint else "")
            + (f" | {p.sharding} over {p.world_size}" if p.sharding != "none" else "")
            + (" + cpu offload" if p.cpu_offload else ""),
            f"  device {p.device}, attention kernel {p.attention_kernel}, "
            f"compile {'on (eager graph traced)' if p.compile else 'off'}",
            "",
            f"  {'component':<22}{'GB at peak':>11}   what",
        ]
        for name in COMPONENTS:
            value = self.components_gb.get(name, 0.0)
            if value or name in ("parameters", "gradients", "optimizer_state", "activations"):
                lines.append(f"  {name:<22}{value:>11.3f}   {COMPONENT_HELP[name]}")
        lines.append(f"  {'-' * 22}{'-' * 11}")
        lines.append(f"  {'predicted peak':<22}{self.peak_gb:>11.3f}   during: {self.peak_phase}")
        lines.append("")
        s = self.static_gb
        lines.append(
            "  Static (seed 004's arithmetic, per GPU): "
            + ", ".join(f"{k} {v:.3f}" for k, v in s.items())
            + f" GB | trainable {self.parameters['trainable']:,} of {self.parameters['total']:,} parameters"
        )
        if self.activations_saved_gb is not None:
            lines.append(
                f"  Activations saved by one micro-batch's forward pass: {self.activations_saved_gb:.3f} GB"
                + (
                    f" ({self.activations_host_gb:.3f} GB of it offloaded to host memory)"
                    if p.activation_offload
                    else ""
                )
            )
        lines.append(f"  ({self.seconds:.1f} s on CPU, no GPU memory used)")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------- storage tracking
class _Record:
    __slots__ = ("nbytes", "category")

    def __init__(self, nbytes: int, category: str) -> None:
        self.nbytes = nbytes
        self.category = category


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward, once per storage, leaving out ``exclude`` (the
    parameters and buffers: they exist anyway).

    The same hooks serve the simulation (fake tensors) and a real run, which is how the tests check that
    the simulated activations are the bytes a real forward pass saves. Storages are held weakly: a storage
    freed before the count is read (a saved tensor released early) no longer counts. So read the count
    while the forward's output (hence the graph) is alive, as the simulation does: dropping it frees what
    only the graph held (e.g. the loss's 4-byte ``total_weight``).

        with SavedTensorCounter(model.parameters()) as saved:
            loss = model(x).sum()
        saved.nbytes  # loss still alive
    """

    def __init__(self, exclude=()) -> None:
        self._exclude = {id(t.untyped_storage()): t for t in exclude}  # values keep the ids valid
        self._seen = WeakIdKeyDictionary()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if id(st) not in self._exclude and st not in self._seen:
            self._seen[st] = st.nbytes()
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def add(self, t: torch.Tensor) -> None:
        """Count ``t`` as saved although no autograd node packed it (a checkpointed block's input)."""
        self._pack(t)

    @property
    def nbytes(self) -> int:
        return sum(self._seen.values())

    @property
    def rounded_nbytes(self) -> int:
        """As the CUDA caching allocator counts them (blocks of 512 bytes)."""
        return sum(_round(n) for n in self._seen.values())

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Tracker(TorchDispatchMode):
    """Counts the live storages created by ops under it, by component, and keeps the weighted peak.

    A storage counts once however many views of it exist, from the op that created it until its Python
    object dies (``weakref.finalize``; storages keep one Python object for their lifetime). ``scales``
    weighs components: FSDP counts sharded state at 1/N, offloaded state at 0.
    """

    def __init__(self, scales: dict[str, float] | None = None) -> None:
        super().__init__()
        self.records = WeakIdKeyDictionary()
        self.totals: dict[str, int] = defaultdict(int)
        self.scales = scales or {}
        self.phase = "set-up"
        self.peak = 0.0
        self.peak_totals: dict[str, float] = {}
        self.peak_phase = ""
        self.record_timeline = False  # switched on for the stretch of the step that the timeline shows
        self.timeline: list[tuple[str, dict[str, float]]] = []
        self.host_peak = 0  # most bytes in host memory at once (offloaded activations)
        self.new_category = "temporaries"

    @contextlib.contextmanager
    def creating(self, category: str) -> Iterator[None]:
        """Storages created inside belong to ``category`` from the start (weights, optimizer state)."""
        previous, self.new_category = self.new_category, category
        try:
            yield
        finally:
            self.new_category = previous

    def weighted(self) -> float:
        return sum(self.scales.get(c, 1.0) * v for c, v in self.totals.items())

    def _changed(self) -> None:
        total = self.weighted()
        self.host_peak = max(self.host_peak, self.totals["host"])
        if self.record_timeline:
            self.timeline.append(
                (self.phase, {c: self.scales.get(c, 1.0) * v / GB for c, v in self.totals.items() if v})
            )
        if total > self.peak:
            self.peak = total
            self.peak_totals = {c: self.scales.get(c, 1.0) * v for c, v in self.totals.items()}
            self.peak_phase = self.phase

    def _free(self, rec: _Record) -> None:
        self.totals[rec.category] -= rec.nbytes
        self._changed()

    def record(self, t: Any, category: str = "temporaries") -> _Record | None:
        """Start counting ``t``'s storage (no-op if it is counted already); return its record."""
        if not isinstance(t, torch.Tensor):
            return None
        st = t.untyped_storage()
        rec = self.records.get(st)
        if rec is None:
            rec = _Record(_round(st.nbytes()), category)
            self.records[st] = rec
            self.totals[category] += rec.nbytes
            weakref.finalize(st, self._free, rec)
            self._changed()
        return rec

    def retag(self, t: Any, category: str, only_from: tuple[str, ...] | None = None) -> None:
        """Move ``t``'s storage to another component (a temporary that autograd saves, a gradient)."""
        rec = self.record(t, category)
        if rec is None or rec.category == category:
            return
        if only_from is not None and rec.category not in only_from:
            return
        self.totals[rec.category] -= rec.nbytes
        self.totals[category] += rec.nbytes
        rec.category = category
        self._changed()

    def category_of(self, t: torch.Tensor) -> str | None:
        rec = self.records.get(t.untyped_storage())
        return rec.category if rec is not None else None

    def add_constant(self, category: str, nbytes: int) -> None:
        """Memory the simulation does not create as tensors (workspace, gathered FSDP units)."""
        self.totals[category] += nbytes
        self._changed()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = self.new_category
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            if self.category_of(args[0]) == "parameters":
                category = "weight_copies"  # autocast's low-precision copy of a weight
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.record(t, category)
        return out


# ------------------------------------------------------------------------------- modelled behaviours
@contextlib.contextmanager
def _cuda_autocast_policy(enabled: bool) -> Iterator[None]:
    """Give CPU autocast CUDA autocast's choices for the ops where the two differ.

    CUDA runs these in fp32 under autocast; CPU autocast runs them in low precision. The kernels are
    registered for the AutocastCPU key only while the simulation runs and removed afterwards.
    """
    if not enabled:
        yield
        return
    from torch._C import DispatchKey, DispatchKeySet
    from torch.utils._pytree import tree_map

    def fp32(op):
        def kernel(*args, **kwargs):
            def up(t):
                if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16):
                    return t.float()
                return t

            args, kwargs = tree_map(up, (args, kwargs))
            with torch._C._ExcludeDispatchKeyGuard(DispatchKeySet(DispatchKey.AutocastCPU)):
                return op(*args, **kwargs)

        return kernel

    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - a temporary override, removed below
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, overload in (
                ("layer_norm", "default"),
                ("native_layer_norm", "default"),
                ("group_norm", "default"),
                ("softmax", "int"),
                ("log_softmax", "int"),
                ("nll_loss", "default"),
                ("mse_loss", "default"),
            ):
                op = getattr(getattr(torch.ops.aten, name), overload)
                lib.impl(name if overload == "default" else f"{name}.{overload}", fp32(op), "AutocastCPU")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def _attention_kernel(kind: str, device: str, used: set[str]) -> Iterator[None]:
    """Make ``F.scaled_dot_product_attention`` run the kernel the target device would run.

    'fused' on CUDA mimics its dispatcher: flash attention for fp16/bf16 without a mask, the
    memory-efficient kernel otherwise; on a CPU the CPU flash kernel. All of them save q, k, v, the
    output and a log-sum-exp, no score matrix. 'math' runs the reference implementation, which saves the
    attention weights (batch x heads x seq x seq): what the meta device runs, and what CUDA falls back to
    when no fused kernel fits. ``used`` collects the kernels that ran.
    """
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if torch.is_autocast_enabled("cpu"):  # autocast lists SDPA as a low-precision op
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(dtype) for t in (query, key, value))
        if kind == "math" or kw.get("enable_gqa"):
            used.add("math")
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale
            )[0]
        if device == "cpu":
            used.add("flash (CPU)")
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]
        head_dim = query.shape[-1]
        if (
            attn_mask is None
            and query.dtype in (torch.float16, torch.bfloat16)
            and head_dim % 8 == 0
            and head_dim <= 256
        ):
            used.add("flash")
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        used.add("efficient")
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
        )[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _checkpointed(model, class_names: tuple[str, ...], keep: Callable[[torch.Tensor], None]) -> Iterator[int]:
    """Wrap the forward of every module whose class is named in ``class_names`` in non-reentrant
    activation checkpointing (what Fabric's ``activation_checkpointing_policy`` and ``checkpoint_wrapper``
    do), for the duration of the simulation. ``keep`` is told about each block input: checkpointing
    keeps it for the recompute, so it counts as saved."""
    from torch.utils.checkpoint import checkpoint

    wrapped = []
    already = {  # blocks the model checkpoints itself (rung 10's CheckpointedBlock, checkpoint_wrapper)
        id(child)
        for module in model.modules()
        if type(module).__name__ in CHECKPOINT_WRAPPERS
        for child in module.children()
    }
    for module in model.modules():
        if class_names and type(module).__name__ in class_names and id(module) not in already:
            original = module.forward

            def forward(*args, _original=original, **kwargs):
                for a in args:
                    if isinstance(a, torch.Tensor):
                        keep(a)
                return checkpoint(_original, *args, use_reentrant=False, **kwargs)

            module.forward = forward
            wrapped.append(module)
    try:
        yield len(wrapped)
    finally:
        for module in wrapped:
            del module.forward  # back to the class's forward


class _Precision:
    """What Fabric's precision plugin does to the module, its inputs and its forward (see
    lightning.fabric.plugins.precision: HalfPrecision, MixedPrecision), replayed on fake tensors."""

    def __init__(self, precision: str, cuda_policy: bool) -> None:
        self.cuda_policy = cuda_policy
        low = getattr(torch, LOW_PRECISION[precision]) if precision in LOW_PRECISION else None
        self.mixed = precision.endswith("-mixed")
        self.low = low
        if precision == "64-true":
            self.param_dtype = torch.float64
        elif low is not None and not self.mixed:
            self.param_dtype = low
        else:
            self.param_dtype = torch.float32
        self.input_dtype = low if low is not None else self.param_dtype

    def convert(self, data):
        from torch.utils._pytree import tree_map

        def cast(t):
            return t.to(self.input_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return tree_map(cast, data)

    def convert_output(self, data):
        from torch.utils._pytree import tree_map

        def cast(t):
            return t.to(torch.float32) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return tree_map(cast, data) if self.input_dtype != torch.float32 else data

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:

        if self.mixed:
            with torch.autocast("cpu", dtype=self.low), _cuda_autocast_policy(self.cuda_policy):
                yield
        elif self.input_dtype != torch.float32:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(self.input_dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(previous)
        else:
            yield


class _Wrapped:
    """Calls the model as Fabric's ``_FabricModule`` does: convert inputs, forward in the precision
    context, convert outputs."""

    def __init__(self, model, precision: _Precision) -> None:
        self.model = model
        self.precision = precision

    def __getattr__(self, name: str):  # batch functions may read model attributes (image_size)
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):

        args, kwargs = self.precision.convert((args, kwargs))
        with self.precision.forward_context():
            out = self.model(*args, **kwargs)
        return self.precision.convert_output(out)


# ---------------------------------------------------------------------------------------- the step
def image_batch(model: Any, micro_batch_size: int) -> tuple[Callable[[], Any], Callable]:
    """The ladder's batch: CIFAR-shaped uint8 images and int64 labels, turned into a loss by
    common.loop.image_classification (resize and normalise on the device, then cross-entropy)."""
    from common import loop

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.empty(micro_batch_size, 32, 32, 3, dtype=torch.uint8)
        labels = torch.zeros(micro_batch_size, dtype=torch.long)
        return images, labels

    return make, loop.image_classification(getattr(model, "image_size", 224))


def _unit_bytes(model: Any, class_names: tuple[str, ...], dtype_bytes: int) -> tuple[int, int]:
    """(largest FSDP unit, the root's remainder) in bytes of full, unsharded parameters."""
    units = [m for m in model.modules() if type(m).__name__ in class_names]
    in_units = {id(p) for u in units for p in u.parameters()}
    largest = max((sum(p.numel() for p in u.parameters()) for u in units), default=0)
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    return largest * dtype_bytes, root * dtype_bytes


def _optimizer_state(p: torch.Tensor, plan: Plan) -> list[torch.Tensor]:
    """The state tensors the optimizer keeps for parameter ``p`` from its first step on."""
    if plan.optimizer == "adamw8bit" and p.numel() >= LOWBIT_MIN_NUMEL and p.numel() % LOWBIT_BLOCK == 0:
        state = []  # torchao OptimState8bit: uint8 codes, one fp32 scale per block, a 256-entry qmap
        for _ in range(2):
            state.append(torch.empty(p.shape, dtype=torch.uint8))
            state.append(torch.empty(p.numel() // LOWBIT_BLOCK, dtype=torch.float32))
            state.append(torch.empty(256, dtype=torch.float32))
        return state
    state = [torch.zeros_like(p) for _ in range(OPTIMIZER_STATE_FACTOR[plan.optimizer])]
    if plan.optimizer in ("adam", "adamw") and plan.optimizer_impl == "fused":
        state.append(torch.zeros((), dtype=torch.float32))  # the step count lives on the device
    return state


class _SimulatedSaves(SavedTensorCounter):
    """The simulation's saved-tensor hooks: count every saved storage (as a real run's counter would),
    mark it as an activation, and with ``activation_offload`` move it to host memory as
    common.offload.offload_activations does: the device copy is no longer referenced by the graph (it
    is freed when the forward pass drops it) and backward copies it back just before it is needed."""

    def __init__(self, exclude: list[torch.Tensor], tracker: _Tracker, plan: Plan) -> None:
        super().__init__(exclude)
        self.tracker = tracker
        self.offload = plan.activation_offload
        self.min_bytes = plan.offload_min_bytes

    def _pack(self, t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        if id(st) in self._exclude:
            return t
        if self.offload and t.numel() * t.element_size() >= self.min_bytes:
            with self.tracker.creating("host"):  # counts 0 on the device
                host = torch.empty(t.shape, dtype=t.dtype)  # one host copy per saved tensor, as offload.py
            self._seen[host.untyped_storage()] = host.untyped_storage().nbytes()
            return ("offloaded", host)
        super()._pack(t)
        self.tracker.retag(t, "activations", only_from=("temporaries",))
        return t

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple) and packed and packed[0] == "offloaded":
            return packed[1].clone()  # back on the device: a temporary of the backward pass
        return packed


@contextlib.contextmanager
def _neutral_defaults() -> Iterator[None]:
    """CPU as the default device, fp32 as the default dtype: a recipe may call the estimator inside
    ``fabric.init_module()``, which makes CUDA and bf16 the defaults for new tensors. The fake tensors
    of the simulation must be CPU tensors (autograd's CUDA thread would need a real GPU)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _fresh_normalisation_cache() -> Iterator[None]:
    """common.data caches its mean/std tensors per device; constants made under the fake mode must not
    outlive it (a later real CPU run would get a fake tensor)."""
    from common import data

    data._normalisation.cache_clear()
    try:
        yield
    finally:
        data._normalisation.cache_clear()


def simulate(
    model: Any,
    plan: Plan,
    *,
    make_batch: Callable[[], Any] | None = None,
    batch_fn: Callable | None = None,
    record_timeline: bool = False,
    model_name: str | None = None,
) -> Estimate:
    """Run one steady-state optimizer step of ``model`` under ``plan`` on fake tensors; return the estimate.

    ``model`` may live anywhere (CPU, GPU, meta): only its structure and parameter shapes are read, and
    ``requires_grad`` says which parameters train (so frozen backbones and LoRA are just models whose
    flags are set). Its parameters are swapped for fake ones during the step and restored afterwards.
    ``make_batch()`` builds a micro-batch (called under the fake mode) and ``batch_fn(model, batch)``
    returns ``(loss, ...)``, as in common.loop; both default to the ladder's image classification.

    The step: optimizer state exists (steady state); micro-batch 1 runs forward and backward with no
    gradients allocated (``zero_grad(set_to_none=True)`` freed them); with accumulation a second
    micro-batch runs with the gradients kept; then the optimizer step. Later micro-batches repeat the
    second, so two are enough to find the peak.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    start = time.perf_counter()
    if make_batch is None or batch_fn is None:
        default_make, default_fn = image_batch(model, plan.micro_batch_size)
        make_batch = make_batch or default_make
        batch_fn = batch_fn or default_fn

    precision = _Precision(plan.precision, cuda_policy=plan.device == "cuda")
    pbytes = torch.empty((), dtype=precision.param_dtype, device="meta").element_size()
    named_params = dict(model.named_parameters())
    trainable = [n for n, p in named_params.items() if p.requires_grad]
    n_total = sum(p.numel() for p in named_params.values())
    n_train = sum(named_params[n].numel() for n in trainable)
    scales: dict[str, float] = {"host": 0.0}  # offloaded activations live in host memory
    if plan.sharding != "none":
        shard = 0.0 if plan.cpu_offload else 1.0 / plan.world_size
        scales.update({"parameters": shard, "gradients": shard, "optimizer_state": shard})
    tracker = _Tracker(scales)  # the timeline is recorded from the first forward to zero_grad
    kernels: set[str] = set()
    saved_bytes = saved_rounded = None

    with contextlib.ExitStack() as stack:
        stack.enter_context(_neutral_defaults())
        stack.enter_context(_fresh_normalisation_cache())
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(tracker)
        stack.enter_context(_attention_kernel(plan.attention_kernel, plan.device, kernels))
        stack.enter_context(torch.compiler.set_stance("force_eager"))  # compiled blocks run eagerly here

        # Weights and buffers, in the dtype Fabric gives them.
        fake_state: dict[str, torch.Tensor] = {}
        with tracker.creating("parameters"):
            for n, p in [*named_params.items(), *model.named_buffers()]:
                dtype = precision.param_dtype if p.is_floating_point() else p.dtype
                fake_state[n] = torch.empty(p.shape, dtype=dtype, requires_grad=bool(p.requires_grad))

        def grad_ready(p: torch.Tensor) -> None:
            tracker.retag(p.grad, "gradients")
            if plan.optimizer_in_backward:  # stepped by the hook, then freed at once
                p.grad = None

        for n in trainable:
            fake_state[n].register_post_accumulate_grad_hook(grad_ready)
        if plan.sharding != "none":
            unit, root = _unit_bytes(model, plan.shard_units, pbytes)
            # in use at once: the current unit, the prefetched one, the root; one unit's unsharded grads
            in_use = plan.prefetch_units * unit + root + (unit if n_train else 0)
            tracker.add_constant("gathered_parameters", in_use)
        if plan.device == "cuda":
            tracker.add_constant("workspace", CUDA_WORKSPACE_BYTES)

        tracker.phase = "optimizer state"  # as it is from the first optimizer step on
        with tracker.creating("optimizer_state"):
            state = [t for n in trainable for t in _optimizer_state(fake_state[n], plan)]
        state_bytes = sum(t.untyped_storage().nbytes() for t in state if t.dim() > 0)  # no step counters

        params_and_buffers = list(fake_state.values())
        counter = _SimulatedSaves(params_and_buffers, tracker, plan)
        # The fake weights stand in for the module's own for the whole step: checkpointed blocks
        # recompute in backward, after the forward call has returned.
        stack.enter_context(_reparametrize_module(model, fake_state, tie_weights=True))
        stack.enter_context(_checkpointed(model, plan.checkpoint, counter.add))
        wrapped = _Wrapped(model, precision)
        k = plan.accumulation_steps
        tracker.record_timeline = record_timeline
        for micro in range(min(k, 2)):
            label = "first micro-batch" if micro == 0 else "a later micro-batch (gradients kept)"
            tracker.phase = f"forward, {label}"
            batch = make_batch()
            for t in tree_leaves(batch):
                tracker.retag(t, "inputs")
            with counter:
                loss = batch_fn(wrapped, batch)[0]
            if micro == 0:  # read while the graph is alive, as a real run's counter is read
                saved_bytes, saved_rounded = counter.nbytes, counter.rounded_nbytes
            tracker.phase = f"backward, {label}"
            (loss / k).backward()
            del loss, batch

        tracker.phase = "optimizer step"
        transient = 0  # fused kernels and SGD update in place
        if plan.optimizer in ("adam", "adamw") and plan.optimizer_impl == "foreach":
            transient = n_train * pbytes  # torch._foreach_sqrt(exp_avg_sq): a list as large as the grads
        elif plan.optimizer in ("adam", "adamw") and plan.optimizer_impl == "for-loop":
            transient = max((named_params[n].numel() for n in trainable), default=0) * pbytes
        elif plan.optimizer == "adamw8bit":  # per tensor: the two moments dequantised + the update, fp32
            transient = 3 * 4 * max((named_params[n].numel() for n in trainable), default=0)
        if plan.optimizer_in_backward:
            transient = 0  # already done, parameter by parameter, inside backward
        transient = int(transient * scales.get("optimizer_state", 1.0))
        tracker.add_constant("temporaries", transient)
        tracker.add_constant("temporaries", -transient)
        tracker.phase = "zero_grad(set_to_none=True)"
        for t in fake_state.values():
            t.grad = None
        tracker.record_timeline = False
        del state, fake_state, params_and_buffers, wrapped, counter

    shard = scales.get("parameters", 1.0)
    static = {  # seed 004's arithmetic, exactly
        "weights": n_total * pbytes * shard / GB,
        "gradients": n_train * pbytes * shard / GB,
        "optimizer_state": state_bytes * shard / GB,
    }
    return Estimate(
        peak_gb=tracker.peak / GB,
        components_gb={c: tracker.peak_totals.get(c, 0.0) / GB for c in COMPONENTS},
        activations_host_gb=tracker.host_peak / GB,
        peak_phase=tracker.peak_phase,
        static_gb=static,
        activations_saved_gb=None if saved_rounded is None else saved_rounded / GB,
        activations_saved_bytes=saved_bytes,
        parameters={"total": n_total, "trainable": n_train},
        plan=plan,
        model=model_name or type(model).__name__,
        seconds=time.perf_counter() - start,
        kernels=sorted(kernels),
        timeline=tracker.timeline,
    )


def failed(plan: Plan | None, model_name: str, error: str) -> Estimate:
    """An estimate that could not be made: recorded with its reason; the run goes on."""
    return Estimate(
        peak_gb=None,
        components_gb={},
        peak_phase="",
        static_gb={},
        activations_saved_gb=None,
        parameters={"total": 0, "trainable": 0},
        plan=plan or Plan(),
        model=model_name,
        seconds=0.0,
        error=error,
    )


def for_run(model: Any, args: Any, **recipe_plan: Any) -> Estimate:
    """The estimate a recipe records next to its measurement: ``log.estimate = estimate.for_run(model,
    args, **ESTIMATE)``, called after the model is built and before ``fabric.setup``.

    ``args`` gives precision, batch, accumulation, devices and compile; ``recipe_plan`` (the recipe's
    ``ESTIMATE``) gives the optimizer, checkpointing, sharding and offload. An estimate that fails is
    recorded with its error and never stops the run (it is a prediction, not part of training).
    """
    name = getattr(args, "model", None) or type(model).__name__
    plan = None
    try:
        plan = plan_from_args(args, **recipe_plan)
        est = simulate(model, plan, model_name=name)
    except Exception as e:  # noqa: BLE001 - a failed prediction must not cost the measurement
        est = failed(plan, name, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    from common.net import note

    if est.error:
        note(f"[estimate] could not estimate memory: {est.error}")
    else:
        note(
            f"[estimate] predicted peak {est.peak_gb:.3g} GB per device ({est.peak_phase}; "
            f"{est.plan.attention_kernel} attention, {est.seconds:.1f} s)"
        )
    return est


# ----------------------------------------------------------------------------------------------- plots
def plot_timeline(est: Estimate, path: str | os.PathLike, title: str | None = None) -> None:
    """The simulated step as a stacked area per component (x: allocation events, not time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not est.timeline:
        raise ValueError("the estimate has no timeline: simulate(..., record_timeline=True)")
    names = [c for c in COMPONENTS if any(t[1].get(c) for t in est.timeline)]
    xs = range(len(est.timeline))
    ys = [[t[1].get(c, 0.0) for t in est.timeline] for c in names]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.stackplot(xs, ys, labels=names, colors=[COMPONENT_COLORS[c] for c in names], alpha=0.85)
    # phase boundaries
    last = None
    for i, (phase, _) in enumerate(est.timeline):
        if phase != last:
            ax.axvline(i, color="black", lw=0.5, alpha=0.4)
            ax.text(i, ax.get_ylim()[1] * 0.98, " " + phase, rotation=90, va="top", fontsize=7, alpha=0.7)
            last = phase
    ax.axhline(est.peak_gb, color="black", ls="--", lw=0.8)
    ax.set_xlabel("allocation / release events of one simulated training step")
    ax.set_ylabel("GB (1e9 bytes)")
    ax.set_title(title or f"Predicted memory timeline: {est.model}, peak {est.peak_gb:.2f} GB")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- CLI
REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class RecipeInfo:
    """What the estimator needs from a recipe file: its name, flag defaults and ESTIMATE declaration."""

    name: str
    description: str
    defaults: dict[str, Any]
    estimate: dict[str, Any]


def _literal(node: ast.AST) -> Any:
    """``dict(a=1, ...)`` or ``{...}`` or a constant, evaluated without running the file."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return {kw.arg: _literal(kw.value) for kw in node.keywords}
    return ast.literal_eval(node)


def read_recipe(name: str) -> RecipeInfo:
    """Read ``recipes/<name>.py`` (a unique prefix such as ``05`` is enough) without importing it.

    The recipe's ``RECIPE``, ``DEFAULTS`` and ``ESTIMATE`` are plain literals; parsing them keeps
    ``python -m common.estimate`` free of Lightning's import time (the estimate needs torch only).
    """
    folder = REPO / "recipes"
    matches = sorted(folder.glob(f"{name}*.py"))
    exact = [m for m in matches if m.stem == name]
    if exact:
        matches = exact
    if len(matches) != 1:
        found = ", ".join(m.stem for m in matches) or "none"
        raise FileNotFoundError(f"recipe {name!r}: expected one match in {folder}, found {found}")
    tree = ast.parse(matches[0].read_text())
    values: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("RECIPE", "DEFAULTS", "ESTIMATE"):
                values[node.targets[0].id] = _literal(node.value)
    return RecipeInfo(
        name=values.get("RECIPE", matches[0].stem),
        description=(ast.get_docstring(tree) or "").splitlines()[0] if ast.get_docstring(tree) else "",
        defaults=values.get("DEFAULTS", {}),
        estimate=values.get("ESTIMATE", {}),
    )


@functools.cache
def meta_model(name: str, num_classes: int = 10) -> Any:
    """The model built on the meta device: shapes only, no memory, no initialisation cost."""
    from common import models

    with torch.device("meta"):
        return models.build_model(name, None, num_classes=num_classes)


def check_results(dirs: list[str]) -> list[dict[str, Any]]:
    """Compare every results JSON in ``dirs`` with its prediction: the one the recipe recorded
    (``estimate``), or, for runs made before recipes recorded one, a prediction from the recorded
    config. Only runs measured on CUDA with status ok are compared, and only recipes that declare an
    ``ESTIMATE`` (the ViT rungs; the Hugging Face bonus models are not wired)."""
    from common.metrics import SCHEMA_VERSION, estimate_error_pct

    rows = []
    for d in dirs:
        for path in sorted(Path(d).glob("*.json")):
            try:
                result = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(result, dict) or result.get("schema_version") != SCHEMA_VERSION:
                continue
            if result.get("status") != "ok" or (result.get("memory") or {}).get("kind") != "cuda":
                continue
            recipe = read_recipe(result["recipe"])
            if not recipe.estimate:
                continue
            config = result.get("config") or {}
            recorded = result.get("estimate") or {}
            if recorded.get("peak_allocated_gb") is None:
                args = argparse.Namespace(**{**config, "accelerator": "cuda"})
                plan = plan_from_args(args, **recipe.estimate)
                model = meta_model(config.get("model", "vit_l_16"))
                recorded = simulate(model, plan, model_name=config.get("model")).to_dict()
            rows.append(
                {
                    "file": str(path),
                    "recipe": result["recipe"],
                    "gpu": (result.get("provenance") or {}).get("gpu_name"),
                    "world_size": (result.get("provenance") or {}).get("world_size", 1),
                    "compile": bool(config.get("compile")),
                    "predicted_gb": recorded["peak_allocated_gb"],
                    "measured_gb": result["memory"]["peak_allocated_gb"],
                    "error_pct": estimate_error_pct({**result, "estimate": recorded}),
                    "peak_phase": recorded.get("peak_phase"),
                    "activations_saved_gb": recorded.get("activations_saved_gb"),
                }
            )
    return rows


def render_check(rows: list[dict[str, Any]]) -> str:
    """Predicted vs measured as a markdown table."""
    lines = [
        "| run | GPU | compile | predicted GB | measured GB | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        gpu = (r["gpu"] or "?").replace("NVIDIA ", "")
        if r["world_size"] and r["world_size"] > 1:
            gpu = f"{r['world_size']}× {gpu} (per GPU)"
        lines.append(
            f"| `{r['file']}` | {gpu} | {'on' if r['compile'] else 'off'} | {r['predicted_gb']:.3f} |"
            f" {r['measured_gb']:.3f} | {r['error_pct']:+.1f}% |"
        )
    return "\n".join(lines)


def plot_check(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Predicted vs measured peak per run (bars) with the error on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{Path(r['file']).parent.name}/{r['recipe']} ({'compiled' if r['compile'] else 'eager'})"
        for r in rows
    ]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(rows) + 3), 5))
    ax.bar([x - 0.2 for x in xs], [r["measured_gb"] for r in rows], 0.4, color="#08519c", label="measured")
    bars = ax.bar(
        [x + 0.2 for x in xs], [r["predicted_gb"] for r in rows], 0.4, color="#fc9272", label="predicted"
    )
    ax.bar_label(bars, labels=[f"{r['error_pct']:+.1f}%" for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), labels, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("peak allocated, GB (log scale)")
    ax.set_title("common.estimate: predicted vs measured peak allocated (label: error)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, Any], str]:
    from common import cli

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe")
    known, _ = pre.parse_known_args(argv)
    defaults: dict[str, Any] = {}
    plan_fields: dict[str, Any] = {}
    label = "custom"
    if known.recipe:
        try:
            recipe = read_recipe(known.recipe)
        except (FileNotFoundError, ValueError, SyntaxError) as e:
            cli.fail(str(e))
        defaults = dict(recipe.defaults)
        plan_fields = dict(recipe.estimate)
        label = recipe.name
    parser = cli.build_parser(__doc__.splitlines()[0], defaults)
    g = parser.add_argument_group("estimate")
    g.add_argument("--recipe", help="take the defaults and the ESTIMATE declaration of recipes/<NAME>.py")
    g.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto", help="attention kernel to model")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help="override the recipe's optimizer")
    g.add_argument("--checkpoint", help="comma-separated module classes to checkpoint (e.g. EncoderBlock)")
    g.add_argument("--json", action="store_true", help="print the estimate as JSON")
    g.add_argument(
        "--plot",
        metavar="PNG",
        help="write the simulated timeline (with --check: predicted vs measured) as a PNG",
    )
    g.add_argument(
        "--check",
        nargs="+",
        metavar="DIR",
        help="predict every results JSON in DIR from its config and compare with its measured peak",
    )
    args = parser.parse_args(argv)
    if args.batch_size % args.accumulation_steps:
        cli.fail(
            f"--accumulation-steps {args.accumulation_steps} does not divide --batch-size {args.batch_size}"
        )
    args.accelerator = "cpu" if args.accelerator == "cpu" else "cuda"  # 'auto': predict for a GPU
    if args.compile is None:
        args.compile = args.accelerator == "cuda"
    args.micro_batch_size = args.batch_size // args.accumulation_steps
    if args.optimizer:
        plan_fields["optimizer"] = args.optimizer
    if args.checkpoint:
        plan_fields["checkpoint"] = tuple(c for c in args.checkpoint.split(",") if c)
    plan_fields["attention"] = args.attention
    return args, plan_fields, label


def main(argv: list[str] | None = None) -> int:
    """``python -m common.estimate``: print the component table (or JSON) for a recipe's configuration."""
    from common import cli

    args, plan_fields, label = _parse(argv)
    if args.check:
        rows = check_results(args.check)
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            print(render_check(rows))
        if args.plot and rows:
            plot_check(rows, args.plot)
        return 0 if rows else 2
    try:
        plan = plan_from_args(args, **plan_fields)
    except ValueError as e:
        cli.fail(str(e))
    from common.models import MODEL_NAMES

    if args.model not in MODEL_NAMES:
        cli.fail(f"--model {args.model!r} is not one of: {', '.join(MODEL_NAMES)}")
    est = simulate(meta_model(args.model), plan, record_timeline=bool(args.plot), model_name=args.model)
    if args.json:
        print(json.dumps({"recipe": label, **est.to_dict()}, indent=2))
    else:
        print(f"[{label}]")
        print(est.table())
    if args.plot:
        plot_timeline(est, args.plot, title=f"{label}: predicted memory timeline, peak {est.peak_gb:.2f} GB")
        if not args.json:
            print(f"  timeline plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

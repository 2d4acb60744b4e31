"""Predict a training run's peak GPU memory before running it: weights, gradients, optimizer state,
activations saved for backward, and the backward pass's working memory.

    python -m fabric_memory_recipes.planning --recipe 05_gradient_accumulation            # the rung's own configuration
    python -m fabric_memory_recipes.planning --recipe 01_baseline --batch-size 32 --json   # any recipe flag overrides
    python -m fabric_memory_recipes.planning --recipe 08_fsdp --devices 8                  # FSDP: per-GPU memory

Why simulate instead of a formula. Arithmetic gets the static part exactly: weights x bytes, gradients
1x the trainable parameters, Adam 2x, SGD 0, momentum 1x; with PEFT the weights are K+N, the gradients
N, Adam 2N (K frozen, N trainable parameters). The activations are the hard part (measuring them means
changing the batch and looking at the difference) and they are usually the largest. Here they are not guessed: one training step is run on
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
  path (what CUDA falls back to when no fused kernel fits: in an eager step, for a mask whose last
  dimension is strided, as T5's position bias is; its dropout then keeps CUDA's bool mask).
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
  to host memory: they count 0 on the GPU. FSDP2 with one micro-batch: each unit's unsharded gradients are
  the step's own and its gradient shard is made on the reduce-scatter stream, whose pool the allocator
  replay keeps apart, as it does the all-gathers' outputs (planning/simulation/sharded.py).
* Rung-specific techniques: ``activation_offload`` (saved tensors in pinned host memory, as
  fabric_memory_recipes/training/techniques/offload.py), ``optimizer_in_backward`` (each gradient freed in its hook), torchao's 8-bit AdamW
  state (``optimizer="adamw8bit"``), activation checkpointing of named module classes, and rung 16's
  weights streamed from the CPU (``weights_offload``: its hooks replayed, its copy stream's own segments).
* A fixed CUDA library workspace: cuBLAS's 32 MiB per (thread, stream) on Hopper, for the forward thread
  and autograd's backward thread, taken from the caching allocator at the first matrix product.

torch.compile: the simulation runs the *eager* graph. Inductor may save different tensors (it can recompute
cheap pointwise ops instead of saving them); the estimate records ``compile`` so a comparison says which
kind of run it is checked against. docs/memory_anatomy.md has the errors against the committed compiled
and eager runs (all within 3.6%).

The package: ``plan`` (what decides the memory: :class:`Plan`, from a rung by :func:`plan_for`; the
result: :class:`Estimate`), ``tracking`` and ``modelled`` (the storage counter and what fake tensors
cannot show), ``simulate`` (the step, and :func:`for_run` for recipes), ``check`` (predicted against
measured results), ``instrument`` (what a recipe records of what it built), ``plots``, and ``__main__`` (the command line).
"""

from __future__ import annotations

from fabric_memory_recipes.planning.check import check_results, render_check
from fabric_memory_recipes.planning.instrument import instrument
from fabric_memory_recipes.planning.plan import (
    ALLOCATOR_ROUND,
    ATTENTION_CHOICES,
    COMPONENT_COLORS,
    COMPONENTS,
    CUDA_WORKSPACE_BYTES,
    GB,
    Estimate,
    Plan,
    plan_for,
)
from fabric_memory_recipes.planning.plots import plot_check, plot_timeline
from fabric_memory_recipes.planning.simulation.simulate import failed, for_run, image_batch, simulate
from fabric_memory_recipes.planning.simulation.tracking import SavedTensorCounter
from fabric_memory_recipes.training.models import meta_ladder_model

__all__ = [
    "ALLOCATOR_ROUND",
    "ATTENTION_CHOICES",
    "COMPONENT_COLORS",
    "COMPONENTS",
    "CUDA_WORKSPACE_BYTES",
    "GB",
    "Estimate",
    "Plan",
    "SavedTensorCounter",
    "check_results",
    "failed",
    "for_run",
    "image_batch",
    "instrument",
    "meta_ladder_model",
    "plan_for",
    "plot_check",
    "plot_timeline",
    "render_check",
    "simulate",
]

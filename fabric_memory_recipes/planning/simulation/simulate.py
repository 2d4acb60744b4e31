"""One steady-state training step on fake tensors, every storage tracked: :func:`simulate`, and
:func:`for_run`, what a recipe calls to record its predicted peak."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_leaves

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.console import notice
from fabric_memory_recipes.planning.plan import (
    COMPONENTS,
    CUBLAS_WORKSPACE_BYTES,
    CUDA_WORKSPACE_BYTES,
    GB,
    LOWBIT_BLOCK,
    LOWBIT_MIN_NUMEL,
    OPTIMIZER_STATE_FACTOR,
    Estimate,
    Plan,
    allocator_of,
    expandable_in,
    plan_for,
)
from fabric_memory_recipes.planning.simulation.built import built_technique
from fabric_memory_recipes.planning.simulation.compiled.partition import partitioned
from fabric_memory_recipes.planning.simulation.costs import OpCosts
from fabric_memory_recipes.planning.simulation.expandable import peaks_reserved
from fabric_memory_recipes.planning.simulation.modelled import (
    Precision,
    Wrapped,
    attention_kernel,
    checkpointed,
    cuda_autocast_policy,
    cuda_dropout,
    host_draws_kept,
)
from fabric_memory_recipes.planning.simulation.saved import SimulatedSaves
from fabric_memory_recipes.planning.simulation.sharded import side_streams
from fabric_memory_recipes.planning.simulation.streamed import StreamedWeights
from fabric_memory_recipes.planning.simulation.tracking import FakeMode, Tracker
from fabric_memory_recipes.training import data


# ---------------------------------------------------------------------------------------- the step
def image_batch(model: Any, micro_batch_size: int) -> tuple[Callable[[], Any], Callable]:
    """The ladder's batch: CIFAR-shaped uint8 images and int64 labels, turned into a loss by
    fabric_memory_recipes.training.data.image_classification (resize and normalise on the device, then cross-entropy)."""

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.empty(micro_batch_size, 32, 32, 3, dtype=torch.uint8)
        labels = torch.zeros(micro_batch_size, dtype=torch.long)
        return images, labels

    return make, data.image_classification(getattr(model, "image_size", 224))


def _unit_bytes(model: Any, class_names: tuple[str, ...], dtype_bytes: int) -> tuple[int, int]:
    """(largest FSDP unit, the root's remainder) in bytes of full, unsharded parameters."""
    units = [m for m in model.modules() if type(m).__name__ in class_names]
    in_units = {id(p) for u in units for p in u.parameters()}
    largest = max((sum(p.numel() for p in u.parameters()) for u in units), default=0)
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    return largest * dtype_bytes, root * dtype_bytes


def _optimizer_state(p: torch.Tensor, plan: Plan, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The state tensors the optimizer keeps for parameter ``p`` (of ``dtype``, default ``p``'s: FSDP's
    mixed precision computes in low precision, its sharded parameters stay fp32) from its first step on."""
    if plan.optimizer == "adamw8bit" and p.numel() >= LOWBIT_MIN_NUMEL and p.numel() % LOWBIT_BLOCK == 0:
        state = []  # torchao OptimState8bit: uint8 codes, one fp32 scale per block, a 256-entry qmap
        for _ in range(2):
            state.append(torch.empty(p.shape, dtype=torch.uint8))
            state.append(torch.empty(p.numel() // LOWBIT_BLOCK, dtype=torch.float32))
            state.append(torch.empty(256, dtype=torch.float32))
        return state
    state = [
        torch.zeros(p.shape, dtype=dtype or p.dtype) for _ in range(OPTIMIZER_STATE_FACTOR[plan.optimizer])
    ]
    if plan.optimizer in ("adam", "adamw") and plan.optimizer_impl == "fused":
        state.append(torch.zeros((), dtype=torch.float32))  # the step count lives on the device
    return state


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
    """fabric_memory_recipes.training.data caches its mean/std tensors per device; constants made under the fake mode must not
    outlive it (a later real CPU run would get a fake tensor)."""
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
    op_costs: OpCosts | None = None,
) -> Estimate:
    """Run one steady-state optimizer step of ``model`` under ``plan`` on fake tensors; return the estimate.

    ``model`` may live anywhere (CPU, GPU, meta): only its structure and parameter shapes are read, and
    ``requires_grad`` says which parameters train (so frozen backbones and LoRA are just models whose
    flags are set). Its parameters are swapped for fake ones during the step and restored afterwards.
    ``make_batch()`` builds a micro-batch (called under the fake mode) and ``batch_fn(model, batch)``
    returns ``(loss, ...)``, as in fabric_memory_recipes.training.loop; both default to the ladder's image classification.

    The step: optimizer state exists (steady state); micro-batch 1 runs forward and backward with no
    gradients allocated (``zero_grad(set_to_none=True)`` freed them); with accumulation a second
    micro-batch runs with the gradients kept; then the optimizer step. Later micro-batches repeat the
    second, so two are enough to find the peak.

    ``op_costs`` (an :class:`~fabric_memory_recipes.planning.simulation.costs.OpCosts`) records what each
    op of the forward and backward passes costs, per simulated micro-batch (0, then 1 for the later
    ones) and pass, and the optimizer step's bytes in its ``optimizer``; the estimate is the same with
    it or without.
    """
    start = time.perf_counter()
    if make_batch is None or batch_fn is None:
        default_make, default_fn = image_batch(model, plan.micro_batch_size)
        make_batch = make_batch or default_make
        batch_fn = batch_fn or default_fn

    precision = Precision(plan.precision, plan.device == "cuda", plan.sharding, plan.mixed_precision_policy)
    pbytes = torch.empty((), dtype=precision.param_dtype, device="meta").element_size()  # computed with
    master_bytes = torch.empty((), dtype=precision.master_dtype, device="meta").element_size()  # kept
    named_params = dict(model.named_parameters())
    trainable = [n for n, p in named_params.items() if p.requires_grad]
    n_total = sum(p.numel() for p in named_params.values())
    n_train = sum(named_params[n].numel() for n in trainable)
    scales: dict[str, float] = {"host": 0.0}  # offloaded activations live in host memory
    on_streams = plan.sharding != "none" and plan.accumulation_steps == 1 and not plan.optimizer_in_backward
    if plan.sharding != "none" or plan.weights_offload:
        shard = 0.0 if plan.cpu_offload or plan.weights_offload else 1.0 / plan.world_size
        # the fake weights and their gradients have the dtype the module computes with; the shards kept
        # between steps have the master dtype (FSDP's mixed precision: bf16 views, fp32 shards)
        master = shard * master_bytes / pbytes
        # FSDP's gradient shards are made on the GPU, offloaded or not (planning/simulation/sharded.py)
        gradients = master_bytes / pbytes / plan.world_size if on_streams else master
        scales.update({"parameters": master, "gradients": gradients, "optimizer_state": shard})
    tracker = Tracker(scales)  # the timeline is recorded from the first forward to zero_grad
    kernels: set[str] = set()
    saved_bytes = saved_rounded = None

    with contextlib.ExitStack() as stack:
        stack.enter_context(_neutral_defaults())
        stack.enter_context(_fresh_normalisation_cache())
        stack.enter_context(FakeMode(allow_non_fake_inputs=True))
        if op_costs is not None:  # records nothing until a micro-batch's section is set
            stack.enter_context(op_costs)
        stack.enter_context(tracker)
        # compiled blocks run as inductor partitions them, unless checkpointed (which keeps their input only)
        partition = tuple(b for b in plan.compiled_blocks if b not in plan.activation_checkpointing)
        uncached = plan.activation_checkpointing if plan.compile else ()  # eager graph, casts not cached
        eager_compiled = plan.compile and not partition  # compiled blocks run their eager graph here
        stack.enter_context(attention_kernel(plan.attention_kernel, plan.device, kernels, eager_compiled))
        stack.enter_context(cuda_dropout(plan.device == "cuda"))  # a bool mask kept, as CUDA's dropout
        stack.enter_context(host_draws_kept())  # LayerDrop's draws: every layer runs
        stack.enter_context(torch.compiler.set_stance("force_eager"))  # compiled blocks run eagerly here
        if (
            precision.mixed and precision.cuda_policy
        ):  # checkpointed blocks recompute in backward under it too
            stack.enter_context(cuda_autocast_policy(True))
            precision.policy_held = True

        # Weights and buffers, in the dtype Fabric gives them.
        fake_state: dict[str, torch.Tensor] = {}
        with tracker.creating("parameters"):
            for n, p in [*named_params.items(), *model.named_buffers()]:
                dtype = precision.param_dtype if p.is_floating_point() else p.dtype
                fake_state[n] = torch.empty(p.shape, dtype=dtype, requires_grad=bool(p.requires_grad))

        streamed = StreamedWeights(model, plan.shard_units, pbytes, tracker) if plan.weights_offload else None
        sharded = None  # FSDP, one micro-batch: its gradients and all-gathers on its side streams
        if on_streams:
            sharded = side_streams(model, plan, tracker, pbytes / master_bytes)

        def grad_ready(p: torch.Tensor) -> None:
            if sharded is not None:
                sharded.ready(p)
                return
            tracker.retag(p.grad, "gradients")
            if streamed is not None:  # rung 16: copied out on another stream
                streamed.gradient(p)
            if plan.optimizer_in_backward or plan.weights_offload:  # stepped/copied out, then freed at once
                p.grad = None

        for n in trainable:
            fake_state[n].register_post_accumulate_grad_hook(grad_ready)
        if sharded is not None:
            sharded.bind(fake_state)
        if streamed is not None:  # rung 16: the root resident, the units streamed by the hooks
            streamed.bind(fake_state)
            streamed.setup()
        elif plan.sharding != "none":  # FSDP: the units in use at once
            unit, root = _unit_bytes(model, plan.shard_units, pbytes)
            # in use at once: the current unit, the prefetched one, the root; one unit's unsharded grads
            # (made by the step where its side streams are modelled, the gathered units there: sharded.py)
            in_use = (plan.prefetch_units + bool(n_train)) * unit + root
            if sharded is None:
                tracker.add_constant("gathered_parameters", in_use)
            else:
                sharded.gather_buffers(unit, root, plan.prefetch_units)
        tracker.mark("workspace")  # made by the first step: fast mode's on its side stream
        if plan.device == "cuda":
            for _ in range(CUDA_WORKSPACE_BYTES // CUBLAS_WORKSPACE_BYTES):  # one per thread
                tracker.add_constant("workspace", CUBLAS_WORKSPACE_BYTES)
            tracker.mark("window")
            if (
                plan.activation_offload
            ):  # copies in flight, a window per side stream: training/techniques/offload.py
                tracker.add_constant("activations", 2 * plan.offload_window_bytes)

        tracker.mark("state")
        tracker.phase = "optimizer state"  # as it is from the first optimizer step on
        with tracker.creating("optimizer_state"):
            state = [
                t for n in trainable for t in _optimizer_state(fake_state[n], plan, precision.master_dtype)
            ]
        state_bytes = sum(t.untyped_storage().nbytes() for t in state if t.dim() > 0)  # no step counters

        params_and_buffers = list(fake_state.values())
        counter = SimulatedSaves(params_and_buffers, tracker, plan)
        # The fake weights stand in for the module's own for the whole step: checkpointed blocks
        # recompute in backward, after the forward call has returned.
        stack.enter_context(_reparametrize_module(model, fake_state, tie_weights=True))
        context = (plan.device, plan.attention_kernel)  # what the blocks' traces depend on besides
        stack.enter_context(partitioned(model, partition, context, kernels, uncached))
        stack.enter_context(
            checkpointed(model, plan.activation_checkpointing, counter.add, plan.checkpoint_mode)
        )
        if streamed is not None:
            stack.enter_context(streamed.hooks())
        wrapped = Wrapped(model, precision)
        k = plan.accumulation_steps
        tracker.record_timeline = record_timeline
        tracker.mark("step")
        for micro in range(min(k, 2)):
            label = "first micro-batch" if micro == 0 else "a later micro-batch (gradients kept)"
            tracker.phase = f"forward, {label}"
            batch = make_batch()
            for t in tree_leaves(batch):
                tracker.retag(t, "inputs")
            if op_costs is not None:
                op_costs.section = (micro, "forward")
            with counter:
                loss = batch_fn(wrapped, batch)[0]
            if micro == 0:  # read while the graph is alive, as a real run's counter is read
                saved_bytes, saved_rounded = counter.nbytes, counter.rounded_nbytes
            tracker.phase = f"backward, {label}"
            scaled = loss / k
            if op_costs is not None:
                op_costs.section = (micro, "backward")
            tracker.backward(scaled)  # gradient parts summed in place where a GPU run sums them
            if sharded is not None:
                sharded.backward_done()
            del loss, batch, scaled
            if op_costs is not None:
                op_costs.section = None

        tracker.mark("update")
        tracker.phase = "optimizer step"
        transient = 0  # fused kernels and SGD update in place
        if plan.optimizer in ("adam", "adamw") and plan.optimizer_impl == "foreach":
            transient = (
                n_train * master_bytes
            )  # torch._foreach_sqrt(exp_avg_sq): a list as large as the grads
        elif plan.optimizer in ("adam", "adamw") and plan.optimizer_impl == "for-loop":
            transient = max((named_params[n].numel() for n in trainable), default=0) * master_bytes
        elif plan.optimizer == "adamw8bit":  # per tensor: the two moments dequantised + the update, fp32
            transient = 3 * 4 * max((named_params[n].numel() for n in trainable), default=0)
        if plan.optimizer_in_backward or plan.weights_offload:
            transient = 0  # already done inside backward (rung 16: on the CPU)
        transient = int(transient * scales.get("optimizer_state", 1.0))
        if op_costs is not None:  # what the step reads and writes: weights, gradients, state (per GPU)
            shard = scales.get("optimizer_state", 1.0)
            op_costs.optimizer = {
                "parameter_bytes": n_train * master_bytes * shard,
                "gradient_bytes": n_train * master_bytes * shard,
                "state_bytes": state_bytes * shard,
                "tensors": len(trainable),
                "in_backward": plan.optimizer_in_backward,
            }
            op_costs.largest_offloadable = counter.largest_offloadable
        tracker.add_constant("temporaries", transient)
        tracker.add_constant("temporaries", -transient)
        tracker.phase = "zero_grad(set_to_none=True)"
        for t in fake_state.values():
            t.grad = None
        if sharded is not None:
            sharded.zero_grad()
        if streamed is not None:
            streamed.step_done()
        tracker.mark("end")
        tracker.record_timeline = False
        del state, fake_state, params_and_buffers, wrapped, counter

    replays = {}
    if plan.device == "cuda":  # fast mode keeps the gradients across an accumulation group's micro-batches
        kept = tracker.gradient_handles if k > 1 and not plan.optimizer_in_backward else ()
        replays = peaks_reserved(
            tracker.events, tracker.marks, frozenset(kept), not plan.optimizer_in_backward
        )
    shard = scales.get("optimizer_state", 1.0)
    static = {  # the arithmetic, exactly
        "weights": n_total * master_bytes * shard / GB,
        "gradients": n_train * master_bytes * shard / GB,
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
        largest_temporary_gb=tracker.largest_temporary / GB,
        reserved_gb=replays[plan.allocator] / GB if replays else None,
        reserved_by_allocator={name: n / GB for name, n in replays.items()},
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


def for_run(model: Any, cfg: RunConfig, optimizer: Any = None) -> Estimate:
    """The estimate a recipe records next to its measurement: ``results.estimate =
    planning.for_run(model, cfg, optimizer)``, called after the model (and optimizer) are built and
    before ``fabric.setup``.

    The plan comes from the run's configuration (:func:`~fabric_memory_recipes.planning.plan.plan_for`): its flags and
    its rung's technique, where what the run built says otherwise: its checkpointed blocks and its
    optimizer (:func:`~fabric_memory_recipes.planning.simulation.built.built_technique`). An estimate that fails is
    recorded with its error and never stops the run (it is a prediction, not part of training).
    """
    name = cfg.model or type(model).__name__
    plan = None
    try:
        # the allocator's setting as this process has it (fast mode sets it before CUDA starts)
        expandable = expandable_in(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        allocator = allocator_of(cfg, expandable)
        plan = plan_for(cfg, allocator=allocator, **built_technique(model, cfg, optimizer))
        est = simulate(model, plan, model_name=name)
    except Exception as e:
        est = failed(plan, name, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if est.error:
        notice(f"[estimate] could not estimate memory: {est.error}")
    else:
        notice(
            f"[estimate] predicted peak {est.peak_gb:.3g} GB per device ({est.peak_phase}; "
            f"{est.plan.attention_kernel} attention, {est.seconds:.1f} s)"
        )
    return est

"""What fake tensors on a CPU cannot show by themselves, modelled for the simulation: CUDA autocast's
op policy, the attention kernel the target device runs (and CUDA's dropout inside it), activation
checkpointing of named blocks, and Fabric's precision plugins."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._C import DispatchKey, DispatchKeySet
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint, noop_context_fn

from fabric_memory_recipes.planning.plan import CHECKPOINT_WRAPPERS, LOW_PRECISION
from fabric_memory_recipes.training.techniques import checkpointing


@contextlib.contextmanager
def cuda_autocast_policy(enabled: bool) -> Iterator[None]:
    """Give CPU autocast CUDA autocast's choices for the ops where the two differ.

    CUDA runs these in fp32 under autocast; CPU autocast runs them in low precision. softmax and
    log_softmax given a dtype run as called (CUDA's ``fp32_set_opt_dtype`` policy). CUDA lists no policy
    for ``cross_entropy_loss``, which CPU autocast runs in fp32: on CUDA its log_softmax keeps the input's
    dtype (it passes that dtype) and nll_loss, an fp32 op, takes an fp32 copy of the log-probabilities, so
    bf16 logits leave both for backward (:func:`cuda_cross_entropy`). The kernels are registered for the
    AutocastCPU key only while the simulation runs and removed afterwards.
    """
    if not enabled:
        yield
        return

    def fp32(op, dtype_at: int | None = None):
        def kernel(*args, **kwargs):
            given = args[dtype_at] if dtype_at is not None and len(args) > dtype_at else kwargs.get("dtype")
            if dtype_at is not None and given is not None:  # a dtype given: CUDA runs the op as called
                with torch._C._ExcludeDispatchKeyGuard(DispatchKeySet(DispatchKey.AutocastCPU)):
                    return op(*args, **kwargs)

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
            for name, overload, dtype_at in (
                ("layer_norm", "default", None),
                ("native_layer_norm", "default", None),
                ("group_norm", "default", None),
                ("softmax", "int", 2),
                ("log_softmax", "int", 2),
                ("nll_loss", "default", None),
                ("mse_loss", "default", None),
            ):
                op = getattr(getattr(torch.ops.aten, name), overload)
                name = name if overload == "default" else f"{name}.{overload}"
                lib.impl(name, fp32(op, dtype_at), "AutocastCPU")
            lib.impl("cross_entropy_loss", cuda_cross_entropy, "AutocastCPU")
        yield
    finally:
        lib._destroy()


def cuda_cross_entropy(*args, **kwargs):
    """``aten::cross_entropy_loss`` under CUDA autocast, which has no policy for it: its own composite
    (LossNLL.cpp), whose ops meet autocast one by one (:func:`cuda_autocast_policy`)."""
    return torch.ops.aten.cross_entropy_loss.default.decompose(*args, **kwargs)


@contextlib.contextmanager
def replaced(owner: Any, name: str, stand_in: Any) -> Iterator[None]:
    """``owner.<name>`` is ``stand_in`` inside, its own again after, an error or not: how a simulation puts its
    stand-ins for what fake tensors cannot run as the GPU would (``F.scaled_dot_product_attention``: the
    training step's :func:`attention_kernel`, inference's kernels on CUDA; a host draw; a library's check)."""
    original = getattr(owner, name)
    setattr(owner, name, stand_in)
    try:
        yield
    finally:
        setattr(owner, name, original)


def cuda_runs_flash(query: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """Whether CUDA's dispatcher picks flash attention: fp16/bf16 without a mask, a head size that is a
    multiple of 8 up to 256 (else the memory-efficient kernel, where it fits)."""
    head_dim = query.shape[-1]
    half = query.dtype in (torch.float16, torch.bfloat16)
    return attn_mask is None and half and head_dim % 8 == 0 and head_dim <= 256


STRIDED_FALLBACK = "math (strided input)"  # the kernel a CUDA step falls back to, as reported


def cuda_takes_fused(*tensors: torch.Tensor | None) -> bool:
    """Whether CUDA's fused attention kernels (flash, memory-efficient, cuDNN) take q, k, v and the mask
    at all: each wants their last dimension contiguous (torch's sdp_utils_cpp.h,
    check_last_dim_stride_equals_1_dense: "GPU backends require attn_mask's last dimension to have stride
    1 while the CPU does not"); else CUDA runs math. T5's position bias is such a mask: its bucket
    embedding permuted to (1, heads, q, k) lays the heads out last."""
    return all(t is None or t.stride(-1) == 1 for t in tensors)


@contextlib.contextmanager
def cuda_dropout(enabled: bool) -> Iterator[None]:
    """``aten::dropout`` as CUDA runs it: the fused ``native_dropout``, whose backward keeps a bool mask
    (1 byte an element). aten picks it by ``input.is_cuda()`` (Dropout.cpp, is_fused_kernel_acceptable);
    on a CPU it draws a noise tensor of the input's dtype and keeps that (2 or 4 bytes an element): T5-small's
    dropout layers at batch 32 x 256 -> 64 kept 226 MB more so than on the GPU. The kernel is registered
    for the AutogradCPU key while the context is open, so it serves ``nn.Dropout`` and the calls made from
    C++ too (the math attention kernel's dropout)."""
    if not enabled:
        yield
        return

    def dropout(input, p, train):
        if train and 0 < p < 1 and input.numel() > 0:
            return torch.ops.aten.native_dropout(input, p, train)[0]
        if not train or p == 0 or input.numel() == 0:  # Dropout.cpp, _dropout_impl
            return input
        return input * torch.zeros((), dtype=input.dtype)

    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - a temporary override, removed below
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl("dropout", dropout, "AutogradCPU")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def attention_kernel(kind: str, device: str, used: set[str], compiled: bool = False) -> Iterator[None]:
    """Make ``F.scaled_dot_product_attention`` run the kernel the target device would run.

    'fused' on CUDA mimics its dispatcher: flash attention for fp16/bf16 without a mask, the
    memory-efficient kernel otherwise; on a CPU the CPU flash kernel, or math for a mask that needs a
    gradient (T5's learned position bias), as torch's CPU dispatcher does. All of them save q, k, v, the
    output and a log-sum-exp, no score matrix. 'math' runs the reference implementation, which saves the
    attention weights (batch x heads x seq x seq): what the meta device runs, and what CUDA falls back to
    when no fused kernel fits, for inputs whose last dimension is strided (:func:`cuda_takes_fused`), in
    compiled blocks too (T5-small's compiled step on an H200 ran its self-attention's softmax as inductor
    kernels), where inductor fuses the softmax and the dropout into kernels. ``compiled``: the step's
    compiled blocks run their eager graph here (checkpointed ones, which keep nothing but their input:
    planning/simulation/simulate.py), so their strided attention is counted as the memory-efficient
    kernel, whose transients stand in for those fused kernels' (the committed checkpointed fast rows of
    T5-small, T5-base and mT5-base: within 1 % of their measured peak allocated). Autocast casts the
    arguments, the mask included, and runs the kernel with itself off (math computes in fp32 inside); on
    CUDA the simulation runs CUDA's dropout (:func:`cuda_dropout`) for the whole step. ``used`` collects the
    kernels that ran.
    """

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if torch.is_autocast_enabled("cpu"):  # autocast lists SDPA as a low-precision op
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(dtype) for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(dtype)
        # T5's learned position bias is a mask that needs a gradient: a CPU runs math for it
        learned_mask = attn_mask is not None and attn_mask.requires_grad
        strided = device == "cuda" and not compiled and not cuda_takes_fused(query, key, value, attn_mask)
        if kind == "math" or kw.get("enable_gqa") or device == "cpu" and learned_mask or strided:
            used.add(STRIDED_FALLBACK if strided and kind != "math" else "math")
            with torch.autocast("cpu", enabled=False):
                return torch.ops.aten._scaled_dot_product_attention_math(
                    query, key, value, attn_mask, dropout_p, is_causal, scale=scale
                )[0]
        if device == "cpu":
            used.add("flash (CPU)")
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]
        if cuda_runs_flash(query, attn_mask):
            used.add("flash")
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        used.add("efficient")
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
        )[0]

    with replaced(F, "scaled_dot_product_attention", sdpa):
        yield


@contextlib.contextmanager
def host_draws_kept() -> Iterator[None]:
    """A 0-dim ``torch.rand`` on the host (LayerDrop in BART and its kin: ``torch.rand([]) < p`` skips a layer)
    is the constant 1.0 here: its value decides what runs, which a fake tensor cannot tell, and 1.0 runs every
    layer (the step's largest; the runner's configs train with LayerDrop 0, every layer running)."""
    original = torch.rand

    def rand(*size, **kwargs):
        shape = size[0] if len(size) == 1 and isinstance(size[0], list | tuple) else size
        if tuple(shape) == () and kwargs.get("device") is None and kwargs.get("out") is None:
            return torch.tensor(1.0, dtype=kwargs.get("dtype"))
        return original(*size, **kwargs)

    with replaced(torch, "rand", rand):
        yield


@contextlib.contextmanager
def checkpointed(
    model, class_names: tuple[str, ...], keep: Callable[[torch.Tensor], None], mode: str = "full"
) -> Iterator[int]:
    """Wrap the forward of every module whose class is named in ``class_names`` in non-reentrant
    activation checkpointing (what Fabric's ``activation_checkpointing_policy`` and ``checkpoint_wrapper``
    do), for the duration of the simulation. ``keep`` is told about each block input: checkpointing
    keeps it for the recompute, so it counts as saved."""
    wrapped = []
    context = (
        checkpointing.context_fn(mode) or noop_context_fn
    )  # the run's own policy (selective: keep matmuls)
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
                return checkpoint(_original, *args, use_reentrant=False, context_fn=context, **kwargs)

            module.forward = forward
            wrapped.append(module)
    try:
        yield len(wrapped)
    finally:
        for module in wrapped:
            del module.forward  # back to the class's forward


class Precision:
    """What Fabric's precision plugin does to the module, its inputs and its forward (see
    lightning.fabric.plugins.precision: HalfPrecision, MixedPrecision), replayed on fake tensors."""

    def __init__(
        self, precision: str, cuda_policy: bool, sharding: str = "none", policy: bool = False
    ) -> None:
        self.cuda_policy = cuda_policy
        self.policy_held = (
            False  # simulate() holds CUDA's autocast policy for the whole step (recomputes too)
        )
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
        # The sharded parameters, their gradients and the optimizer's state keep param_dtype; what the
        # module computes with may differ. Lightning's FSDPStrategy (sharding "fsdp") hands FSDP
        # MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low) for "-mixed" too
        # (lightning.fabric.plugins.precision.fsdp: mixed_precision_config): every unit is all-gathered
        # in low precision, so forward and backward see low-precision weights and buffers (autocast has
        # no weight to copy) and the gradients are reduce-scattered in it, then cast to the fp32 shard.
        # FSDP2 (sharding "fsdp2") gathers the fp32 parameters, unless its MixedPrecisionPolicy (``policy``)
        # gathers them in low precision as FSDP1's does.
        self.master_dtype = self.param_dtype
        if (sharding == "fsdp" or (sharding == "fsdp2" and policy)) and self.mixed and low is not None:
            self.param_dtype = low

    def convert(self, data):
        def cast(t):
            return t.to(self.input_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return tree_map(cast, data)

    def convert_output(self, data):
        def cast(t):
            return t.to(torch.float32) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return tree_map(cast, data) if self.input_dtype != torch.float32 else data

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:

        if self.mixed:
            with (
                torch.autocast("cpu", dtype=self.low),
                cuda_autocast_policy(self.cuda_policy and not self.policy_held),
            ):
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


class Wrapped:
    """Calls the model as Fabric's ``_FabricModule`` does: convert inputs, forward in the precision
    context, convert outputs."""

    def __init__(self, model, precision: Precision) -> None:
        self.model = model
        self.precision = precision

    def __getattr__(self, name: str):  # batch functions may read model attributes (image_size)
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):

        args, kwargs = self.precision.convert((args, kwargs))
        with self.precision.forward_context():
            out = self.model(*args, **kwargs)
        return self.precision.convert_output(out)

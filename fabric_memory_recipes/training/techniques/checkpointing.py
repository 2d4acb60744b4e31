"""Activation checkpointing (rung 10; rungs 14 and 16, and ``recipes/your_model.py --checkpoint-blocks``).

:func:`checkpoint_blocks` wraps every module of the named classes (the model's repeated blocks) in a
:class:`CheckpointedBlock`: in the forward pass only the block's input is kept, and the tensors inside
the block are recomputed during the backward pass. The ladder's recipes and the your-model runner call
it; the estimator finds the wrapped blocks by the wrapper's class name (``planning.plan.CHECKPOINT_WRAPPERS``).

``mode`` says what a checkpointed block keeps: ``full`` keeps its input only (everything inside is
recomputed); ``selective`` also keeps the outputs of its matrix products and attention
(torch.utils.checkpoint's selective checkpointing, :func:`context_fn`) and recomputes only the cheap
pointwise ops (norms, activations, residual adds, dropout masks) in backward: most of full checkpointing's
saving on a block whose saved tensors are mostly pointwise outputs, at a fraction of its recompute.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.techniques import CHECKPOINT_MODE

# What a checkpointed block keeps (the checkpointing record's option): its input only; also its matmuls
# and attention.
MODES = CHECKPOINT_MODE.choices

_aten = torch.ops.aten
SAVED_OPS = frozenset(  # selective: the outputs kept (the costly ops); everything else is recomputed
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "convolution",
    )
    if hasattr(_aten, name)
)


def _keep_costly(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _written_arguments(op) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``op`` writes in place (``relu_``'s self, an ``out=``); none for an
    op without a schema (a higher-order operator)."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.is_mutable:
        return ()
    return tuple(
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def _written_tensors(op, args, kwargs) -> list[torch.Tensor]:
    written = []
    for i, name in _written_arguments(op):
        value = args[i] if i < len(args) else kwargs.get(name)
        values = value if isinstance(value, list | tuple) else (value,)
        written += [v for v in values if isinstance(v, torch.Tensor)]
    return written


def _kept_as_they_were(storage, written: list[torch.Tensor]) -> None:
    """Before an op writes ``written`` in place, replace each kept output that shares its memory with a copy:
    the recompute reads the kept output as it was made, not as the block changed it afterwards (torch's
    selective checkpointing refuses a kept tensor changed since: "Tensor cached during selective activation
    checkpoint has been mutated"). Swin-V2's position-bias MLP is such a block: its ``ReLU(inplace=True)``
    rewrites the output of the linear layer before it, a kept matmul."""
    for entries in storage.values():
        for entry in entries:
            for kept in tree_leaves(entry):  # torch's wrappers of the kept tensors (their value and version)
                value = kept.val
                if isinstance(value, torch.Tensor) and any(torch._C._is_alias_of(w, value) for w in written):
                    kept.val = value.clone()
                    kept.version = kept.val._version


def _tracing() -> bool:
    """Under torch.compile's tracing (torch's own test in selective checkpointing): in-place ops are traced
    into a graph there, whose partitioner decides what is kept; nothing kept is read back in eager mode."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def _selective_contexts():
    """The forward and recompute contexts of ``selective``: :func:`_keep_costly`'s choice of what to keep, and
    a kept output that the block then changes in place is kept as it was made (:func:`_kept_as_they_were`)."""
    storage = {}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if not ctx.is_recompute and storage and _written_arguments(op) and not _tracing():
            written = _written_tensors(op, args, kwargs)
            if written:
                _kept_as_they_were(storage, written)
        return _keep_costly(ctx, op, *args, **kwargs)

    forward, recompute = create_selective_checkpoint_contexts(policy)
    storage = forward.storage  # what the forward keeps: op -> [its outputs, one entry per call]
    return forward, recompute


def context_fn(mode: str):
    """``checkpoint(..., context_fn=...)`` for ``mode``: None for ``full`` (torch's default: recompute all)."""
    if mode not in MODES:
        raise ValueError(f"checkpointing mode {mode!r}: expected one of {', '.join(MODES)}")
    return _selective_contexts if mode == "selective" else None


class CheckpointedBlock(torch.nn.Module):
    """Rung 10: runs ``block`` under ``torch.utils.checkpoint``. In the forward pass only the block's
    input is kept; the tensors inside the block are recomputed during the backward pass.

    ``use_reentrant=False`` (the default here and PyTorch's recommendation) recomputes through
    saved-tensor hooks: it works when the input does not require grad, supports keyword arguments,
    and stops recomputing as soon as the tensors it needs are rebuilt. ``use_reentrant=True`` re-runs
    the block inside a custom autograd Function during backward and needs an input that requires
    grad; it is the older implementation.

    An attribute the wrapper lacks is read from the block (a model's forward may ask its layers for
    one, as from any layer it built)."""

    def __init__(self, block: torch.nn.Module, use_reentrant: bool = False, mode: str = "full") -> None:
        super().__init__()
        self.block = block
        self.use_reentrant = use_reentrant
        self.mode = mode
        self._context = context_fn(mode)

    def forward(self, *args, **kwargs):
        if self._context is None:
            return checkpoint(self.block, *args, use_reentrant=self.use_reentrant, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=self._context, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "block":  # not yet set (during __init__): nothing to read through
                raise
            return getattr(self.block, name)


def checkpoint_blocks(
    model: torch.nn.Module, blocks: tuple[str, ...], mode: str = "full", use_reentrant: bool = False
) -> int:
    """Wrap every module of ``model`` whose class is named in ``blocks`` in a :class:`CheckpointedBlock`
    (in place, in its parent); returns how many were wrapped, and refuses (one line, exit 2) a model that
    has none of them. ``mode``: :data:`MODES`."""
    context_fn(mode)  # a known mode
    found = [
        (parent, name, child)
        for parent in model.modules()
        if not isinstance(parent, CheckpointedBlock)
        for name, child in parent.named_children()
        if type(child).__name__ in blocks
    ]
    if not found:
        named = ", ".join(blocks) or "none named"
        raise UsageError(f"activation checkpointing: no repeated blocks found in this model ({named})")
    for parent, name, child in found:
        setattr(parent, name, CheckpointedBlock(child, use_reentrant=use_reentrant, mode=mode))
    return len(found)

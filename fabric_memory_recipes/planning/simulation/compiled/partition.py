"""Compiled blocks as inductor partitions them: :func:`partitioned`.

``torch.compile`` traces a block's forward and backward into one joint graph and cuts it in two
(torch/_functorch/partitioners.py, ``min_cut_rematerialization_partition`` as inductor calls it): the
forward keeps for backward the cheapest set of tensors from which the backward can recompute the rest,
so chains of pointwise ops are recomputed in backward from narrower tensors than eager autograd keeps.
A T5-small block (batch 32 x 256 -> 64, bf16-mixed) keeps a bool mask where eager keeps the ReLU's bf16
output, the bf16 input of the norm's rescale where eager keeps its fp32 output too, and, in its math
attention, the fp32 scores with the softmax's row max and sum where eager keeps the softmax's output
and the dropped-out weights, and q, k, v in bf16 where eager keeps their fp32 copies: its 12 compiled
blocks kept 2.04 GB where eager blocks keep 3.29 GB (results/published/h200/t5-attention-backend/).

:func:`partitioned` makes each block of the named classes run, for the simulated step, as the compiled
block does: traced by AOT autograd with inductor's decompositions and partitioned as inductor partitions
it, the two graphs then run op by op on the simulation's fake tensors (no kernel is generated), so the
step's tracker counts what the compiled forward keeps and what its backward makes. A block is traced
once per distinct call (its class, parameters, inputs' shapes, dtypes, strides and aliasing, its other
arguments, autocast's state and the simulation's device and attention kernel), with the simulation's
dispatch modes and saved-tensor hooks set aside while it is traced, and kept for the process's later
simulations: a trace costs about a second on a CPU (T5-small's 4 distinct blocks: 8 s on 2 busy cores,
2 s when they are kept).

A compiled block that is also checkpointed keeps only its input, so its eager graph runs in the simulation
(``uncached``): but with autocast's cache of weight casts off inside it. Eager autocast keeps each fp32
weight's low-precision copy until the forward pass ends; compiled code casts inside its graph and frees the
copy after its last use. Phi-1.5 (1.4 B, bf16-mixed, fast mode, checkpointed blocks) was predicted 2.63 GB of
such copies at its forward's peak and measured 2.68 GB under the prediction on an H200
(results/published/h200/ranking-check/NOTES.md, "Phi-1.5 at 24 GB").
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from fabric_memory_recipes.training.your_model.models import holds_batch_norm

PARTITION = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
KEPT = 64  # traced blocks kept per process (the oldest dropped first)
_TRACED: dict[tuple, tuple[Callable, frozenset[str]]] = {}  # by what a trace depends on (:meth:`_Block.key`)


def _graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
    """The partitioned graph itself, run op by op (where inductor would generate its kernels)."""
    return make_boxed_func(gm)


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, tuple(t.stride()), t.storage_offset(), t.requires_grad, t.device.type)


def _stand_ins(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors like ``tensors`` (shapes, strides, dtypes, which share a storage, whether they need gradients)
    in storages of their own: the trace may keep its example inputs, and the step's own would then outlive
    their last use in every later count of the simulation that traced the block."""
    bases: dict[int, torch.Tensor] = {}
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        if id(storage) not in bases:
            bases[id(storage)] = t.new_empty(storage.nbytes(), dtype=torch.uint8)
        view = bases[id(storage)].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
        out.append(view.detach().requires_grad_(t.requires_grad))
    return out


class _Uncached:
    """A block's own forward with autocast's weight-cast cache off inside it (compiled code casts in its graph)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.original = module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cached = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            return self.original(*args, **kwargs)
        finally:
            torch.set_autocast_cache_enabled(cached)


class _Block:
    """One block's compiled forward for the simulation: traced on its first call of each kind."""

    def __init__(self, module: torch.nn.Module, context: tuple, used: set[str]) -> None:
        self.module, self.original = module, module.forward
        self.context, self.used = context, used

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing kept for backward: as eager
            return self.original(*args, **kwargs)
        names = [n for n, _ in self.module.named_parameters()] + [n for n, _ in self.module.named_buffers()]
        state = [t for _, t in self.module.named_parameters()] + [t for _, t in self.module.named_buffers()]
        leaves, spec = tree_flatten((args, kwargs))
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        constants = [None if i in at else x for i, x in enumerate(leaves)]
        inputs = [leaves[i] for i in at]
        storages = [id(t.untyped_storage()) for t in [*state, *inputs]]
        key = (
            type(self.module),
            tuple(names),
            tuple(_meta(t) for t in [*state, *inputs]),
            tuple(storages.index(s) for s in storages),  # which tensors share a storage
            repr(spec),
            repr(constants),
            self.module.training,
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
            self.context,
        )
        if key not in _TRACED:
            before = set(self.used)  # the attention kernels its trace runs (the simulation's stand-in)
            compiled = self._trace(names, spec, at, constants)
            with _disable_current_modes(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                # the first call traces and partitions: away from the step's counts, on stand-ins of its inputs
                compiled(state, _stand_ins(inputs))
            _TRACED[key] = (compiled, frozenset(self.used - before))
            while len(_TRACED) > KEPT:
                del _TRACED[next(iter(_TRACED))]
        compiled, kernels = _TRACED[key]
        self.used.update(kernels)
        return compiled(state, inputs)

    def _trace(self, names: list[str], spec: Any, at: list[int], constants: list[Any]) -> Callable:
        module, original = self.module, self.original

        def block(state: list[torch.Tensor], inputs: list[torch.Tensor]) -> Any:
            leaves = list(constants)
            for i, t in zip(at, inputs, strict=True):
                leaves[i] = t
            args, kwargs = tree_unflatten(leaves, spec)
            with _reparametrize_module(module, dict(zip(names, state, strict=True))):
                return original(*args, **kwargs)

        return aot_function(
            block,
            fw_compiler=_graph,
            bw_compiler=_graph,
            partition_fn=PARTITION,
            decompositions=select_decomp_table(),
        )


@contextlib.contextmanager
def partitioned(
    model: Any,
    class_names: tuple[str, ...],
    context: tuple = (),
    used: set[str] | None = None,
    uncached: tuple[str, ...] = (),
) -> Iterator[int]:
    """Run every module of ``model`` whose class is named in ``class_names`` as its compiled block, for the
    duration (:class:`_Block`); yields how many. ``context``: what else the simulation's trace of a block
    depends on (its device and attention kernel: the stand-ins of planning/simulation/modelled.py); ``used``
    collects the attention kernels the blocks run; ``uncached``: the compiled blocks that are checkpointed,
    run eagerly with autocast's cast cache off (:class:`_Uncached`), but for those holding BatchNorm, which
    fast mode does not compile."""
    used = set() if used is None else used
    wrapped = []
    for module in model.modules():
        if class_names and type(module).__name__ in class_names:
            module.forward = _Block(module, context, used)
            wrapped.append(module)
        elif uncached and type(module).__name__ in uncached and not holds_batch_norm(module):
            module.forward = _Uncached(module)
            wrapped.append(module)
    try:
        yield len(wrapped)
    finally:
        for module in wrapped:
            module.__dict__.pop("forward", None)  # back to the class's forward (checkpointing may have)

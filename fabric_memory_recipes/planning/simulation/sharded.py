"""FSDP2's gradients and all-gather buffers in the simulated step, on the streams where ``fully_shard`` makes them.

The caching allocator serves a request only from blocks of the stream that made them, so memory that one of
FSDP2's side streams allocated and freed stays with that stream: the step's forward and backward, on the
compute stream, cannot reuse it, where a replay of one stream lets them. What ``fully_shard`` allocates where
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, torch 2.11):

* Gradients (``foreach_reduce``). Autograd makes a unit's unsharded gradients on the compute stream; once
  the unit's backward is done (the root's at the end of backward) they are copied into one reduce-scatter
  input on the compute stream and freed, the input when the next unit is reduce-scattered. On the
  reduce-scatter stream the output (1/N of the unit in the reduce dtype, the compute dtype under a
  ``MixedPrecisionPolicy``) is cast to the master dtype (fp32 under mixed precision): one block per unit that
  the sharded parameters' ``.grad`` view until ``zero_grad``, the output in the compute dtype freed at once.
  With ``CPUOffloadPolicy`` the shard is copied to the host and the GPU's freed at once.
* All-gathers (``foreach_all_gather``): a unit's output is allocated on the all-gather copy-in stream, its
  parameters copied out of it on the compute stream (the estimate's gathered units); in forward it is kept
  until the next unit's copy-out, so two units' outputs are in use (the held one and the prefetched one),
  the root's first.

:class:`ShardedGradients` logs this as allocator events (planning/simulation/allocator.py: ``ALLOC_REDUCE``,
``ALLOC_GATHER``) from the step's post-accumulate-grad hook. A shard counts in the "gradients" component,
whose weight (1/N of the master dtype over the compute dtype) makes its bytes from the unsharded gradients'.

FSDP1 (Lightning's ``FSDPStrategy``, sharding "fsdp"; torch/distributed/fsdp/_flat_param.py and
_runtime_utils.py) makes the same gradient requests on its post-backward stream: the reduce-scatter's output
(``_get_reduce_scatter_tensors``, 1/N of the unit in the reduce dtype) and its cast to the parameters' dtype
(``_cast_grad_to_param_dtype``), the gradient shard kept until ``zero_grad`` or, with CPU offload, until the end
of backward (``_saved_grad_shard``, copied to the host without blocking). Its all-gather outputs (the padded
unsharded flat parameters, ``_alloc_padded_unsharded_flat_param``) are made on its unshard stream, and the
parameters compute from them: :class:`FlatParameterGradients` keeps the gathered units there. In backward three
units' are reserved (the current one, the prefetched one, and the one whose free waits for the compute stream
after ``record_stream``), and the root's twice (gathered again at the end of backward before its forward
output is freed). Under mixed precision each unit's low-precision shard is made on a third stream before its
all-gather (``_use_low_precision_shard``), with CPU offload next to the fp32 shard copied from the host.
The allocator's record of a 2-GPU run with CPU offload (results/published/h200x2/your-model-sharded-traces):
these side streams reserve 4.9 of its 12.4 GB; on the compute stream the loss's fp32 logits and gradient
(three 1.6 GB segments) are cached and free at the end of backward, when the gradient shards are made, and
the other streams cannot reuse them; replayed on one stream the same requests reserve 7.5 GB.
"""

from __future__ import annotations

from typing import Any

import torch

from fabric_memory_recipes.planning.simulation.allocator import ALLOC_GATHER, ALLOC_REDUCE, ALLOC_SHARD
from fabric_memory_recipes.planning.simulation.tracking import Tracker

CATEGORY = "gradients"


class _Unit:
    __slots__ = ("params", "made")

    def __init__(self, params: int) -> None:
        self.params = params  # its trained parameters: the gradients it waits for
        self.made: list[torch.Tensor] = []  # those whose gradient is made


class ShardedGradients:
    """The gradients of one simulated step of one micro-batch under FSDP2 (with accumulation FSDP keeps the
    unsharded gradients of the micro-batches before the last: not modelled here). ``model``'s modules of the
    classes ``unit_classes`` are the units, every other parameter is the root's; ``narrow``: the compute dtype's
    bytes over the master dtype's (below 1: the reduce-scatter's output is cast); ``offloaded``:
    ``CPUOffloadPolicy``; ``world_size``: N.
    :meth:`gather_buffers` with the weights, :meth:`bind` the fake parameters; :meth:`ready` from the
    post-accumulate-grad hook, :meth:`backward_done` after backward, :meth:`zero_grad` where the step frees
    the gradients."""

    def __init__(
        self,
        model: Any,
        unit_classes: tuple[str, ...],
        tracker: Tracker,
        narrow: float,
        offloaded: bool,
        world_size: int,
    ) -> None:
        self.tracker, self.narrow, self.offloaded, self.world_size = tracker, narrow, offloaded, world_size
        modules = [(n, m) for n, m in model.named_modules() if type(m).__name__ in unit_classes]
        self._unit_of_name = {
            f"{name}.{n}": i for i, (name, module) in enumerate(modules) for n, _ in module.named_parameters()
        }
        self._root = len(modules)
        self._units: list[_Unit] = []
        self._unit_of: dict[int, _Unit] = {}
        self._held: list[tuple[int, int]] = []  # the shards on the reduce-scatter stream: (handle, nbytes)
        self._input: tuple[int, int] | None = None  # the last reduce-scatter input: (handle, nbytes)
        self.offload_waits = False  # offloaded shards kept on the GPU until the end of backward (FSDP1)

    def gather_buffers(self, unit_bytes: int, root_bytes: int, prefetch_units: int) -> None:
        """The gathered units in use at once (``prefetch_units`` units and the root) on the compute stream,
        and the all-gather outputs' segments on the copy-in stream: the root's first, then two units' at a
        time (the held one and the prefetched one, in forward). Those count as reserved, not as allocated:
        the estimate's gathered units stand for the parameters copied out of them."""
        self.tracker.add_constant("gathered_parameters", prefetch_units * unit_bytes + root_bytes)
        for nbytes in (root_bytes, 2 * unit_bytes):
            if nbytes:
                handle = self.tracker.allocate("gathered_parameters", nbytes, kind=ALLOC_GATHER)
                self.tracker.release(handle, "gathered_parameters", nbytes, later=False)

    def bind(self, fake_state: dict[str, torch.Tensor]) -> None:
        """The fake parameters the step trains with, by name (those that train)."""
        trained = {n: t for n, t in fake_state.items() if t.requires_grad}
        index = {n: self._unit_of_name.get(n, self._root) for n in trained}
        units = {i: _Unit(sum(1 for j in index.values() if j == i)) for i in set(index.values())}
        self._units = list(units.values())
        self._unit_of = {id(t): units[index[n]] for n, t in trained.items()}

    def ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient is accumulated; when its unit's are all, the unit is reduce-scattered."""
        unit = self._unit_of[id(p)]
        unit.made.append(p)
        if len(unit.made) == unit.params:
            self._reduce(unit)

    def _reduce(self, unit: _Unit) -> None:
        self._drop_input()  # the previous unit's reduce-scatter is waited for, its input freed
        nbytes = sum(p.numel() * p.element_size() for p in unit.made)  # unsharded, in the compute dtype
        self._input = (self.tracker.allocate("temporaries", nbytes), nbytes)
        for p in unit.made:  # copied into the input and freed
            p.grad = None
        unit.made = []
        output = None
        if self.narrow < 1:  # the reduce-scatter's output in the compute dtype, cast to the master dtype
            out = int(nbytes * self.tracker.scales.get(CATEGORY, 1.0) * self.narrow)  # 1/N, compute dtype
            output = (self.tracker.allocate("temporaries", out, kind=ALLOC_REDUCE), out)
        shard = self.tracker.allocate(CATEGORY, nbytes, kind=ALLOC_REDUCE)
        if output is not None:
            self.tracker.release(output[0], "temporaries", output[1], later=False)
        if self.offloaded and not self.offload_waits:  # copied to the host, the GPU's dropped
            self.tracker.release(shard, CATEGORY, nbytes, later=False)
        else:
            self._held.append((shard, nbytes))

    def _drop_input(self) -> None:
        if self._input is not None:
            self.tracker.release(self._input[0], "temporaries", self._input[1], later=False)
            self._input = None

    def backward_done(self) -> None:
        """The end of backward: units whose every gradient was not made (unused parameters) are reduced with
        those that were; the last reduce-scatter input is freed."""
        for unit in self._units:
            if unit.made:
                self._reduce(unit)
        self._drop_input()
        if self.offloaded:
            self.zero_grad()

    def zero_grad(self) -> None:
        for handle, nbytes in self._held:
            self.tracker.release(handle, CATEGORY, nbytes, later=False)
        self._held = []


class FlatParameterGradients(ShardedGradients):
    """FSDP1's gradients and gathered units on its side streams (the module's docstring): the gradient
    requests of :class:`ShardedGradients`, an offloaded shard kept until the end of backward, and the
    all-gathers' outputs and low-precision shards on streams of their own."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.offload_waits = True

    def gather_buffers(self, unit_bytes: int, root_bytes: int, prefetch_units: int) -> None:
        """The root and ``prefetch_units`` units gathered on the unshard stream, in use for the whole step (the
        parameters compute from them); one more unit's and the root's reserved there in backward; before each
        all-gather the unit's shard in the compute dtype (and, offloaded, its fp32 copy from the host) on the
        low-precision shard stream, the root's the largest."""
        for nbytes in [root_bytes] + [unit_bytes] * prefetch_units:
            if nbytes:
                self.tracker.allocate("gathered_parameters", nbytes, kind=ALLOC_GATHER)
        for nbytes in (unit_bytes, root_bytes):  # reserved, freed again (allocated at most once)
            if nbytes:
                handle = self.tracker.allocate("gathered_parameters", nbytes, kind=ALLOC_GATHER)
                self.tracker.release(handle, "gathered_parameters", nbytes, later=False)
        if self.narrow < 1:
            for nbytes in (root_bytes, unit_bytes):
                self._low_precision_shard(nbytes // self.world_size)

    def _low_precision_shard(self, nbytes: int) -> None:
        """One unit's shard cast to the compute dtype before its all-gather (``nbytes``), from the fp32 shard
        copied from the host when offloaded."""
        shard = self.tracker.allocate("temporaries", nbytes, kind=ALLOC_SHARD)
        if self.offloaded:
            wide = int(nbytes / self.narrow)
            copied = self.tracker.allocate("temporaries", wide, kind=ALLOC_SHARD)
            self.tracker.release(copied, "temporaries", wide, later=False)
        self.tracker.release(shard, "temporaries", nbytes, later=False)


def side_streams(model: Any, plan: Any, tracker: Tracker, narrow: float) -> ShardedGradients:
    """The side streams' model of ``plan``'s sharding: FSDP1's (sharding "fsdp") or FSDP2's; ``narrow``: the
    compute dtype's bytes over the master dtype's."""
    kind = FlatParameterGradients if plan.sharding == "fsdp" else ShardedGradients
    return kind(model, plan.shard_units, tracker, narrow, plan.cpu_offload, plan.world_size)

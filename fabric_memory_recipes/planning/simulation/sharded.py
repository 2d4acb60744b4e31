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

FSDP1 (Lightning's ``FSDPStrategy``, sharding "fsdp") keeps its gradient shards on a side stream too, its
post-backward stream (``_saved_grad_shard``; with CPU offload until the end of backward), and frees a unit's
flat gradient after ``record_stream``; its estimate keeps the one-stream model of planning/simulation/
simulate.py (replayed with FSDP1's streams, a committed 4-GPU run of your model came out 12.5 % under its
measured peak reserved, for a reason not found).
"""

from __future__ import annotations

from typing import Any

import torch

from fabric_memory_recipes.planning.simulation.allocator import ALLOC_GATHER, ALLOC_REDUCE
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
    ``CPUOffloadPolicy``.
    :meth:`gather_buffers` with the weights, :meth:`bind` the fake parameters; :meth:`ready` from the
    post-accumulate-grad hook, :meth:`backward_done` after backward, :meth:`zero_grad` where the step frees
    the gradients."""

    def __init__(
        self, model: Any, unit_classes: tuple[str, ...], tracker: Tracker, narrow: float, offloaded: bool
    ) -> None:
        self.tracker, self.narrow, self.offloaded = tracker, narrow, offloaded
        modules = [(n, m) for n, m in model.named_modules() if type(m).__name__ in unit_classes]
        self._unit_of_name = {
            f"{name}.{n}": i for i, (name, module) in enumerate(modules) for n, _ in module.named_parameters()
        }
        self._root = len(modules)
        self._units: list[_Unit] = []
        self._unit_of: dict[int, _Unit] = {}
        self._held: list[tuple[int, int]] = []  # the shards on the reduce-scatter stream: (handle, nbytes)
        self._input: tuple[int, int] | None = None  # the last reduce-scatter input: (handle, nbytes)

    def gather_buffers(self, unit_bytes: int, root_bytes: int) -> None:
        """The all-gather outputs' segments on the copy-in stream: the root's first, then two units' at a
        time (the held one and the prefetched one, in forward). They count as reserved, not as allocated:
        the estimate's gathered units stand for the parameters copied out of them."""
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
        if self.offloaded:  # copied to the host, the GPU's dropped
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

    def zero_grad(self) -> None:
        for handle, nbytes in self._held:
            self.tracker.release(handle, CATEGORY, nbytes, later=False)
        self._held = []

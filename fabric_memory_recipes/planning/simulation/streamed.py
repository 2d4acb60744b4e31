"""Rung 16's weights in the simulated step, where fabric_memory_recipes.training.techniques.weights_offload
(``WeightsOnCPU``) puts them: :class:`StreamedWeights` registers the same hooks on the simulated model and logs
what they do to the device's memory as allocator events (planning/simulation/allocator.py).

- Set-up: the root (every weight outside the streamed units) is resident on the compute stream; each unit's
  device copy is made there once and freed again, which leaves one unit-sized segment cached.
- A unit's copy is allocated on the copy stream when it is fetched (one unit ahead: the next block's while
  the current one runs, in backward the previous block's) and freed after ``record_stream`` for the compute
  stream when the unit is done: its memory is reusable only once the kernels queued so far have run, and
  only by the copy stream. So at most one unit is allocated in the forward pass and two in backward, but
  the copy stream keeps a segment more than that: the unit just freed cannot be reused yet.
- Every gradient is copied out on another stream and freed after ``record_stream`` for it: reusable once
  that copy has run.

When is a block freed after ``record_stream`` reusable? The other stream's events are polled at later
requests, and the simulation cannot time the GPU: it takes the hooks as the clock and the GPU as running at
most one unit behind the host, so a block freed while the host queues one unit is reusable once it starts
queueing the unit after next (:data:`LAG`), and at the end of the step everything is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fabric_memory_recipes.planning.plan import round_bytes
from fabric_memory_recipes.planning.simulation.allocator import ALLOC_COPY
from fabric_memory_recipes.planning.simulation.tracking import Tracker

CATEGORY = "gathered_parameters"  # the component a streamed unit's device copy counts in
LAG = 1  # units the GPU runs behind the host (see the module docstring)


@dataclass
class _Unit:
    index: int  # 1 for the first block (0 is the root), as WeightsOnCPU numbers them
    nbytes: int
    params: int  # how many parameters (gradients to wait for)
    handle: int | None = None  # its device copy's allocation, while it has one
    pending: int = 0
    in_backward: bool = False


class StreamedWeights:
    """The device side of ``WeightsOnCPU(model, units, ...)`` for a simulated step: ``model``'s modules whose
    class is in ``unit_classes`` are the streamed units, their weights ``dtype_bytes`` per element.
    ``setup()`` before the step's state mark; ``with streamed.hooks():`` around the step;
    ``gradient(p)`` from the step's post-accumulate-grad hook, before the gradient is dropped;
    ``step_done()`` at its end."""

    def __init__(self, model: Any, unit_classes: tuple[str, ...], dtype_bytes: int, tracker: Tracker) -> None:
        self.model, self.tracker = model, tracker
        named = [(n, m) for n, m in model.named_modules() if type(m).__name__ in unit_classes]
        self.modules = [m for _, m in named]
        self.units = []
        self._unit_of_name: dict[str, int] = {}  # a streamed parameter's name -> its unit's position
        for i, (name, module) in enumerate(named):
            params = list(dict.fromkeys(module.parameters()))
            nbytes = round_bytes(sum(p.numel() for p in params) * dtype_bytes)
            self.units.append(_Unit(i + 1, nbytes, len(params), pending=len(params)))
            self._unit_of_name.update({f"{name}.{n}": i for n, _ in module.named_parameters()})
        in_units = {id(p) for m in self.modules for p in m.parameters()}
        root = sum(p.numel() for p in model.parameters() if id(p) not in in_units) * dtype_bytes
        buffers = sum(
            b.numel() * (dtype_bytes if b.is_floating_point() else b.element_size()) for b in model.buffers()
        )
        self.root_bytes = round_bytes(root + buffers)  # the root's flat copy and the buffers, on the device
        self._unit_of: dict[int, _Unit] = {}  # id(fake parameter) -> its unit
        self._starts: list[int] = []  # the events logged when each unit started (the hooks' clock)

    def bind(self, fake_state: dict[str, torch.Tensor]) -> None:
        """The fake parameters the step trains with, by name: their gradients tell the units apart."""
        self._unit_of = {
            id(t): self.units[self._unit_of_name[n]] for n, t in fake_state.items() if n in self._unit_of_name
        }

    def setup(self) -> None:
        """The root resident on the compute stream; one unit's copy made and freed there (each unit's is,
        while WeightsOnCPU builds them)."""
        if self.root_bytes:
            self.tracker.allocate(CATEGORY, self.root_bytes)
        if self.units:
            largest = max(u.nbytes for u in self.units)
            self.tracker.release(self.tracker.allocate(CATEGORY, largest), CATEGORY, largest, later=False)

    # ---------------------------------------------------------------------------------- the hooks
    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        handles = [
            self.model.register_forward_pre_hook(lambda m, a: self._fetch_first()),
            self.model.register_forward_hook(lambda m, a, o: self._after_model()),
        ]
        for module, unit in zip(self.modules, self.units, strict=True):
            handles.append(module.register_forward_pre_hook(lambda m, a, u=unit: self._start(u)))
            handles.append(module.register_forward_hook(lambda m, a, o, u=unit: self._after_forward(u, o)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _fetch_first(self) -> None:
        if self.units:
            self._fetch(self.units[0])  # the first block, while the embedding runs

    def _after_model(self) -> None:
        if torch.is_grad_enabled() and self.units:
            self._fetch(self.units[-1])  # backward starts with the last block

    def _start(self, unit: _Unit) -> None:
        self._tick()
        self._fetch(unit)

    def _after_forward(self, unit: _Unit, output: Any) -> None:
        if unit.in_backward:
            return
        self._release(unit)
        if unit.index < len(self.units) and not self.units[unit.index].in_backward:
            self._fetch(self.units[unit.index])
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad, u=unit: self._before_backward(u))

    def _before_backward(self, unit: _Unit) -> None:
        self._tick()
        unit.in_backward = True
        self._fetch(unit)
        if unit.index > 1:
            self._fetch(self.units[unit.index - 2])  # the block backward reaches next

    def gradient(self, p: torch.Tensor) -> None:
        """``p``'s gradient is copied out on another stream and freed after record_stream; a unit whose
        gradients are all out is released."""
        if p.grad is not None:
            self.tracker.free_later(p.grad)
        unit = self._unit_of.get(id(p))
        if unit is None:
            return
        unit.pending -= 1
        if unit.pending == 0:
            unit.pending = unit.params
            self._release(unit)
            unit.in_backward = False

    def step_done(self) -> None:
        """The end of the step: every block freed after record_stream is reusable again."""
        self.tracker.reuse_waiting()
        self._starts = []

    # --------------------------------------------------------------------------------- the memory
    def _fetch(self, unit: _Unit) -> None:
        if unit.handle is None:
            unit.handle = self.tracker.allocate(CATEGORY, unit.nbytes, kind=ALLOC_COPY)

    def _release(self, unit: _Unit) -> None:
        if unit.handle is not None:
            self.tracker.release(unit.handle, CATEGORY, unit.nbytes)
            unit.handle = None

    def _tick(self) -> None:
        """A unit starts: what was freed after record_stream before the unit LAG units back started is
        reusable (the GPU has run that far)."""
        self._starts.append(len(self.tracker.events))
        if len(self._starts) > LAG:
            self.tracker.reuse_waiting(before=self._starts[-1 - LAG])

"""The training step, written once: the micro-batches of an accumulation group, each one's forward pass
and the backward of its loss divided by the group's size, then the optimizer step.

:func:`train_step` is what every path runs: eager training (:func:`fabric_memory_recipes.training.loop.fit`),
fast mode's CUDA graph (``training/graphs.py`` captures this same function and replays it), and the
experiments (``experiments/harness.py``). The schedule is stepped by the loop after each step, eager or
replayed: it is host arithmetic, which a graph cannot capture.

Gradient accumulation is done here once, and done right (rung 05): :func:`accumulation_groups` makes the
optimizer step after the k-th micro-batch of a group (not after the first, the off-by-one that
``batch_idx % k == 0`` gives), and a final partial group at the end of an epoch still steps; each
micro-batch's loss is divided by the size of its group, so the summed gradient is the big batch's mean
gradient; and gradient synchronisation between processes is skipped on all but the last micro-batch of a
group (``fabric.no_backward_sync``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

Region = Callable[[str], contextlib.AbstractContextManager]  # a phase's context: a profiler range, a counter
Record = Callable[[Any, Any, Any], None]  # (the micro-batch's loss, logits, targets), detached


def no_region(name: str) -> contextlib.AbstractContextManager:
    """The phases of a step run in no context of their own."""
    return contextlib.nullcontext()


def train_step(
    fabric,
    model,
    optimizer,
    batch_fn: Callable,
    group: Iterable,
    record: Record | None = None,
    *,
    free_gradients: bool = True,
    region: Region = no_region,
) -> None:
    """One optimizer step over the micro-batches of ``group`` (``len(group)`` of them): forward, the loss
    divided by the group's size, backward, then ``optimizer.step()`` and ``zero_grad``. ``record`` gets
    each micro-batch's loss, logits and targets after its backward; ``region(name)`` wraps the
    ``forward``, ``backward`` and ``optimizer`` phases. ``optimizer`` is None when the update happens
    inside backward (rung 12); ``free_gradients=False`` keeps the ``.grad`` tensors allocated (zeroed),
    as fast mode's graph needs them when it accumulates (graphs.py)."""
    group_size = len(group)
    for j, batch in enumerate(group):
        # rung 05: no gradient all-reduce between processes until the group's last micro-batch
        with fabric.no_backward_sync(model, enabled=j + 1 < group_size):
            with region("forward"):
                loss, logits, targets = batch_fn(model, batch)
            with region("backward"):
                fabric.backward(loss / group_size)  # rung 05: .grad sums to the group's mean
        if record is not None:
            record(loss.detach().float(), None if logits is None else logits.detach(), targets)
    if optimizer is not None:  # rung 12: None, each parameter stepped inside backward
        with region("optimizer"):
            optimizer.step()
            # frees gradient memory before the next forward (fast mode may keep it: graphs.py)
            optimizer.zero_grad(set_to_none=free_gradients)


class Group:
    """The micro-batches of one optimizer step, ``size`` of them from index ``first`` of epoch ``epoch``,
    read from the loader as the step needs them (a step holds one micro-batch at a time, as a loop over
    the loader would). Iterate it once."""

    def __init__(self, epoch: int, first: int, size: int, batch: Any, rest: Iterator) -> None:
        self.epoch, self.first, self.size = epoch, first, size
        self._batch, self._rest = batch, rest

    @property
    def last(self) -> int:
        """The index in the epoch of the group's last micro-batch."""
        return self.first + self.size - 1

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Any]:
        batch, self._batch = self._batch, None  # handed out, no longer held here
        yield batch
        for _ in range(self.size - 1):
            yield next(self._rest)[2]


def accumulation_groups(
    micro_batches: Iterator[tuple[int, int, Any]], k: int, num_batches: int
) -> Iterator[Group]:
    """The ``(epoch, index, batch)`` micro-batches of ``num_batches``-long epochs in groups of ``k``, one
    optimizer step each (rung 05). Each group starts at a multiple of ``k`` (a resumed run restarts at a
    step's end)."""
    for epoch, i, batch in micro_batches:  # the first micro-batch of a group
        # rung 05: the step comes after the k-th micro-batch; the last group of an epoch may be short
        yield Group(epoch, i, min(k, num_batches - i), batch, micro_batches)

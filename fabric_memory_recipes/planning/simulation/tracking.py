"""Counting storages: what autograd saves for backward (:class:`SavedTensorCounter`, also used on real
runs) and every storage an op creates, by component, with the weighted peak (``Tracker``); the fake mode
the simulations run under (:class:`FakeMode`)."""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from fabric_memory_recipes.planning.plan import GB, round_bytes


class FakeMode(FakeTensorMode):
    """torch's fake mode, which asks whether CUDA is available once per simulated step.

    FakeTensorMode asks ``torch.cuda.is_available()`` (``avoid_device_init``) for the ops it has no cached
    answer for, hundreds to over a thousand times in one ViT-L/16 step, and with Lightning imported (it sets
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``) each ask loads NVML again (about 0.04 ms on a CPU machine). The
    answer cannot change while a step is simulated."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._avoid_device_init = FakeTensorMode.avoid_device_init.fget(self)

    @property
    def avoid_device_init(self) -> bool:
        return self._avoid_device_init


class _Record:
    __slots__ = ("nbytes", "category", "handle")

    def __init__(self, nbytes: int, category: str, handle: int = -1) -> None:
        self.nbytes = nbytes
        self.category = category
        self.handle = handle  # its allocation's index in Tracker.events (-1: not on the device)


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
        return sum(round_bytes(n) for n in self._seen.values())

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class Tracker(TorchDispatchMode):
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
        self.largest_temporary = 0  # the largest storage created as working memory (a logits-sized block)
        self.events: list[tuple[str, int, int]] = []
        self.marks: dict[str, int] = {}
        self.gradient_handles: set[int] = set()  # the events' allocations that became a .grad
        self._constants: dict[str, list[int]] = defaultdict(list)  # live constant blocks per category

    def mark(self, name: str) -> None:
        self.marks[name] = len(self.events)

    def _device_alloc(self, category: str, nbytes: int) -> int:
        """Log a device allocation of ``nbytes`` at the category's weight; its handle (-1: none)."""
        size = int(self.scales.get(category, 1.0) * nbytes)
        if size <= 0:
            return -1
        self.events.append(("alloc", len(self.events), size))
        return len(self.events) - 1

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
        if rec.handle >= 0:
            self.events.append(("free", rec.handle, 0))
        self._changed()

    def record(self, t: Any, category: str = "temporaries") -> _Record | None:
        """Start counting ``t``'s storage (no-op if it is counted already); return its record."""
        if not isinstance(t, torch.Tensor):
            return None
        st = t.untyped_storage()
        rec = self.records.get(st)
        if rec is None:
            rec = _Record(round_bytes(st.nbytes()), category)
            rec.handle = self._device_alloc(category, rec.nbytes)
            self.records[st] = rec
            self.totals[category] += rec.nbytes
            if category == "temporaries":
                self.largest_temporary = max(self.largest_temporary, rec.nbytes)
            weakref.finalize(st, self._free, rec)
            self._changed()
        return rec

    def retag(self, t: Any, category: str, only_from: tuple[str, ...] | None = None) -> None:
        """Move ``t``'s storage to another component (a temporary that autograd saves, a gradient)."""
        rec = self.record(t, category)
        if rec is not None and category == "gradients" and rec.handle >= 0:
            self.gradient_handles.add(rec.handle)
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
        """Memory the simulation does not create as tensors (workspace, gathered FSDP units): one
        block of ``nbytes``; a negative ``nbytes`` frees the category's last block."""
        if nbytes > 0:
            self._constants[category].append(self._device_alloc(category, nbytes))
        elif nbytes < 0 and self._constants[category]:
            handle = self._constants[category].pop()
            if handle >= 0:
                self.events.append(("free", handle, 0))
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

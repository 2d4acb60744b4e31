"""Counting storages: what autograd saves for backward (:class:`SavedTensorCounter`, also used on real
runs) and every storage an op creates, by component, with the weighted peak (``Tracker``), the gradient
sums of backward made as the autograd engine makes them without a dispatch mode (``Tracker.backward``);
the fake mode the simulations run under (:class:`FakeMode`)."""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from fabric_memory_recipes.planning.plan import GB, round_bytes
from fabric_memory_recipes.planning.simulation.costs import DEVICE_QUERY, OpCosts, fake_device_known


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


# The references that the call into a Python dispatch mode adds to those the engine holds, as the innermost
# mode counts them for an op's first argument: three to the tensor (its way through the dispatcher to the
# Python call) and one to its storage (the Python storage object that ``untyped_storage()`` returns).
# Measured on torch 2.11; tests/planning/simulation/test_gradient_sums.py checks the rule against the engine.
_TENSOR_REFS_IN_DISPATCH = 3
_STORAGE_REFS_IN_DISPATCH = 1


def _summing_slots(root: Any) -> list[Any]:
    """The nodes of ``root``'s backward graph that feed an input which another node feeds too: after such a
    node runs, the engine adds its output into what is already buffered for that input."""
    producers: dict[tuple[Any, int], list[Any]] = defaultdict(list)
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for following, input_nr in node.next_functions:
            if following is not None:
                producers[(following, input_nr)].append(node)
                stack.append(following)
    return list({id(n): n for ps in producers.values() if len(ps) > 1 for n in ps}.values())


def _sums_in_place(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether the autograd engine, with no dispatch mode active, adds ``new`` into ``old`` in place.

    torch/csrc/autograd/input_buffer.cpp, ``accumulate``: the gradient parts that reach one input of a
    backward node are summed ``old.add_(new)`` when grad mode is off (no ``create_graph``), ``old`` is dense
    (not sparse, not a zero tensor, not nested, its strides a permutation of contiguous ones) and the buffer
    holds the only reference to ``old`` and to its storage (``can_accumulate_inplace``); otherwise
    ``old + new``, a new tensor. A part that is a view (a transposed weight's gradient: its base is alive)
    or that another node still holds is summed into a new tensor, on CUDA too. The rule is the same on
    every device; only the streams differ.

    The engine also requires that neither part is "subclass-like", which every tensor is while a dispatch
    mode is active (``at::isTensorSubclassLike``): under the simulation's modes the engine always makes a
    new tensor, where a GPU run without modes sums in place. ``AccumulateGrad`` (a leaf's ``.grad``) has
    no such test: it steals or adds in place under the modes as it does without them.
    """
    if torch.is_grad_enabled() or old is new or old.layout != torch.strided:  # sparse: not modelled
        return False
    if old._is_zerotensor() or old.is_nested or not is_non_overlapping_and_dense_or_false(old):
        return False
    storage = old.untyped_storage()
    return (
        old._use_count() == 1 + _TENSOR_REFS_IN_DISPATCH
        and torch._C._storage_Use_Count(storage._cdata) == 1 + _STORAGE_REFS_IN_DISPATCH
    )


class _Record:
    __slots__ = ("nbytes", "category", "handle", "later")

    def __init__(self, nbytes: int, category: str, handle: int = -1) -> None:
        self.nbytes = nbytes
        self.category = category
        self.handle = handle  # its allocation's index in Tracker.events (-1: not on the device)
        self.later = False  # freed after record_stream: reusable only from a later "reuse" event


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
        self.waiting: list[tuple[int, int]] = []  # (handle, its free's index in events): after record_stream
        self.gradient_handles: set[int] = set()  # the events' allocations that became a .grad
        self._constants: dict[str, list[int]] = defaultdict(list)  # live constant blocks per category
        self._summing: Any = None  # the backward node whose outputs the engine is adding into its buffers
        self.gradient_sums: list[tuple[bool, tuple[int, ...]]] = []  # (in place, shape), in backward's order
        self._costs: OpCosts | None = None  # the collector right below this mode (:meth:`__enter__`)

    def mark(self, name: str) -> None:
        self.marks[name] = len(self.events)

    def _device_alloc(self, category: str, nbytes: int, kind: str = "alloc") -> int:
        """Log a device allocation of ``nbytes`` at the category's weight (``kind``: the stream's event,
        planning/simulation/allocator.py); its handle (-1: none)."""
        size = int(self.scales.get(category, 1.0) * nbytes)
        if size <= 0:
            return -1
        self.events.append((kind, len(self.events), size))
        return len(self.events) - 1

    def allocate(self, category: str, nbytes: int, kind: str = "alloc") -> int:
        """A device block no tensor of the simulation stands for (a streamed unit's weights); its handle."""
        handle = self._device_alloc(category, nbytes, kind)
        self.totals[category] += nbytes
        self._changed()
        return handle

    def release(self, handle: int, category: str, nbytes: int, later: bool = True) -> None:
        """Free a block of :meth:`allocate`; ``later``: after record_stream, reusable from
        :meth:`reuse_waiting` on."""
        if handle >= 0:
            if later:
                self.waiting.append((handle, len(self.events)))
            self.events.append(("free_later" if later else "free", handle, 0))
        self.totals[category] -= nbytes
        self._changed()

    def free_later(self, t: torch.Tensor) -> None:
        """``t``'s storage, when it is freed, is reusable only from :meth:`reuse_waiting` on (record_stream)."""
        rec = self.records.get(t.untyped_storage())
        if rec is not None:
            rec.later = True

    def reuse_waiting(self, before: int | None = None) -> None:
        """The blocks freed after record_stream before event ``before`` (an index in :attr:`events`; default:
        all of them) become reusable."""
        done = [h for h, at in self.waiting if before is None or at < before]
        if done:
            self.waiting = [(h, at) for h, at in self.waiting if before is not None and at >= before]
            self.events.extend(("reuse", handle, 0) for handle in done)

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
            if rec.later:
                self.waiting.append((rec.handle, len(self.events)))
            self.events.append(("free_later" if rec.later else "free", rec.handle, 0))
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

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, its gradient sums made as the engine makes them on a GPU (:func:`_sums_in_place`).

        A post-hook on each node that feeds a shared input marks the moment after the node's own ops, when the
        engine adds the node's outputs into the inputs' buffers: an ``aten.add`` of that node from then on
        is such a sum, and when the rule allows it, it is made in place here, as the engine would."""

        def after_node(grad_inputs: Any, grad_outputs: Any) -> None:
            self._summing = torch._C._current_autograd_node()

        handles = [node.register_hook(after_node) for node in _summing_slots(loss.grad_fn)]
        try:
            loss.backward()
        finally:
            for handle in handles:
                handle.remove()
            self._summing = None

    def _engine_sum(self, func: Any, args: tuple, kwargs: dict | None) -> bool:
        return (
            func is torch.ops.aten.add.Tensor
            and self._summing is not None
            and not kwargs
            and torch._C._current_autograd_node() is self._summing
        )

    def __enter__(self) -> Tracker:
        below = _get_current_dispatch_mode()  # the op-cost collector, when simulate enters it just before
        self._costs = below if isinstance(below, OpCosts) else None
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:  # a tensor's device (autograd's engine asks it of each gradient): no storage
            if self._costs is not None and fake_device_known(args):  # answered as the modes below would
                return self._costs.device_query(args[0])
            return func(*args, **(kwargs or {}))
        if self._engine_sum(func, args, kwargs):
            in_place = _sums_in_place(*args)
            self.gradient_sums.append((in_place, tuple(args[0].shape)))
            if in_place:
                return torch.ops.aten.add_.Tensor(*args)  # the buffered part's storage holds the sum
        out = func(*args, **(kwargs or {}))
        category = self.new_category
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            if self.category_of(args[0]) == "parameters":
                category = "weight_copies"  # autocast's low-precision copy of a weight
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.record(t, category)
        return out

"""Peak reserved memory under expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
which fast mode sets before CUDA starts: ``config.FAST_ALLOCATOR``), and fast mode's CUDA graphs on top.

What the model mirrors (``c10/cuda/CUDACachingAllocator.cpp``, torch 2.11; the default allocator is
planning/simulation/allocator.py):

* Each pool (small: requests up to 1 MiB; large; and a CUDA graph's private pool, which gets expandable
  segments too) has one segment per stream: a virtual address range of about the GPU's memory, into which
  physical pages are mapped as needed (``ExpandableSegment``): 2 MiB pages for the small pool, 20 MiB
  (``kLargeBuffer``) for the large one. Reserved memory is the mapped pages.
* A request, rounded to 512 bytes, takes the smallest free mapped block that fits (``get_free_block``),
  except that a free block followed by unmapped address space counts as large as the space it could grow
  into, so a block that fits without growing wins over it. A block is split whenever at least 512 bytes
  remain, in either pool (``should_split`` under expandable segments).
* When nothing fits, the segment grows (``try_allocate_expandable_block``): at the lowest unmapped range that,
  with the free block just before it, holds the request (``find_expandable_block``; normally the end of the
  segment), pages are mapped for what the free block lacks, rounded up to whole pages (``map_block``).
* A freed block merges with free mapped neighbours. Pages stay mapped until ``torch.cuda.empty_cache()``
  (``release_cached_blocks``), which unmaps every whole page inside a free block, also inside a segment in
  use (``unmap_block``): the difference that matters, the default allocator only releases whole segments.
  (Nor does an out-of-memory retry happen here: an uncapped card.)

:func:`replay_eager` runs :func:`~fabric_memory_recipes.planning.simulation.allocator.replay`'s order (the
weights, then steps, the optimizer state made in the first): a run whose steps are eager under this
setting (fast mode for a text model: compiled blocks, no CUDA graph; rung 14's own setting).
:func:`replay_graphs` runs fast mode's order (training/graphs.py): the weights (and, with accumulation, the
gradients, made once) on the default stream; cuBLAS's workspaces, made by the first step, and
``WARMUP_STEPS`` eager steps on a side stream, with ``empty_cache`` just before the first optimizer step
(the state is laid out in freshly returned pages) and again before the capture; then one step captured
into the graph's private pool, which replays allocate nothing from (rung 11's copies in flight are made
inside each step, so the pool holds them).

Checked: the committed ``--snapshot`` records of two of your model's fast sets (default allocator), replayed
here, reserve what the same sets' unrecorded runs (expandable segments) reserved, to the byte
(tests/planning/simulation/test_expandable_allocator.py); on the ladder's fast rungs the replayed graph pools come within
a 2 MiB page of the measured ones (``extra.cuda_graphs.graph_pool_reserved_gb``) on 9 of 13, and the rest of
the allocator holds up to three 20 MiB pages more than the replay (docs/planner.md).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from fabric_memory_recipes.planning.simulation.allocator import (
    ALLOC_COPY,
    ALLOC_GATHER,
    ALLOC_REDUCE,
    ALLOC_SHARD,
    LARGE_SEGMENT,
    ROUND,
    SMALL_REQUEST,
    SMALL_SEGMENT,
    Event,
    in_use_before,
    replay,
    round_size,
)
from fabric_memory_recipes.training.graphs import WARMUP_STEPS

ADDRESS_SPACE = 1 << 44  # one segment's virtual range (the GPU's memory and an eighth): never filled here
MAIN, GRAPH = "main", "graph"  # the allocator's own pools, and a CUDA graph's private pool
DEFAULT_STREAM, SIDE_STREAM = 0, 1  # fast mode's warm-up and capture run on a side stream
COPY_STREAM = 2  # the stream a step copies on (ALLOC_COPY events: rung 16's streamed weights)
REDUCE_STREAM, GATHER_STREAM, SHARD_STREAM = (
    3,
    4,
    5,
)  # FSDP's reduce-scatter, all-gather, FSDP1's shard streams
SIDE_REQUESTS = {
    ALLOC_COPY: COPY_STREAM,
    ALLOC_REDUCE: REDUCE_STREAM,
    ALLOC_GATHER: GATHER_STREAM,
    ALLOC_SHARD: SHARD_STREAM,
}


def page_size(small: bool) -> int:
    """The physical page an expandable segment maps: 2 MiB (small pool), 20 MiB (large pool)."""
    return SMALL_SEGMENT if small else LARGE_SEGMENT


class _Block:
    __slots__ = ("address", "size", "key", "free", "mapped", "prev", "next")

    def __init__(self, address: int, size: int, key: tuple, mapped: bool = True) -> None:
        self.address, self.size, self.key, self.mapped, self.free = address, size, key, mapped, True
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def splice_after(self, block: _Block) -> None:
        """Put ``self`` between ``block`` and its successor."""
        self.prev, self.next = block, block.next
        if block.next is not None:
            block.next.prev = self
        block.next = self


class ExpandableAllocator:
    """The allocator's bookkeeping under expandable segments, without memory: ``malloc(handle, nbytes)``,
    ``free(handle)``, ``empty_cache()``, and the peaks of allocated and reserved (mapped) bytes. New
    requests go to ``pool`` (:data:`MAIN` or :data:`GRAPH`) on ``stream``; a freed block returns to its own."""

    def __init__(self) -> None:
        self.pool, self.stream = MAIN, DEFAULT_STREAM
        self._free: dict[tuple, list[tuple[int, int]]] = {}  # per pool key: free mapped (size, address)
        self._unmapped: dict[tuple, list[int]] = {}  # per pool key: addresses of unmapped ranges
        self._blocks: dict[int, _Block] = {}  # free mapped and unmapped blocks by address
        self._base: dict[tuple, int] = {}  # each pool key's segment
        self._live: dict[object, _Block] = {}
        self._later: set[object] = set()  # freed after record_stream, returned at their "reuse" event
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.mapped = {MAIN: 0, GRAPH: 0}  # reserved now, per pool

    # ------------------------------------------------------------------------------ the free sets
    def _insert(self, block: _Block) -> None:
        if block.mapped:
            bisect.insort(self._free.setdefault(block.key, []), (block.size, block.address))
        else:
            bisect.insort(self._unmapped.setdefault(block.key, []), block.address)
        self._blocks[block.address] = block

    def _remove(self, block: _Block) -> None:
        if block.mapped:
            pool = self._free[block.key]
            del pool[bisect.bisect_left(pool, (block.size, block.address))]
        else:
            ranges = self._unmapped[block.key]
            del ranges[bisect.bisect_left(ranges, block.address)]
        del self._blocks[block.address]

    def _merge(self, block: _Block, other: _Block | None) -> None:
        """``block`` (in no set) absorbs its neighbour ``other`` when that is free and equally mapped."""
        if other is None or not other.free or other.mapped != block.mapped:
            return
        self._remove(other)
        if other is block.prev:
            block.address, block.prev = other.address, other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        block.size += other.size

    # ------------------------------------------------------------------------------- malloc and free
    def _best_fit(self, key: tuple, size: int) -> _Block | None:
        pool = self._free.get(key, [])
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None

        def reach(
            entry: tuple[int, int],
        ) -> int:  # a block before unmapped space counts as what it can grow to
            block = self._blocks[entry[1]]
            after = block.next
            return block.size + (after.size if after is not None and not after.mapped else 0)

        while i + 1 < len(pool) and reach(pool[i + 1]) < reach(pool[i]):
            i += 1
        block = self._blocks[pool[i][1]]
        self._remove(block)
        return block

    def _map(self, block: _Block, size: int) -> _Block:
        """Map the pages that cover the first ``size`` bytes of the unmapped ``block``; the block, merged
        with its free mapped neighbours, is free in its pool afterwards."""
        page = page_size(block.key[2])
        offset = block.address - self._base[block.key]
        mapped = (math.ceil((offset + size) / page) - offset // page) * page
        self._remove(block)
        if mapped < block.size:
            rest = _Block(block.address + mapped, block.size - mapped, block.key, mapped=False)
            rest.splice_after(block)
            self._insert(rest)
            block.size = mapped
        block.mapped = True
        self.reserved += mapped
        self.mapped[block.key[0]] += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert(block)
        return block

    def _grow(self, key: tuple, size: int) -> _Block:
        """A free block of at least ``size`` bytes made by mapping pages (``try_allocate_expandable_block``)."""
        found = None
        for address in self._unmapped.get(key, []):
            block = self._blocks[address]
            if block.prev is not None and block.prev.free:  # the free block in front grows into it
                block = block.prev
            room, b = 0, block
            while room < size and b is not None and b.free:
                room, b = room + b.size, b.next
            if room >= size:
                found = block
                break
        if found is None:  # the pool's first request on this stream: its segment, all unmapped
            self._base[key] = base = (len(self._base) + 1) * 2 * ADDRESS_SPACE
            found = _Block(base, ADDRESS_SPACE, key, mapped=False)
            self._insert(found)
        if not found.mapped:
            found = self._map(found, min(found.size, size))
        while found.size < size:
            found = self._map(found.next, min(size - found.size, found.next.size))
        self._remove(found)
        return found

    def malloc(self, handle: object, nbytes: int) -> None:
        size = round_size(nbytes)
        key = (self.pool, self.stream, size <= SMALL_REQUEST)
        block = self._best_fit(key, size) or self._grow(key, size)
        if block.size - size >= ROUND:
            rest = _Block(block.address + size, block.size - size, key)
            rest.splice_after(block)
            self._insert(rest)
            block.size = size
        block.free = False
        self._live[handle] = block
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, handle: object) -> None:
        block = self._live.pop(handle, None)
        if block is None:  # allocated before the replay started (not modelled)
            return
        self.allocated -= block.size
        block.free = True
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: every whole page inside a free block is unmapped."""
        for key, pool in list(self._free.items()):
            page, base = page_size(key[2]), self._base[key]
            for _, address in list(pool):
                block = self._blocks[address]
                end = block.address + block.size
                first = base + math.ceil((block.address - base) / page) * page
                last = base + (end - base) // page * page
                if first >= last:
                    continue
                self._remove(block)
                if first > block.address:  # the part of a page in use stays mapped, free
                    before = _Block(block.address, first - block.address, key)
                    before.prev, before.next = block.prev, block
                    if block.prev is not None:
                        block.prev.next = before
                    block.prev = before
                    self._insert(before)
                if end > last:
                    after = _Block(last, end - last, key)
                    after.splice_after(block)
                    self._insert(after)
                block.address, block.size, block.mapped = first, last - first, False
                self.reserved -= block.size
                self.mapped[key[0]] -= block.size
                self._merge(block, block.prev)
                self._merge(block, block.next)
                self._insert(block)

    def run(self, events: Iterable[Event], tag: object = None, keep: int = 0, skip=frozenset()) -> None:
        """Apply ``events`` as :meth:`CachingAllocator.run` does; handles in ``skip`` are left out."""
        for kind, handle, nbytes in events:
            if handle in skip:
                continue
            key = handle if handle < keep else (tag, handle)
            if kind == "alloc":
                self.malloc(key, nbytes)
            elif kind in SIDE_REQUESTS:  # a request of a side stream: its own segment
                stream, self.stream = self.stream, SIDE_REQUESTS[kind]
                self.malloc(key, nbytes)
                self.stream = stream
            elif kind == "free_later":  # after record_stream: its block returns at its "reuse"
                self._later.add(key)
            elif kind == "reuse":
                if key in self._later:
                    self._later.discard(key)
                    self.free(key)
            else:
                self.free(key)


# ------------------------------------------------------------------------------------- the replays
def replay_eager(events: list[Event], marks: dict[str, int], steps: int = 3) -> ExpandableAllocator:
    """:func:`~fabric_memory_recipes.planning.simulation.allocator.replay`'s order under expandable
    segments, on one stream: eager steps (fast mode of a text model, whose steps are not captured)."""
    return replay(events, marks, steps, ExpandableAllocator())


def replay_graphs(
    events: list[Event], marks: dict[str, int], kept: frozenset[int] = frozenset(), stepped: bool = True
) -> ExpandableAllocator:
    """Fast mode's order under expandable segments (training/graphs.py's ``StepGraph``): the weights on the
    default stream, and the step's allocations ``kept`` (the gradients, with accumulation: made once before
    the warm-up, zeroed instead of freed); the warm-up steps on a side stream, ``empty_cache`` before the
    first optimizer step (``stepped``: an optimizer steps after backward, not inside it) and before the
    capture; the captured step in the graph's private pool."""
    state, step, update, end = marks["state"], marks["step"], marks["update"], marks["end"]
    workspace, window = marks.get("workspace", state), marks.get("window", state)
    in_flight = events[window:state]  # offloaded activations' copies: made and dropped inside each step
    dropped = [("free", handle, 0) for _, handle, _ in in_flight]
    allocator = ExpandableAllocator()
    allocator.run(events[:workspace], keep=step)
    allocator.run((e for e in events[step:end] if e[0] == "alloc" and e[1] in kept), keep=step)
    allocator.stream = SIDE_STREAM
    allocator.run(events[workspace:window], keep=step)  # cuBLAS's workspaces, made by the first step
    for i in range(WARMUP_STEPS + 1):
        if i == WARMUP_STEPS:  # the capture
            allocator.empty_cache()
            allocator.pool = GRAPH
        allocator.run(in_flight, tag=i, keep=window)
        allocator.run(events[step:update], tag=i, keep=step, skip=kept)
        if i == 0:
            if stepped:
                allocator.empty_cache()
            allocator.run(events[state:step], keep=step)
        allocator.run(events[update:end], tag=i, keep=step, skip=kept)
        allocator.run(dropped, tag=i, keep=window)
    return allocator


def peaks_reserved(
    events: list[Event], marks: dict[str, int], kept: frozenset[int] = frozenset(), stepped: bool = True
) -> dict[str, int]:
    """Peak reserved bytes of the simulated step under each allocator setting a run may have
    (``plan.ALLOCATORS``): the default allocator, expandable segments with eager steps, and fast mode's
    CUDA graphs (``kept`` and ``stepped``: :func:`replay_graphs`)."""
    return {
        "default": replay(events, marks).peak_reserved,
        "expandable": replay_eager(events, marks).peak_reserved,
        "graphs": replay_graphs(events, marks, kept, stepped).peak_reserved,
    }


def replay_recorded_expandable(snapshot: dict) -> ExpandableAllocator:
    """A run's own record of its requests (``torch.cuda.memory._snapshot()``, as ``--snapshot`` writes it,
    under either allocator setting) replayed under expandable segments: the blocks in use when the
    recording started, in address order, then every allocation and completed free of the first device's
    trace. What the run's requests would have reserved with expandable segments."""
    model = ExpandableAllocator()
    for address, size in sorted(in_use_before(snapshot).items()):
        model.malloc(address, size)
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            model.malloc(e["addr"], e["size"])
        elif e["action"] == "free_completed":
            model.free(e["addr"])
    return model

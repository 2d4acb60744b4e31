"""Peak *reserved* memory: the simulated step's allocations and frees replayed through a model of
PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, default settings: no
``PYTORCH_CUDA_ALLOC_CONF``, no expandable segments). Expandable segments, which fast mode sets, and fast
mode's CUDA graphs are modelled in planning/simulation/expandable.py.

Reserved memory is what the allocator took from the driver (``cudaMalloc``'d segments) and keeps
cached; it exceeds the peak allocated when freed blocks cannot be reused for later requests. That
depends on the sizes and the order of the step's tensors, not on a ratio: a model whose activations
come in many sizes (a ResNet's feature maps halve in area and double in channels per stage) strands
more than a ViT, whose blocks repeat one set of sizes. The rules modelled here:

* every request is rounded up to a multiple of 512 bytes;
* requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from
  the large pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded up to
  2 MiB otherwise;
* a request takes the smallest cached free block of its pool that is large enough (best fit, the
  lowest address among equals), and only when none is does the allocator reserve a new segment;
* a block larger than the request is split when the remainder is at least 512 bytes (small pool) or
  more than 1 MiB (large pool): the request takes the front, the remainder stays free;
* a freed block merges with free neighbours of its segment; segments are never released (no
  ``empty_cache``, no out-of-memory retry: an uncapped card);
* every segment belongs to the stream whose request made it, and a request is served only from its own
  stream's free blocks (the blocks are ordered by stream before size): memory one stream freed is never
  handed to another;
* a block freed after ``record_stream`` was called on it for another stream (``tensor.record_stream``) counts as
  freed at once (``torch.cuda.memory_allocated`` drops), but goes back to its pool only once the kernels
  that other stream had queued have run (an event per stream, polled at later requests): until then
  nothing can reuse it.

:func:`replay` runs a real run's order: the weights, then steps. The first step creates the optimizer
state at its optimizer step, after that step's forward and backward have fragmented the pool; later
steps reuse the cached segments. Checked against the allocator's own record of a committed run
(``results/published/h100/snapshot/``: its trace replayed here reserves the segments the GPU reserved,
tests/planning/simulation/test_allocator.py) and against the committed runs' measured peaks (docs/your_model.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

ROUND = 512  # kMinBlockSize: every block is a multiple of this
SMALL_REQUEST = 1 << 20  # kSmallSize: requests up to 1 MiB come from the small pool
SMALL_SEGMENT = 2 << 20  # kSmallBuffer
LARGE_SEGMENT = 20 << 20  # kLargeBuffer: the segment of a request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger segments are the request rounded up to this

# The margin over the replay: the largest measured/replayed peak reserved of the committed single-GPU
# eager runs (python -m fabric_memory_recipes.planning.reserved prints them all; rerun it when they change).
RESIDUAL = 1.036
RESIDUAL_SOURCE = "published/h100/estimate/eager/04_lower_batch_size.json (4.905 GB measured, 4.737 replayed)"

# The stream that runs the kernels (the current stream of the step), a side stream the step copies on,
# FSDP's side streams of the reduce-scatters and of the all-gathers' outputs, and FSDP1's stream that makes a
# unit's low-precision shard before its all-gather (planning/simulation/sharded.py).
COMPUTE, COPY, REDUCE, GATHER, SHARD = "compute", "copy", "reduce", "gather", "shard"

# An event of the simulated step: ("alloc", handle, nbytes), a request on the compute stream; ("alloc_copy",
# handle, nbytes), a request on the copy stream; ("alloc_reduce", ...) and ("alloc_gather", ...), requests on
# FSDP's reduce-scatter and all-gather streams, ("alloc_shard", ...) on FSDP1's low-precision shard stream;
# ("free", handle, 0); ("free_later", handle, 0), a free after record_stream: allocated at once, reusable from
# its ("reuse", handle, 0) on.
Event = tuple[str, int, int]
ALLOC_COPY, ALLOC_REDUCE, ALLOC_GATHER, ALLOC_SHARD = (
    "alloc_copy",
    "alloc_reduce",
    "alloc_gather",
    "alloc_shard",
)
ALLOCATES = {
    "alloc": COMPUTE,
    ALLOC_COPY: COPY,
    ALLOC_REDUCE: REDUCE,
    ALLOC_GATHER: GATHER,
    ALLOC_SHARD: SHARD,
}


def round_size(nbytes: int) -> int:
    return ROUND if nbytes < ROUND else -(-nbytes // ROUND) * ROUND


def segment_size(nbytes: int) -> int:
    """The bytes the allocator reserves when no cached block fits a (rounded) request."""
    if nbytes <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("address", "size", "small", "free", "prev", "next", "stream")

    def __init__(self, address: int, size: int, small: bool, stream: str = COMPUTE) -> None:
        self.address, self.size, self.small, self.free, self.stream = address, size, small, True, stream
        self.prev: _Block | None = None
        self.next: _Block | None = None


class CachingAllocator:
    """The allocator's bookkeeping without memory: ``malloc(handle, nbytes, stream)``, ``free(handle)``,
    ``free_later(handle)`` and ``reuse(handle)`` (a free after record_stream), and the peaks of allocated
    and reserved bytes."""

    def __init__(self) -> None:
        # free (size, address) per pool: the compute stream's by small/large, another stream's by (stream, small)
        self._pools: dict[object, list[tuple[int, int]]] = {True: [], False: []}
        self._free: dict[tuple[int, int], _Block] = {}
        self._live: dict[object, _Block] = {}
        self._waiting: dict[object, _Block] = {}  # freed, not reusable yet
        self._next_address = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.reserved_by_stream: dict[str, int] = {}  # the segments each stream made, in bytes

    @staticmethod
    def _pool_key(stream: str, small: bool) -> object:
        return small if stream == COMPUTE else (stream, small)

    def _insert(self, block: _Block) -> None:
        key = (block.size, block.address)
        bisect.insort(self._pools.setdefault(self._pool_key(block.stream, block.small), []), key)
        self._free[key] = block

    def _remove(self, block: _Block) -> None:
        key = (block.size, block.address)
        pool = self._pools[self._pool_key(block.stream, block.small)]
        del pool[bisect.bisect_left(pool, key)]
        del self._free[key]

    def add_segment(
        self, address: int, size: int, small: bool, live: dict[object, tuple[int, int]], stream: str = COMPUTE
    ) -> None:
        """A segment of ``stream`` reserved before the replay starts (a recorded trace that begins mid-run),
        with its blocks in use: ``live`` maps a handle to (address, size); the gaps are cached free blocks."""
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self._next_address = max(self._next_address, address + size + ROUND_LARGE)
        parts = sorted((a, n, h) for h, (a, n) in live.items())
        gaps = [(a, n, None) for (a, n) in _gaps(address, size, [(a, n) for a, n, _ in parts])]
        prev = None
        for start, n, handle in sorted(parts + gaps, key=lambda p: p[0]):
            block = _Block(start, n, small, stream)
            block.prev = prev
            if prev is not None:
                prev.next = block
            prev = block
            if handle is None:
                self._insert(block)
            else:
                block.free = False
                self._live[handle] = block
                self.allocated += n

    def _segment_address(self, size: int) -> int:
        """Where a new segment of ``size`` bytes starts: above every earlier one. Only the order matters: it
        breaks ties between free blocks of one size (the lowest address wins)."""
        address = self._next_address
        self._next_address += size + ROUND_LARGE
        return address

    def malloc(self, handle: object, nbytes: int, stream: str = COMPUTE) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_REQUEST
        pool = self._pools.get(self._pool_key(stream, small), [])
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):  # best fit among the stream's cached free blocks
            block = self._free[pool[i]]
            self._remove(block)
        else:  # a new segment (addresses of different segments are never adjacent)
            block = _Block(self._segment_address(segment_size(size)), segment_size(size), small, stream)
            self.reserved += block.size
            self.reserved_by_stream[stream] = self.reserved_by_stream.get(stream, 0) + block.size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if remaining >= ROUND if small else remaining > SMALL_REQUEST:
            rest = _Block(block.address + size, remaining, small, stream)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.free = False
        self._live[handle] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free_later(self, handle: object) -> None:
        """Freed after record_stream: no longer allocated, but not reusable before :meth:`reuse`."""
        block = self._live.pop(handle, None)
        if block is not None:
            self.allocated -= block.size
            self._waiting[handle] = block

    def reuse(self, handle: object) -> None:
        """The other stream has run past the block freed by :meth:`free_later`: it joins its pool."""
        block = self._waiting.pop(handle, None)
        if block is not None:
            self._give_back(block)

    def free(self, handle: object) -> None:
        block = self._live.pop(handle, None)
        if block is None:  # allocated before the replay started (not modelled)
            return
        self.allocated -= block.size
        self._give_back(block)

    def _give_back(self, block: _Block) -> None:
        """A freed block joins its pool, merged with the free blocks beside it in its segment."""
        block.free = True
        before, after = block.prev, block.next
        if before is not None and before.free:  # merge into the free block in front
            self._remove(before)
            before.size += block.size
            before.next = block.next
            if block.next is not None:
                block.next.prev = before
            block = before
        if after is not None and after.free:  # absorb the free block behind
            self._remove(after)
            block.size += after.size
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
        self._insert(block)

    def run(self, events: Iterable[Event], tag: object = None, keep: int = 0) -> None:
        """Apply ``events``; handles from ``keep`` on are made distinct per ``tag`` (one step's
        tensors are not the next step's), those below it (weights, optimizer state) are shared."""
        for kind, handle, nbytes in events:
            key = handle if handle < keep else (tag, handle)
            if kind in ALLOCATES:
                self.malloc(key, nbytes, ALLOCATES[kind])
            elif kind == "free_later":
                self.free_later(key)
            elif kind == "reuse":
                self.reuse(key)
            else:
                self.free(key)


def _gaps(start: int, size: int, used: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The free stretches of [start, start + size) around the sorted (address, size) blocks ``used``."""
    out, cursor = [], start
    for address, n in used:
        if address > cursor:
            out.append((cursor, address - cursor))
        cursor = address + n
    if cursor < start + size:
        out.append((cursor, start + size - cursor))
    return out


def replay(events: list[Event], marks: dict[str, int], steps: int = 3, allocator: Any = None) -> Any:
    """The simulated step as a run makes it: the weights (``events[:marks["state"]]``), then
    ``steps`` steps (``events[marks["step"]:marks["end"]]``); the first step creates the optimizer
    state (``events[marks["state"]:marks["step"]]``) at its optimizer step (``marks["update"]``).
    ``allocator``: the model that takes them (default: a new :class:`CachingAllocator`)."""
    state, step, update, end = marks["state"], marks["step"], marks["update"], marks["end"]
    allocator = CachingAllocator() if allocator is None else allocator
    allocator.run(events[:state], keep=step)
    for i in range(steps):
        allocator.run(events[step:update], tag=i, keep=step)
        if i == 0:
            allocator.run(events[state:step], keep=step)
        allocator.run(events[update:end], tag=i, keep=step)
    return allocator


def _stream(recorded: int) -> str:
    """A recorded stream: 0 is the default stream, the one a step computes on."""
    return COMPUTE if not recorded else str(recorded)


def in_use_before(snapshot: dict) -> dict[int, int]:
    """The blocks in use when a recorded trace (``torch.cuda.memory._snapshot()``, its first device) started,
    address -> size: freed in it without being allocated in it, or still allocated at its end."""
    trace = snapshot["device_traces"][0]
    allocated_here = {e["addr"] for e in trace if e["action"] == "alloc"}
    before: dict[int, int] = {}
    seen: set[int] = set()
    for e in trace:
        if e["action"] == "alloc":
            seen.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] not in seen:
            before[e["addr"]] = e["size"]
    for segment in snapshot["segments"]:
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and address not in allocated_here:
                before[address] = block["size"]
            address += block["size"]
    return before


def replay_recorded(snapshot: dict) -> tuple[CachingAllocator, list[int], list[int]]:
    """The caching allocator's own record of a run (``torch.cuda.memory._snapshot()``, as ``--snapshot``
    writes it: the first device's trace, and the segments at its end) replayed event by event through
    :class:`CachingAllocator`, each request on its stream (a block returns to its pool at its recorded
    ``free_completed``: after record_stream, once the other stream ran past it). The segments that existed
    before the recording started are taken from the snapshot, with the blocks then in use. Returns the
    model and the sizes of the segments it reserved and of those the GPU reserved, in order: the same
    lists when the model is right."""
    trace = snapshot["device_traces"][0]
    created = [e["size"] for e in trace if e["action"] == "segment_alloc"]
    before = in_use_before(snapshot)
    new_addresses = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    model = CachingAllocator()
    for segment in snapshot["segments"]:
        start, size = segment["address"], segment["total_size"]
        if start not in new_addresses:
            live = {a: (a, n) for a, n in before.items() if start <= a < start + size}
            model.add_segment(
                start, size, segment["segment_type"] == "small", live, _stream(segment["stream"])
            )
    grown = []
    for e in trace:
        if e["action"] == "alloc":
            reserved = model.reserved
            model.malloc(e["addr"], e["size"], _stream(e["stream"]))
            if model.reserved > reserved:
                grown.append(model.reserved - reserved)
        elif e["action"] == "free_completed":
            model.free(e["addr"])
    return model, grown, created

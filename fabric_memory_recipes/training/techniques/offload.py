"""Activation offloading: keep the tensors autograd saves for backward in host memory, not on the GPU,
with the copies beside the compute instead of between its kernels.

``torch.autograd.graph.save_on_cpu(pin_memory=True)`` moves every saved tensor: in torch 2.11 (the
committed results') with a blocking ``copy_`` that makes the host wait each time, and the weights too (a
linear layer saves its weight for backward), which live on the GPU anyway. :class:`offload_activations` leaves
parameters (and views of them) where they are, and overlaps the copies with compute (torchtune's
``OffloadActivations`` is the reference design; this is a smaller one written for this loop):

- **Forward.** Each saved tensor is copied into a pinned host buffer on a side stream ("out"), which
  first waits for the compute stream (the tensor must be written). The GPU tensor is kept alive until
  the compute stream has waited for its copy's event: only then may the caching allocator hand its
  memory to later kernels. At most ``window_bytes`` are kept waiting; beyond that the compute stream
  waits for the oldest copy, which bounds the extra GPU memory (the copies, not the kernels, set the
  pace when PCIe is the slower of the two).
- **Backward.** Saved tensors are unpacked in roughly the reverse order of the forward. Unpacking one
  also *prefetches* the tensors saved before it (the previous block's) on a second side stream ("in"),
  up to ``window_bytes`` ahead, so they cross PCIe while the current block's backward computes. The
  compute stream waits only for the event of the copy it needs. A prefetch buffer is allocated for the
  compute stream, which the "in" stream first waits for, so memory recycled from kernels still queued is
  not overwritten early. Tensors still in the forward's window when backward starts are used in place.
- **Or in the compute stream's order** (``window_bytes=None``, the default; rungs 14 and 16): each copy
  is queued on the compute stream itself, between the kernels, and the GPU tensor is free as soon as
  it is saved. Nothing is kept waiting or prefetched: the least GPU memory, at the copies' time.
- **Batches of copies** (``batched``; eager rung 11, whose ViT-L/16 step is host-bound: 266 offloaded
  tensors per micro-batch, each side-stream copy a stream wait, a switch and an event on the host).
  Copied out once a quarter of the window is pending (and when the forward ends), back once a quarter is
  free: one wait, switch and event per batch each way; pending bytes count in the window. Not batched
  (the default, and fast mode's, whose CUDA graph replays the copies without the host): one at a time.
- **A resident tail.** The last ``resident_bytes`` of a micro-batch's saved tensors (the last blocks',
  which backward needs first) are not offloaded at all: GPU memory traded for PCIe time. How many
  tensors that is comes from the previous micro-batch (the first one offloads everything).
- **Capture-safe.** No host synchronisation anywhere: only event records and stream waits, which a
  CUDA graph records as dependencies (fast mode captures one optimizer step, graphs.py). An autograd
  callback at the end of each backward makes the compute stream wait for every side-stream copy (the
  side streams rejoin the captured stream) and drops what was prefetched but not used.

The host buffers persist: the n-th tensor saved inside a ``with`` block goes to the same pinned buffer
each time (a new one only if its shape or dtype changed), so no pinned memory is allocated per step and
a captured copy keeps writing to valid memory. Create one instance, enter it once per micro-batch, and
run that micro-batch's backward before entering it again (the loop does both). Tensors smaller than
``min_bytes`` stay on the GPU.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


class InlineStream:
    """A stream where every copy has finished when it returns (the CPU): nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    wait_stream = wait_event

    def record_event(self):
        return None


@dataclass
class Streams:
    """The streams of one device: ``compute()`` (the current stream), ``out`` and ``into`` (the copies),
    and ``use(stream)``, the context that makes a stream current."""

    compute: object
    out: object
    into: object
    use: object

    @classmethod
    def for_device(cls, device: torch.device) -> Streams:
        if device.type == "cuda":
            return cls(
                lambda: torch.cuda.current_stream(device),
                torch.cuda.Stream(device),
                torch.cuda.Stream(device),
                torch.cuda.stream,
            )
        inline = InlineStream()
        return cls(lambda: inline, InlineStream(), InlineStream(), lambda _s: contextlib.nullcontext())


@dataclass
class Traffic:
    """Bytes of one micro-batch's saved tensors by where they went (for the results and the tests)."""

    copied_out: int = 0  # device -> host
    copied_in: int = 0  # host -> device, in backward
    resident: int = 0  # the tail, never offloaded
    reused: int = 0  # still on the device when backward needed them: no copy back
    most_waiting: int = 0  # the largest number of bytes kept alive by the forward window
    most_prefetched: int = 0  # the largest number of bytes prefetched and not yet used
    events: list = field(default_factory=list)  # "out n", "in n", "use n": the order (tests)

    def summary(self) -> dict[str, float]:
        """The results' ``extra`` keys, in GB (1e9 bytes). In fast mode the hooks last ran in the capture:
        its last micro-batch is what every replay repeats."""
        return {
            "offloaded_gb_per_micro_batch": self.copied_out / 1e9,
            "offload_copied_back_gb": self.copied_in / 1e9,
            "offload_resident_gb": self.resident / 1e9,
            "offload_reused_gb": self.reused / 1e9,
        }


class offload_activations(torch.autograd.graph.saved_tensors_hooks):
    """``with offload_activations(): loss = model(x)`` - saved activations live in pinned host memory."""

    def __init__(
        self,
        window_bytes: int | None = None,
        resident_bytes: int = 0,
        min_bytes: int = 1 << 16,
        devices: tuple[str, ...] = ("cuda",),
        make_streams=Streams.for_device,
        record: bool = False,
        batched: bool = False,
    ) -> None:
        """``devices``: tensors on these device types are moved out (the tests add "cpu" to exercise the
        mechanics without a GPU: the tensor is then copied to a separate host buffer). ``window_bytes``:
        GPU bytes each side stream may have in flight; None: no side streams, every copy in the compute
        stream's order (the least memory); ``resident_bytes``: the tail kept on the GPU;
        ``batched``: side-stream copies issued in batches of a quarter of the window, one event per batch
        each way (False: one per tensor). ``make_streams(device)``: the tests pass recording streams;
        ``record``: log the order."""
        self.min_bytes, self.devices = min_bytes, devices
        self.window_bytes, self.resident_bytes = window_bytes, resident_bytes
        self.batch_bytes = window_bytes // 4 if batched and window_bytes else 0
        self.make_streams, self.record = make_streams, record
        self.pin = torch.cuda.is_available()
        self.offloaded_bytes = 0  # over every micro-batch (device -> host)
        self.buffers: list[torch.Tensor | None] = []  # the n-th saved tensor's host buffer, kept across steps
        self._sources: list[tuple | None] = []  # (shape, stride, dtype) each buffer was made for
        self._sizes: list[int] = []  # bytes of the n-th saved tensor, last seen
        self._devices: list[torch.device | None] = []  # its device
        self._streams: dict[torch.device, Streams] = {}
        self._forked: set[int] = set()  # ids of the side streams forked from compute since the last join
        self._next = 0
        self._resident_from = None  # slots from here on stay on the device (None: offload all)
        self._pending: list[tuple] = []  # (slot, tensor, host buffer): not copied out yet
        self._written: dict[int, object] = {}  # slot -> event of its copy out
        self._waiting: OrderedDict[int, tuple] = OrderedDict()  # slot -> (tensor, event, compute stream)
        self._fetched: dict[int, tuple] = {}  # slot -> (device tensor, event, compute stream)
        self._pending_bytes = self._held = self._in_flight = 0  # bytes pending, in _waiting, in _fetched
        self._resident: dict[int, torch.Tensor] = {}
        self._cursor: int | None = None  # the next slot to prefetch, going down
        self._compute: dict[torch.device, object] = {}  # the compute stream last seen, per device
        self._released = self._used = (None, _NO_EVENT)  # (stream, event) it last waited for
        self._dirty = self._callback_queued = False  # side-stream work since the streams last rejoined
        self.traffic = Traffic()
        super().__init__(self._pack, self._unpack)

    # ------------------------------------------------------------------------------------- forward
    def __enter__(self):
        if self._dirty:  # a forward whose backward never ran
            self._drop_leftovers()
        total = self._next
        self._next, self.traffic = 0, Traffic()
        self._resident.clear()  # a tail whose backward never ran
        self._resident_from = None
        if self.resident_bytes and total:  # the tail of the last micro-batch, counted from its end
            kept, start = 0, total
            while start > 0 and kept + self._sizes[start - 1] <= self.resident_bytes:
                start -= 1
                kept += self._sizes[start]
            self._resident_from = start
        return super().__enter__()

    def __exit__(self, *exc):
        if self._pending:  # the forward's last batch: its copies start before backward can need them
            self._copy_out(self._pending[0][1].device)
            self._release()
        return super().__exit__(*exc)

    def _streams_and_compute(self, device: torch.device) -> tuple[Streams, object]:
        if device not in self._streams:
            self._streams[device] = self.make_streams(device)
        s = self._streams[device]
        self._compute[device] = s.compute()
        self._dirty = True
        return s, self._compute[device]

    def _pack(self, t: torch.Tensor):
        if t.device.type not in self.devices:
            return t
        nbytes = t.numel() * t.element_size()
        base = t._base if t._base is not None else t
        if nbytes < self.min_bytes or isinstance(base, torch.nn.Parameter):
            return t
        slot, self._next = self._next, self._next + 1
        if slot == len(self.buffers):
            self.buffers.append(None)
            self._sources.append(None)
            self._sizes.append(0)
            self._devices.append(None)
        self._sizes[slot], self._devices[slot] = nbytes, t.device
        host = self._host_buffer(slot, t)  # made even for the tail: no pinned allocation in a later step
        if self._resident_from is not None and slot >= self._resident_from:
            self._resident[slot] = t
            self.traffic.resident += nbytes
            return slot  # a plain int: autograd keeps it, and the garbage collector need not track it
        self.offloaded_bytes += nbytes
        self.traffic.copied_out += nbytes
        if self.window_bytes is None:  # in the compute stream's order: the GPU tensor is free at once
            host.copy_(t, non_blocking=True)
            if self.record:
                self.traffic.events.append(f"out {slot}")
            return slot
        self._pending.append((slot, t, host))
        self._pending_bytes += nbytes
        if self._pending_bytes >= self.batch_bytes:
            self._copy_out(t.device)
        self._release()
        return slot

    def _copy_out(self, device: torch.device) -> None:
        """Copy the pending tensors to their host buffers on the "out" stream, under one event."""
        s, compute = self._streams_and_compute(device)
        self._fork(s.out, compute)  # the tensors have been written
        with s.use(s.out):
            for _slot, t, host in self._pending:
                host.copy_(t, non_blocking=True)
        event = s.out.record_event()
        for slot, t, _host in self._pending:
            self._written[slot] = event
            self._waiting[slot] = (t, event, compute)
            if self.record:
                self.traffic.events.append(f"out {slot}")
        self._held += self._pending_bytes
        self._pending.clear()
        self._pending_bytes = 0

    def _release(self) -> None:
        """Keep at most ``window_bytes`` of tensors alive for their copies (the newest batch may pass it)."""
        keep = 0 if self._pending else 1
        while self._held + self._pending_bytes > self.window_bytes and len(self._waiting) > keep:
            slot, (_tensor, event, stream) = self._waiting.popitem(last=False)
            if (stream, event) != self._released:  # one wait per batch of copies
                stream.wait_event(event)  # the copy has read it: the memory may go back to the compute stream
                self._released = (stream, event)
            self._held -= self._sizes[slot]
        self.traffic.most_waiting = max(self.traffic.most_waiting, self._held + self._pending_bytes)

    def _host_buffer(self, slot: int, t: torch.Tensor) -> torch.Tensor:
        layout = (t.shape, t.stride(), t.dtype)
        if self._sources[slot] != layout:
            # the saved tensor's strides where they are dense: a compiled backward checks the layout it
            # gets back
            self.buffers[slot] = torch.empty_like(t, device="cpu", pin_memory=self.pin)
            self._sources[slot] = layout
        return self.buffers[slot]

    # ------------------------------------------------------------------------------------ backward
    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        slot, device = packed, self._devices[packed]
        if self.window_bytes is None:  # in the compute stream's order
            if self.record:
                self.traffic.events.append(f"use {slot}")
            if slot in self._resident:
                return self._resident.pop(slot)
            self.traffic.copied_in += self._sizes[slot]
            host = self.buffers[slot]
            return torch.empty_like(host, device=device).copy_(host, non_blocking=True)
        if self._pending:  # a backward inside the forward's block: its last copies start now
            self._copy_out(device)
        s, compute = self._streams_and_compute(device)
        if not self._callback_queued:
            self._callback_queued = _queue_callback(self._backward_done)
        if self.record:
            self.traffic.events.append(f"use {slot}")
        if slot in self._resident:  # the tail: never left the device
            tensor = self._resident.pop(slot)
        elif slot in self._waiting:  # not released yet: still on the device, no copy back needed
            tensor, event, _ = self._waiting.pop(slot)
            del self._written[slot]
            self._held -= self._sizes[slot]
            self._use(compute, event)  # its copy out still reads it; the memory is freed on this stream later
            self.traffic.reused += self._sizes[slot]
        else:
            if slot not in self._fetched:  # not prefetched: copied now
                self._copy_in([slot], device, s, compute)
            tensor, event, _ = self._fetched.pop(slot)
            self._in_flight -= self._sizes[slot]
            del self._written[slot]  # used: never fetched again
            self._use(compute, event)
        # the tensors saved before this one (the previous block's) start coming back now
        self._cursor = slot - 1 if self._cursor is None else min(self._cursor, slot - 1)
        self._prefetch(device, s, compute)
        return tensor

    def _use(self, compute, event) -> None:
        if (compute, event) != self._used:  # a batch's event is waited for once
            compute.wait_event(event)  # only for the copy this kernel needs
            self._used = (compute, event)

    def _copy_in(self, slots: list[int], device: torch.device, s: Streams, compute) -> None:
        """Copy ``slots`` back on the "in" stream, under one event."""
        tensors = [torch.empty_like(self.buffers[k], device=device) for k in slots]  # for the compute stream
        self._fork(s.into, compute)  # memory recycled from kernels still queued there is not written early
        written = _NO_EVENT
        for k in slots:
            if self._written[k] is not written:
                written = self._written[k]
                s.into.wait_event(written)  # the copy out of this slot has finished
        with s.use(s.into):
            for k, tensor in zip(slots, tensors, strict=True):
                tensor.copy_(self.buffers[k], non_blocking=True)
        event = s.into.record_event()
        for k, tensor in zip(slots, tensors, strict=True):
            self._fetched[k] = (tensor, event, compute)
            self._in_flight += self._sizes[k]
            self.traffic.copied_in += self._sizes[k]
            if self.record:
                self.traffic.events.append(f"in {k}")

    def _prefetch(self, device: torch.device, s: Streams, compute) -> None:
        """Copy in the slots below the cursor (the previous block's) while under ``window_bytes``; with
        copies still in flight, only once at least ``batch_bytes`` fit (fewer, larger batches)."""
        cursor, chosen, nbytes = self._cursor, [], 0
        while cursor is not None and cursor >= 0:
            # only slots that are on the host and not yet used or on their way
            if cursor in self._written and cursor not in self._fetched and cursor not in self._waiting:
                if self._in_flight + nbytes + self._sizes[cursor] > self.window_bytes:
                    break
                chosen.append(cursor)
                nbytes += self._sizes[cursor]
            cursor -= 1
        if chosen and (nbytes >= self.batch_bytes or not self._in_flight or cursor is None or cursor < 0):
            self._cursor = cursor
            batch, batch_bytes = [], 0
            for slot in chosen:
                batch.append(slot)
                batch_bytes += self._sizes[slot]
                if batch_bytes >= self.batch_bytes:
                    self._copy_in(batch, device, s, compute)
                    batch, batch_bytes = [], 0
            if batch:
                self._copy_in(batch, device, s, compute)
        self.traffic.most_prefetched = max(self.traffic.most_prefetched, self._in_flight)

    def _fork(self, side, compute) -> None:
        """``side`` waits for ``compute``'s work so far, and is joined back at the end of backward."""
        side.wait_stream(compute)
        self._forked.add(id(side))

    def _backward_done(self) -> None:
        """End of backward (an autograd callback): the side streams rejoin the compute stream."""
        self._callback_queued = False
        self._drop_leftovers()

    def _drop_leftovers(self) -> None:
        """Everything on a side stream is waited for by the compute stream it came from (in a CUDA graph
        capture: the side streams rejoin the captured stream), then the references are dropped. Only the
        side streams forked since the last join rejoin: a CUDA graph capture refuses to wait for a stream
        that did no work in it (seen on rung 11: an epoch's shorter last group, whose capture fetched
        nothing back, failed with "dependency created on uncaptured work in another stream")."""
        waited = set()
        for _tensor, event, stream in [*self._fetched.values(), *self._waiting.values()]:
            if id(event) not in waited:  # once per batch of copies
                waited.add(id(event))
                stream.wait_event(event)  # before the memory can be reused by the compute stream
        for device, s in self._streams.items():
            for side in (s.out, s.into):
                if id(side) in self._forked:
                    self._compute[device].wait_stream(side)
        self._forked.clear()
        self._fetched.clear()
        self._waiting.clear()
        self._resident.clear()
        self._written.clear()
        self._held = self._in_flight = 0
        self._released = self._used = (None, _NO_EVENT)
        self._cursor = None
        self._dirty = False
        if self.record:
            self.traffic.events.append("joined")

    def host_bytes(self) -> int:
        """Bytes of the host buffers: what one micro-batch copies out (and back) on its saved tensors."""
        return sum(b.numel() * b.element_size() for b in self.buffers if b is not None)


_NO_EVENT = object()  # what no recorded event is (an InlineStream records None)


def _queue_callback(fn) -> bool:
    """Run ``fn`` when the current backward pass ends (False when not inside one)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(fn)
    except RuntimeError:  # not called from a backward pass
        return False
    return True

"""Activation offloading: keep the tensors autograd saves for backward in host memory, not on the GPU.

``torch.autograd.graph.save_on_cpu(pin_memory=True)`` does this for every saved tensor. In torch 2.11,
the version behind the committed results, it packs with a blocking ``copy_`` that makes the host wait
each time (checked on the GPU machine; later releases copy non-blocking), and in every version it also
copies the weights (a linear layer saves its weight for the backward pass), which live on the GPU
anyway. :class:`offload_activations` differs in two ways:
- parameters (and views of them) are left where they are: copying weights out and back is pure cost;
- the device-to-host copy goes into pinned memory with ``non_blocking=True``. It is queued on the
  compute stream, so it runs in order with the kernels around it and the host never waits. The GPU
  copy can be released at once, because the caching allocator only reuses memory for work queued
  later on the same stream. In backward, each tensor is copied back the same way, just before the
  kernel that needs it.
The copies still share the stream with compute (no overlap); what is saved is GPU memory, at the
price of PCIe time. Tensors smaller than ``min_bytes`` stay on the GPU (not worth a transfer).

The host buffers persist: the n-th tensor saved inside a ``with`` block goes to the same pinned buffer
every time the block is entered (a new one only if its shape or dtype changed). No pinned memory is
allocated per step, and a CUDA graph that captured the copies (fast mode, fabric_memory_recipes/training/graphs.py) keeps
copying to memory that stays valid. So create one instance and enter it once per micro-batch, and
run each micro-batch's backward before entering it again (the training loop does both).
"""

from __future__ import annotations

import torch


class offload_activations(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 (a context manager)
    """``with offload_activations(): loss = model(x)`` - saved activations live in pinned host memory."""

    def __init__(self, min_bytes: int = 1 << 16, devices: tuple[str, ...] = ("cuda",)) -> None:
        """``devices``: tensors on these device types are moved out (the tests add "cpu" to exercise the
        mechanics without a GPU: the tensor is then copied to a separate host buffer)."""
        self.offloaded_bytes = 0
        self.buffers: list[torch.Tensor | None] = []  # the n-th saved tensor's host buffer, kept across steps
        self._sources: list[tuple | None] = []  # (shape, stride, dtype) each buffer was made for
        self._next = 0
        pin = torch.cuda.is_available()

        def pack(t: torch.Tensor):
            base = t._base if t._base is not None else t
            small = t.numel() * t.element_size() < min_bytes
            if t.device.type not in devices or isinstance(base, torch.nn.Parameter) or small:
                return t
            slot, self._next = self._next, self._next + 1
            if slot == len(self.buffers):
                self.buffers.append(None)
                self._sources.append(None)
            layout = (t.shape, t.stride(), t.dtype)
            if self._sources[slot] != layout:
                # the saved tensor's strides where they are dense: a compiled backward checks the layout
                # it gets back
                self.buffers[slot] = torch.empty_like(t, device="cpu", pin_memory=pin)
                self._sources[slot] = layout
            host = self.buffers[slot]
            host.copy_(t, non_blocking=True)
            self.offloaded_bytes += host.numel() * host.element_size()
            return (t.device, host)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=True)

        super().__init__(pack, unpack)

    def __enter__(self):
        self._next = 0  # the saved tensors of this micro-batch reuse the buffers, in order
        return super().__enter__()

    def host_bytes(self) -> int:
        """Bytes of the host buffers: what one micro-batch copies out (and back) on its saved tensors."""
        return sum(b.numel() * b.element_size() for b in self.buffers if b is not None)

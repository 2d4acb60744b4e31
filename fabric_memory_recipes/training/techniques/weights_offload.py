"""Weights on the CPU (rung 16): parameters, gradients and optimizer state in host memory, each block's
weights streamed to the GPU just before it runs, the optimizer step done on the CPU while the GPU works.

What lives where:
- host memory holds the fp32 master weights, their fp32 gradient buffer and the optimizer's state (one
  flat tensor per *unit*: a transformer block, or the "root", every parameter outside the blocks), and
  two pinned copies in the transfer dtype (bf16): the weights to send and the gradients received;
- the GPU holds each unit's weights in the transfer dtype only while the unit runs: the model's own
  parameters are views into one flat buffer per unit whose storage is freed (``resize_(0)``) when the
  unit is done and allocated again when it is needed (in the forward pass and again in backward). The
  root (patch embedding, class token, positions, final norm, head: 0.4 % of ViT-L/16) stays resident.

One step, for a unit: the forward pre-hook makes its weights resident (a host-to-device copy on a side
stream, started one unit ahead: the forward post-hook of block i prefetches block i+1) and frees them
after its forward; a hook on the unit's output fires when backward reaches the unit and fetches them
again (prefetching the unit before it). Each parameter's gradient is copied to host memory by a
post-accumulate-grad hook (on a second side stream) and freed at once; when a unit's last gradient is
out, its GPU weights are freed and a CPU thread runs that unit's optimizer step: bf16 gradient -> fp32,
``optimizer.step()`` on the fp32 master, fp32 -> bf16 into the pinned copy the next forward sends.

Semantics: the update is *not* delayed. Every unit's step uses this step's gradient and is finished
before the unit's weights are sent again (the forward pre-hook waits for it), so the parameters equal
those of an ordinary step of the same optimizer on fp32 master weights whose forward and backward run
in the transfer dtype (tests/training/techniques/test_weights_offload.py checks this on the CPU, and equality with plain
fp32 training when the transfer dtype is float32). The overlap comes from the order: the CPU steps the
units as backward finishes them (the last blocks first) while the GPU runs backward on the earlier ones,
and the thread takes the lowest-numbered unit whose gradients are in, so after backward it steps the
root and block 0 first and the next forward starts while later blocks are still being stepped.

On a CPU (the tests) the same code runs with synchronous copies and no streams. Gradient accumulation is
not possible (each gradient leaves the GPU as soon as it exists).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["WeightsOnCPU", "transfer_dtype"]


def transfer_dtype(precision: str) -> torch.dtype:
    """The dtype Fabric's ``precision`` gives the parameters (what the GPU copies must be): bf16 or fp16 for
    the "-true" half precisions, else fp32 (mixed precision casts inside autocast)."""
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision, torch.float32)


@dataclass
class _Unit:
    index: int  # the CPU thread steps the lowest ready index first: 0 is the root, block i is i + 1
    params: list[torch.nn.Parameter]
    master: torch.Tensor  # fp32, host: the weights the optimizer updates
    host: torch.Tensor  # transfer dtype, pinned: the weights sent to the GPU
    grad_host: torch.Tensor  # transfer dtype, pinned: the gradients received
    device_flat: torch.Tensor  # transfer dtype, on the GPU; the parameters are views into it
    optimizer: torch.optim.Optimizer
    streamed: bool  # False for the root: resident, refreshed after each update
    pending: int = 0  # gradients still to arrive in this backward pass
    current: bool = False  # the GPU copy holds the latest weights
    in_backward: bool = False
    ready: object = None  # CUDA event: the host-to-device copy is done
    copied: object = None  # CUDA event: the gradients are in host memory
    updated: threading.Event = field(default_factory=threading.Event)  # the CPU step is done

    def __post_init__(self) -> None:
        self.pending = len(self.params)
        self.updated.set()


class WeightsOnCPU:
    """Stream ``units`` (modules, in forward order) of ``model`` from host memory; see the module docstring.

    ``make_optimizer(params)`` builds the optimizer of one unit over its fp32 master tensor (e.g.
    ``lambda p: torch.optim.Adam(p, lr=1e-4, fused=True)``: torch's fused Adam has a CPU kernel). The
    model must be on the CPU in fp32 (its weights become the masters); afterwards its parameters are on
    ``device`` in ``dtype``. Call :meth:`finish` before reading :meth:`master_parameters`."""

    def __init__(
        self,
        model: torch.nn.Module,
        units: Sequence[torch.nn.Module],
        device: torch.device | str,
        make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = dtype
        self.names = {p: n for n, p in model.named_parameters()}
        if self.cuda:
            self.main = torch.cuda.current_stream(self.device)
            self.h2d, self.d2h = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        in_units = {p for u in units for p in u.parameters()}
        root = [p for p in model.parameters() if p not in in_units]
        self.units = [self._make_unit(0, root, make_optimizer, streamed=False)]
        self.units += [
            self._make_unit(i + 1, list(u.parameters()), make_optimizer, True) for i, u in enumerate(units)
        ]
        for buffer_name, buffer in list(model.named_buffers()):
            module_name, _, attr = buffer_name.rpartition(".")
            model.get_submodule(module_name).register_buffer(attr, buffer.to(self.device))
        self.wait_s = 0.0  # the main thread waiting for the CPU step: the CPU is the bottleneck
        self.step_s = 0.0  # the CPU thread's busy time
        self.error: BaseException | None = None
        self._queue: list[int] = []
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="cpu-optimizer", daemon=True)
        self._thread.start()
        self._fetch(self.units[0])
        model.register_forward_pre_hook(lambda m, a: self._before_root())
        model.register_forward_hook(lambda m, a, o: self._after_root())
        for i, module in enumerate(units):
            unit = self.units[i + 1]
            module.register_forward_pre_hook(lambda m, a, u=unit: self._use(u))
            module.register_forward_hook(lambda m, a, o, u=unit: self._after_forward(u, o))

    # ------------------------------------------------------------------------------------ set-up
    def _make_unit(self, index: int, params: list, make_optimizer, streamed: bool) -> _Unit:
        params = list(dict.fromkeys(params))  # shared parameters once
        master = (
            torch.cat([p.detach().reshape(-1).float().cpu() for p in params]) if params else torch.zeros(0)
        )
        master.grad = torch.zeros_like(master)
        host = torch.empty(master.shape, dtype=self.dtype, pin_memory=self.cuda)
        host.copy_(master)
        grad_host = torch.empty(master.shape, dtype=self.dtype, pin_memory=self.cuda)
        device_flat = torch.empty(master.shape, dtype=self.dtype, device=self.device)
        unit = _Unit(index, params, master, host, grad_host, device_flat, make_optimizer([master]), streamed)
        offset = 0
        for p in params:
            n = p.numel()
            p.data = device_flat[offset : offset + n].view(p.shape)  # the model's parameter: a view
            sl = slice(offset, offset + n)
            p.register_post_accumulate_grad_hook(lambda p, u=unit, sl=sl: self._grad_ready(u, p, sl))
            offset += n
        if streamed:
            device_flat.untyped_storage().resize_(0)  # no block is resident before it is needed
        return unit

    # ------------------------------------------------------------------------------------- hooks
    def _before_root(self) -> None:
        self._use(self.units[0])
        if len(self.units) > 1:
            self._fetch(self.units[1])  # the first block, while the embedding runs

    def _after_root(self) -> None:
        if torch.is_grad_enabled() and len(self.units) > 1:
            self._fetch(self.units[-1])  # backward starts with the last block

    def _after_forward(self, unit: _Unit, output) -> None:
        if unit.in_backward:  # a checkpointed block's recomputation: its weights are still needed
            return
        self._release(unit)
        following = self.units[unit.index + 1] if unit.index + 1 < len(self.units) else None
        if following is not None and not following.in_backward:
            self._fetch(following)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad, u=unit: self._before_backward(u))

    def _before_backward(self, unit: _Unit) -> None:
        unit.in_backward = True
        self._use(unit)
        if unit.index > 1:
            self._fetch(self.units[unit.index - 1])  # the block backward reaches next

    def _grad_ready(self, unit: _Unit, p: torch.Tensor, sl: slice) -> None:
        grad = p.grad
        if self.cuda:
            self.d2h.wait_stream(self.main)  # after the kernels that made the gradient
            with torch.cuda.stream(self.d2h):
                unit.grad_host[sl].copy_(grad.reshape(-1), non_blocking=True)
            grad.record_stream(self.d2h)  # freed now, reused only once the copy is done
        else:
            unit.grad_host[sl].copy_(grad.reshape(-1))
        p.grad = None
        unit.pending -= 1
        if unit.pending:
            return
        unit.pending = len(unit.params)
        if self.cuda:
            unit.copied = torch.cuda.Event()
            unit.copied.record(self.d2h)
        if unit.streamed:
            self._release(unit)
        unit.in_backward = False
        unit.current = False
        unit.updated.clear()
        with self._cv:
            heapq.heappush(self._queue, unit.index)
            self._cv.notify()

    # ------------------------------------------------------------------------------ the transfers
    def _fetch(self, unit: _Unit) -> None:
        """Start the unit's host-to-device copy (after its CPU step), unless its GPU copy is current."""
        if unit.current:
            return
        if not unit.updated.is_set():
            start = time.perf_counter()
            unit.updated.wait()
            self.wait_s += time.perf_counter() - start
        if self.error is not None:
            raise RuntimeError("the CPU optimizer step failed") from self.error
        storage = unit.device_flat.untyped_storage()
        nbytes = unit.device_flat.numel() * unit.device_flat.element_size()
        if self.cuda:
            with torch.cuda.stream(self.h2d):
                if storage.nbytes() == 0:
                    storage.resize_(nbytes)  # allocated on the copy stream; freed with record_stream
                else:
                    self.h2d.wait_stream(self.main)  # the root: overwritten after its last use
                unit.device_flat.copy_(unit.host, non_blocking=True)
                unit.ready = torch.cuda.Event()
                unit.ready.record(self.h2d)
        else:
            if storage.nbytes() == 0:
                storage.resize_(nbytes)
            unit.device_flat.copy_(unit.host)
        unit.current = True

    def _use(self, unit: _Unit) -> None:
        """The unit's weights are about to be used on the compute stream."""
        self._fetch(unit)
        if self.cuda and unit.ready is not None:
            self.main.wait_event(unit.ready)

    def _release(self, unit: _Unit) -> None:
        if not unit.streamed or unit.device_flat.untyped_storage().nbytes() == 0:
            return
        if self.cuda:
            unit.device_flat.record_stream(self.main)  # reused only after the kernels queued so far
        unit.device_flat.untyped_storage().resize_(0)
        unit.current = False

    # --------------------------------------------------------------------------- the CPU thread
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                index = heapq.heappop(self._queue)
            if index < 0:
                return
            unit = self.units[index]
            start = time.perf_counter()
            try:
                if unit.copied is not None:
                    unit.copied.synchronize()
                unit.master.grad.copy_(unit.grad_host)  # bf16 -> fp32
                unit.optimizer.step()  # on the fp32 master, in host memory
                unit.host.copy_(unit.master)  # fp32 -> bf16: what the next forward sends
            except BaseException as e:
                self.error = e
            finally:
                self.step_s += time.perf_counter() - start
                unit.updated.set()

    # ---------------------------------------------------------------------------------- results
    def finish(self) -> None:
        """Wait for every pending CPU step (before reading the weights, saving, or measuring)."""
        for unit in self.units:
            unit.updated.wait()
        if self.error is not None:
            raise RuntimeError("the CPU optimizer step failed") from self.error

    def close(self) -> None:
        self.finish()
        with self._cv:
            heapq.heappush(self._queue, -1)
            self._cv.notify()
        self._thread.join()

    def master_parameters(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name (views into host memory)."""
        self.finish()
        out = {}
        for unit in self.units:
            offset = 0
            for p in unit.params:
                out[self.names[p]] = unit.master[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
        return out

    def host_bytes(self) -> int:
        """Host memory held: master weights, their gradients, optimizer state, the two pinned copies."""
        total = 0
        for unit in self.units:
            total += 2 * unit.master.numel() * 4 + 2 * unit.host.numel() * unit.host.element_size()
            for state in unit.optimizer.state.values():
                total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
        return total

    def timings(self) -> dict[str, float]:
        return {"cpu_step_s": round(self.step_s, 4), "waited_for_cpu_step_s": round(self.wait_s, 4)}

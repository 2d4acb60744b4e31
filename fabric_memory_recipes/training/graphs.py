"""Fast mode: each optimizer step as one CUDA graph, replayed with a single launch.

Why. At micro-batch 4-16 a ViT-L/16 step is launch-bound: the GPU finishes each small kernel before
Python has launched the next one, so the memory rungs ran several times slower than the GPU allows. A
CUDA graph records every kernel of a step once and replays them all with one launch.

How (``torch.cuda.graph``, PyTorch's whole-network capture):

1. Warm-up. The first ``WARMUP_STEPS`` optimizer steps run eagerly on a side stream: compiled blocks
   are compiled, the optimizer creates its state, cuBLAS its workspaces. After the first one, what the
   graph must *read* rather than bake in becomes a device tensor: the optimizer's step counters (if it
   keeps them on the host) and the learning rates (below), and ``capturable`` is set where an
   optimizer has it; the second step runs that way, eagerly.
2. Capture. One optimizer step - the training step itself (``training/step.py``'s ``train_step``) over
   the micro-batches of an accumulation group read from static input buffers: each forward and backward,
   the optimizer step, the gradients released - is recorded into a graph. The graph allocates from its own memory pool; memory freed inside the step is reused
   inside it, so the pool holds what one eager step holds at its peak. The warm-up's cached blocks are
   returned to the device first (``empty_cache``), so the two never add up.
3. Replay. Each step copies its micro-batches into the static buffers, copies the learning rates the
   schedule computed on the host into the device tensors the graph reads, and replays. A group of
   another size (the last, shorter group of an epoch) gets a graph and buffers of its own.

Learning rates: every param group's ``lr`` is a float for the schedulers (host arithmetic, nothing
synchronises). During capture it is swapped for a 0-dim view of one device vector, so the captured
update kernels read the vector; before each replay the current floats are copied into it (one small
host-to-device copy). The update kernels must accept a tensor learning rate: fused Adam and fused
SGD do (the recipes use ``fused=True``); a foreach SGD would read the tensor on the host and cannot be
captured.

Offloaded activations (rungs 11, 14) are copied into pinned host buffers that persist across steps
(``fabric_memory_recipes.training.techniques.offload``), so the graph's copies always target the same host memory.

Outputs of the graph (the summed loss, the logits and targets of the step) live in the graph's pool
and are overwritten by the next replay: the loop consumes them (accuracy, loss window) right after.

A step that cannot be captured (a forward that copies host data to the GPU: Hugging Face's eager mask for
BLOOM copied a zero from the host in every forward) fails at the capture, before any of it ran. Each
step then runs as the warm-up ran it, without the graph (the compiled blocks stay), after one line that
says why; the results record it (``cuda_graphs.not_captured``). Running out of memory is not that: it
stops the run as eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from fabric_memory_recipes.measurement import device_memory
from fabric_memory_recipes.training.step import train_step

# Eager optimizer steps before the capture: the first compiles and creates state; the second runs with
# device-side step counters (an optimizer that compiles its update recompiles for them here, not in
# the capture).
WARMUP_STEPS = 2


def base_optimizers(optimizer, scheduler) -> list:
    """The torch optimizers a step updates: ``optimizer`` (Fabric's wrapper removed) and, when the step
    happens inside backward, the per-parameter optimizers behind ``scheduler``."""
    found = []
    if optimizer is not None:
        found.append(optimizer)
    schedulers = getattr(scheduler, "schedulers", [scheduler] if scheduler is not None else [])
    found += [s.optimizer for s in schedulers]
    unique = {}
    for opt in found:
        opt = getattr(opt, "optimizer", opt)  # fabric.setup wraps it in a _FabricOptimizer
        unique[id(opt)] = opt
    return list(unique.values())


def move_step_state_to_device(optimizers: list, device: torch.device) -> None:
    """Make optimizer state capturable: 0-dim host tensors in the state (an optimizer's step counter
    kept on the CPU) move to ``device``, and optimizers with a ``capturable`` option get it."""
    for opt in optimizers:
        for group in opt.param_groups:
            if "capturable" in group:
                group["capturable"] = True
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device != device:
                    state[key] = value.to(device)


class LearningRates:
    """Every param group's learning rate mirrored in one device vector that captured kernels read."""

    def __init__(self, optimizers: list, device: torch.device) -> None:
        self.groups = [group for opt in optimizers for group in opt.param_groups]
        self.values = torch.zeros(len(self.groups), dtype=torch.float32, device=device)

    def sync(self) -> None:
        """Copy the current host floats into the device vector (non-blocking, no synchronisation: the
        pinned staging tensor is new each time, and the host allocator keeps it until the copy ran)."""
        host = torch.tensor([float(g["lr"]) for g in self.groups], dtype=torch.float32)
        if self.values.is_cuda:
            host = host.pin_memory()
        self.values.copy_(host, non_blocking=True)

    @contextlib.contextmanager
    def as_tensors(self):
        """During capture each group's ``lr`` is a view of the vector; floats again afterwards."""
        saved = [g["lr"] for g in self.groups]
        for i, group in enumerate(self.groups):
            group["lr"] = self.values[i]
        try:
            yield
        finally:
            for group, value in zip(self.groups, saved, strict=True):
                group["lr"] = value


class StepGraph:
    """One optimizer step (a group's micro-batches + update) captured as a CUDA graph; see the module
    docstring.

    The loop runs the first :data:`WARMUP_STEPS` steps eagerly inside :meth:`warmup` (then calls
    :meth:`warmup_step_done`), and afterwards hands each step's group of micro-batches to :meth:`replay`.
    ``accumulates``: the run's groups have more than one micro-batch. ``capture`` and ``make_graph``
    exist so the CPU tests can drive the same bookkeeping with a stand-in for the CUDA graph.
    """

    def __init__(
        self,
        fabric,
        model,
        optimizer,
        batch_fn: Callable,
        scheduler=None,
        *,
        accumulates: bool,
        make_graph: Callable[[], Any] | None = None,
        capture: Callable | None = None,
    ) -> None:
        self.fabric = fabric
        self.device = fabric.device
        self.model = model
        self.optimizer = optimizer
        self.batch_fn = batch_fn
        self.optimizers = base_optimizers(optimizer, scheduler)
        self.cuda = self.device.type == "cuda"
        self.make_graph = make_graph or torch.cuda.CUDAGraph
        self.capture = capture or self._cuda_capture
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.lrs: LearningRates | None = None
        self.static: dict[int, Any] = {}  # group size n -> its micro-batches, each tensor with a leading n
        self.graphs: dict[int, tuple[Any, tuple]] = {}  # group size -> (graph, outputs)
        self.pool = None
        self.not_captured: str | None = None  # why the step could not be captured: each step runs eagerly
        self.warmup_steps_done = 0
        # With accumulation the gradients must outlive each micro-batch anyway (the eager peak already
        # holds them), so they stay allocated outside the graph and are zeroed in it: the graph's pool,
        # which cannot hand pages back like the main allocator, holds only one micro-batch's activations.
        # Without accumulation (k = 1) they are made and freed inside the step, as eagerly.
        self.persistent_grads = accumulates and optimizer is not None
        if self.persistent_grads:  # made now, in one piece, not among the first backward's activations
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        # The optimizer's state is made in its first step, in memory the first backward just freed; with
        # its blocks scattered among the activations' pages, the pages could not be returned before the
        # capture (measured on an H100, rung 05: 0.5 GB more reserved). Returning the free pages first
        # lets the state be laid out compactly.
        self.released_before_first_step = False
        self._first_step_hook = None
        if optimizer is not None:
            base = getattr(optimizer, "optimizer", optimizer)
            self._first_step_hook = base.register_step_pre_hook(self._release_before_first_step)

    # ----------------------------------------------------------------------------------------- warm-up
    def _release_before_first_step(self, *_) -> None:
        # (removed in warmup_step_done: the optimizer is iterating over its hooks right now)
        if not self.released_before_first_step:
            self.released_before_first_step = True
            if self.cuda:
                torch.cuda.empty_cache()

    @property
    def ready(self) -> bool:
        """True once the warm-up steps are done: from now on steps are replayed."""
        return self.warmup_steps_done >= WARMUP_STEPS

    @contextlib.contextmanager
    def warmup(self):
        """Run an eager warm-up micro-batch or step on the side stream (as capture requires). After the
        first step, the optimizers already read the device learning rates, as they will in the graph
        (an optimizer that compiles its update compiles for them now, not during the capture)."""
        with contextlib.ExitStack() as stack:
            if self.lrs is not None:
                self.lrs.sync()
                stack.enter_context(self.lrs.as_tensors())
            if not self.cuda:
                yield
                return
            current = torch.cuda.current_stream(self.device)
            self.side.wait_stream(current)
            with torch.cuda.stream(self.side):
                yield
            current.wait_stream(self.side)

    def warmup_step_done(self) -> None:
        self.warmup_steps_done += 1
        if self._first_step_hook is not None:
            self._first_step_hook.remove()
            self._first_step_hook = None
        if self.warmup_steps_done == 1:
            move_step_state_to_device(self.optimizers, self.device)
            self.lrs = LearningRates(self.optimizers, self.device)

    # ------------------------------------------------------------------------------------------ replay
    def replay(self, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run one optimizer step over the micro-batches of ``group``: each is copied into the static
        input buffers of its group size, then the graph of that size replays (captured the first time).
        Returns the step's summed micro-batch loss, its logits and its targets (valid until the next
        replay)."""
        size = len(group)
        if self.not_captured is not None:  # as the warm-up ran it: side stream, device learning rates
            with self.warmup():
                return self._run(group)
        for slot, batch in enumerate(group):
            if size not in self.static:
                self.static[size] = tree_map(
                    lambda t: torch.empty((size, *t.shape), dtype=t.dtype, device=t.device), batch
                )
            for buffer, tensor in zip(tree_leaves(self.static[size]), tree_leaves(batch), strict=True):
                buffer[slot].copy_(tensor, non_blocking=True)
        if size not in self.graphs:
            self._capture(size)  # a last, shorter group of an epoch gets its own graph
            if self.not_captured is not None:  # (the group was read into the static buffers)
                with self.warmup():
                    return self._step(size)
        graph, outputs = self.graphs[size]
        self.lrs.sync()
        graph.replay()
        return outputs

    def _capture(self, group_size: int) -> None:
        if not self.graphs:
            if self.cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()  # the warm-up's cached blocks go back before the pool is made
            if self.persistent_grads:
                for p in self.model.parameters():
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
        graph = self.make_graph()
        try:
            with self.lrs.as_tensors():
                outputs = self.capture(graph, lambda: self._step(group_size))
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as error:
            if "captur" not in str(error):  # not the capture's refusal: the step's own error
                raise
            self.not_captured = str(error).splitlines()[0]
            self.fabric.print(
                f"fast mode: the step could not be captured in a CUDA graph ({self.not_captured}); each step"
                " runs without the graph"
            )
            return
        self.graphs[group_size] = (graph, outputs)

    def _cuda_capture(self, graph, body: Callable):
        # All graphs of this run share one pool: they never run at the same time, and each one's
        # outputs are read before another replays. The capture runs on the warm-up's stream: autograd
        # made the parameters' gradient-accumulation nodes there, and a gradient arriving from another
        # stream is a cross-stream use, whose memory the allocator cannot reuse until the capture ends
        # (measured on an H100: the pool grew by one set of gradients per micro-batch).
        # quiet: a whole-device sampler reading through the CUDA runtime would break a global-mode capture
        with device_memory.quiet(), torch.cuda.graph(graph, pool=self.pool, stream=self.side):
            outputs = body()
        self.pool = graph.pool()
        return outputs

    def _step(self, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the graph records: the eager training step, reading the static buffers."""
        static = self.static[group_size]
        return self._run([tree_map(lambda t, j=j: t[j], static) for j in range(group_size)])

    def _run(self, group: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The eager training step over ``group``'s micro-batches: the summed loss, the logits, the targets."""
        losses, logits_, targets_ = [], [], []

        def keep(loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
            losses.append(loss)
            logits_.append(logits)
            targets_.append(targets)

        train_step(
            self.fabric,
            self.model,
            self.optimizer,
            self.batch_fn,
            group,
            keep,
            free_gradients=not self.persistent_grads,
        )
        if any(x is None for x in logits_):  # a loss alone (a text model's graph, the fused loss)
            return torch.stack(losses).sum(), None, None
        return torch.stack(losses).sum(), torch.cat(logits_), torch.cat(targets_)

    def memory(self) -> dict[str, float] | None:
        """GB reserved now by the graphs' pool and by the rest of the allocator (for the results)."""
        if not self.cuda or self.pool is None:
            return None
        pool = rest = 0
        for segment in torch.cuda.memory_snapshot():
            if tuple(segment.get("segment_pool_id", (0, 0))) == tuple(self.pool):
                pool += segment["total_size"]
            else:
                rest += segment["total_size"]
        return {"graph_pool_reserved_gb": pool / 1e9, "other_reserved_gb": rest / 1e9}

    def close(self) -> None:
        """Release the graphs, their pool and the static buffers (before evaluation)."""
        self.graphs.clear()
        self.static.clear()
        self.pool = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

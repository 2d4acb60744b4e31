"""What the training loop (``fabric_memory_recipes.training.loop.fit``) needs besides the lesson: resuming, the progress bar and
loss window, profiling, stopping on a signal, and fast mode's CUDA graph. One :class:`TrainingRun` per
``fit`` holds all of it, so the loop reads as forward, backward, step, schedule, record.

Resumable runs: every ``--checkpoint-every`` optimizer steps, ``fabric.save`` writes the model, the
optimizer, the scheduler, the step, the position in the epoch and the random state that shuffled the
epoch (and the CUDA generators, for dropout on a GPU) to ``<checkpoint-dir>/step-NNNNNN.ckpt``.
``--resume`` restores all of it: the epoch is reshuffled identically and the micro-batches already
trained on are skipped, so the resumed run continues exactly where the interrupted one stopped.
Checkpoints are written atomically and only the newest ``--keep-checkpoints`` stay (fabric_memory_recipes/training/checkpoints.py).

Stopping: a stop request (SIGINT/SIGTERM/SIGUSR1/SIGHUP, fabric_memory_recipes/faults.py) is honoured at the next
optimizer-step boundary, on every process at the same step (:class:`StopCheck`): with
``--checkpoint-on-stop`` a checkpoint is saved there, the measurement window is closed, and
``faults.Interrupted`` is raised for ``lifecycle.run_recipe``.

Fast mode (``--cuda-graphs``, one GPU): the first steps run eagerly inside the graph's warm-up, then
each optimizer step is one replay of a captured CUDA graph (fabric_memory_recipes/training/graphs.py); the warm-up's peak
memory is recorded apart from the steady state's (``RunResults.warmup_done``).

Losses are summed on the device and read every ``--log-every`` steps, not every step, so the host does
not wait for the GPU inside the loop.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torchmetrics.classification import MulticlassAccuracy
from tqdm.auto import tqdm

from fabric_memory_recipes import faults
from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.console import notice
from fabric_memory_recipes.measurement.profiling import Recorder
from fabric_memory_recipes.measurement.results import RunResults
from fabric_memory_recipes.training import checkpoints
from fabric_memory_recipes.training.graphs import WARMUP_STEPS, StepGraph
from fabric_memory_recipes.training.step import Group


def accuracy_metric(device, num_classes: int) -> MulticlassAccuracy:
    # validate_args=False: the checks read tensor values on the host, i.e. synchronise every step.
    return MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False).to(device)


class StopCheck:
    """Agrees on a stop request at optimizer-step boundaries.

    A signal may reach one process only (``kill`` of rank 0, a scheduler signalling one task), so with
    several processes every step boundary all-reduces the local request (MAX over the signal numbers:
    SIGTERM > SIGUSR1 > SIGINT > SIGHUP) and all of them stop after the same step. The reduction is one int32 on
    the CPU through gloo (the default group when it is gloo, else a gloo group made once): no GPU
    synchronisation, a few tens of microseconds on one host. With one process it is a variable read.
    """

    _gloo_groups: dict[int, object] = {}

    def __init__(self, fabric) -> None:
        self.signum = 0
        self._group = None
        self._distributed = (
            getattr(fabric, "world_size", 1) > 1 and dist.is_available() and dist.is_initialized()
        )
        if self._distributed:
            self._group = self._cpu_group()

    @classmethod
    def _cpu_group(cls):
        """None (the default group) when it can reduce CPU tensors, else a gloo group over all ranks."""
        if "gloo" in str(dist.get_backend()):
            return None
        key = id(dist.group.WORLD)
        if key not in cls._gloo_groups:
            cls._gloo_groups[key] = dist.new_group(backend="gloo")
        return cls._gloo_groups[key]

    def check(self) -> bool:
        """True when some process has a stop request (a collective call with several processes: every
        process must call it at the same boundaries)."""
        local = faults.stop_requested() or 0
        if self._distributed:
            flag = torch.tensor([local], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            local = int(flag.item())
        self.signum = local
        return bool(local)


class TrainingRun:
    """The state of one ``fit``: step counters, resume position, loss window, bar, graph, profiler."""

    def __init__(
        self,
        fabric,
        model,
        optimizer,
        scheduler,
        train_loader,
        batch_fn,
        cfg: RunConfig,
        results: RunResults,
        num_classes: int,
    ) -> None:
        self.fabric, self.loader, self.cfg, self.results = fabric, train_loader, cfg, results
        self.num_batches = len(train_loader)
        if self.num_batches == 0:
            raise ValueError(
                "the training loader is empty: the micro-batch is larger than the training split"
            )
        self.total = planned_steps(self.num_batches, cfg.accumulation_steps, cfg.epochs, cfg.max_steps)
        if cfg.max_steps and cfg.max_steps > self.total and fabric.is_global_zero:
            notice(
                f"[steps] --max-steps {cfg.max_steps}: {cfg.epochs} epoch(s) hold {self.total} optimizer steps;"
                f" running {self.total} (--epochs raises the cap)"
            )
        self.train_acc = accuracy_metric(fabric.device, num_classes)
        self.window_loss = torch.zeros((), device=fabric.device)
        self.window_batches = 0
        self.accuracy_seen = False
        self.step, self.start_epoch, self.skip, self.saved = 0, 0, 0, None
        self.stateful = {"model": model}
        if optimizer is not None:
            self.stateful["optimizer"] = optimizer
        if scheduler is not None:
            self.stateful["scheduler"] = scheduler
        if cfg.resume:
            self._restore(cfg.resume)
        self.optimizer = optimizer
        self.bar = tqdm(
            total=self.total,
            initial=self.step,
            desc=results.recipe,
            unit="step",
            disable=not fabric.is_global_zero,
            dynamic_ncols=True,
        )
        self.graph = None
        if cfg.cuda_graphs:  # fast mode
            accumulates = cfg.accumulation_steps > 1
            self.graph = StepGraph(fabric, model, optimizer, batch_fn, scheduler, accumulates=accumulates)
        # the step after which warm-up ends: + the capture step in fast mode; else the first step
        self.warmup_steps = self.step + (WARMUP_STEPS + 1 if self.graph else 1)
        self.recorder = Recorder.for_run(fabric, results).start()
        self.stop = StopCheck(fabric)  # every process stops after the same step
        self.stopping, self.newest = self.stop.check(), cfg.resume  # newest: what a stopped run resumes from
        self.epoch_rng: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------ resume
    def _restore(self, path: str) -> None:
        saved = checkpoints.load(self.fabric, path, self.stateful, self.total)  # model/optimizer/scheduler
        self.step, self.start_epoch, self.skip = saved["step"], saved["epoch"], saved["batch_in_epoch"]
        if saved.get("cuda_rng") is not None and torch.cuda.is_available():
            # dropout on the GPU draws from the CUDA generators; skipped batches never run the model
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        self.results.optimizer_steps, self.results.micro_batches = (
            saved["optimizer_steps"],
            saved["micro_batches"],
        )
        self.results.extra["resumed_from"] = {"path": path, "step": self.step}
        self.saved = saved

    def micro_batches(self) -> Iterator[tuple[int, int, object]]:
        """(epoch, index in the epoch, micro-batch) until the planned steps are done or a stop request
        was honoured; a resumed run's first epoch is reshuffled as it was and skips what was trained."""
        for epoch in range(self.start_epoch, self.cfg.epochs):
            if self.stopping:  # a signal during set-up: stop before the first step
                return
            if hasattr(self.loader, "_num_iter_calls"):
                self.loader._num_iter_calls = (
                    epoch  # Fabric's loader sets a DistributedSampler's epoch from it
                )
            resuming = self.saved is not None and epoch == self.start_epoch
            if resuming:  # the shuffle order of an epoch is drawn from the global RNG when iteration starts
                torch.set_rng_state(self.saved["epoch_rng"])
            self.epoch_rng = torch.get_rng_state()
            for i, batch in enumerate(self.loader):
                if resuming and i < self.skip:
                    if i + 1 == self.skip:
                        torch.set_rng_state(self.saved["rng"])
                    continue
                yield epoch, i, batch
                if self.step >= self.total or self.stopping:
                    return

    def _save_checkpoint(self, epoch: int, batch_in_epoch: int, epoch_rng: torch.Tensor) -> str:
        r = self.results
        state = {
            **self.stateful,
            "step": self.step,
            "epoch": epoch,
            "batch_in_epoch": batch_in_epoch,
            "epoch_rng": epoch_rng,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "optimizer_steps": r.optimizer_steps,
            "micro_batches": r.micro_batches,
        }
        return checkpoints.save(
            self.fabric, self.cfg.checkpoint_dir, self.step, state, self.cfg.keep_checkpoints
        )

    # ---------------------------------------------------------------------------------- fast mode
    @property
    def graph_ready(self) -> bool:
        """Fast mode after its warm-up: from now on every step is a replay."""
        return self.graph is not None and self.graph.ready

    def eager_step(self):
        return self.graph.warmup() if self.graph is not None else contextlib.nullcontext()

    def warmup_step_done(self) -> None:
        if self.graph is not None:
            self.graph.warmup_step_done()

    @property
    def frees_gradients(self) -> bool:
        """``zero_grad(set_to_none=...)``: free them, unless fast mode keeps them (graphs.py)."""
        return self.graph is None or not self.graph.persistent_grads

    # -------------------------------------------------------------------------------- the record
    def region(self, name: str):
        """A labelled range for the profiler (--memory-timeline); free when not recording."""
        return self.recorder.region(name)

    def record(self, loss, logits, targets, micro_batches: int = 1) -> None:
        """One micro-batch's (or a replayed step's summed) loss and predictions, kept on the device."""
        self.results.micro_batches += micro_batches
        self.window_loss += loss
        self.window_batches += micro_batches
        if logits is not None:  # a fused loss makes no logits: no token accuracy
            self.train_acc.update(logits, targets)
            self.accuracy_seen = True

    def _close_window(self) -> float:
        mean = (self.window_loss / max(self.window_batches, 1)).item()
        r = self.results
        if r.loss["first"] is None:
            r.loss["first"] = mean
        r.loss["last"] = mean
        r.loss["curve"].append([self.step, mean])
        r.accuracy["train"] = self.train_acc.compute().item() if self.accuracy_seen else None
        metrics = {"train/loss": mean}
        if r.accuracy["train"] is not None:
            metrics["train/acc"] = r.accuracy["train"]
        if self.optimizer is not None:
            metrics["train/lr"] = float(self.optimizer.param_groups[0]["lr"])
        self.fabric.log_dict(metrics, step=self.step)
        acc = r.accuracy["train"]
        self.bar.set_postfix(loss=f"{mean:.4f}", **({"acc": f"{acc:.3f}"} if acc is not None else {}))
        self.train_acc.reset()
        self.window_loss = torch.zeros((), device=self.fabric.device)
        self.window_batches = 0
        return mean

    def step_done(self, group: Group) -> None:
        """After each optimizer step: count and time it, log, checkpoint, and agree on a stop request."""
        epoch, i = group.epoch, group.last
        self.step += 1
        self.results.step_done()
        if self.step == self.warmup_steps:
            self.results.warmup_done(self.step)  # peak memory so far (compilation, capture) kept apart
        self.recorder.step()
        self.bar.update(1)
        if self.step % self.cfg.log_every == 0:
            self._close_window()
        self.stopping = self.stop.check()
        every = self.cfg.checkpoint_every
        periodic = every and self.step % every == 0
        if (periodic or self.stopping and self.cfg.checkpoint_on_stop) and self.step < self.total:
            if i + 1 == self.num_batches:  # the epoch is done: resume at the next one, nothing to skip
                self.newest = self._save_checkpoint(epoch + 1, 0, torch.get_rng_state())
            else:
                self.newest = self._save_checkpoint(epoch, i + 1, self.epoch_rng)

    def finish(self) -> None:
        """Close the profiler, the graph, the last loss window and the bar; raise ``faults.Interrupted``
        when a stop request ended the run before its last step (at the last one it changes nothing)."""
        self.recorder.close()
        if self.graph is not None:
            self.results.extra["cuda_graphs"] = {
                "graphs": len(self.graph.graphs),
                **(self.graph.memory() or {}),
                **({"not_captured": self.graph.not_captured} if self.graph.not_captured else {}),
            }
            self.graph.close()
        if self.window_batches:
            self._close_window()
        self.bar.close()
        if self.stopping and self.step < self.total:
            raise faults.Interrupted(self.stop.signum, self.step, self.total, self.newest)


def planned_steps(
    num_batches: int, accumulation_steps: int, epochs: int, max_steps: int | None = None
) -> int:
    """Optimizer steps the loop will take: ceil(batches / k) per epoch (a partial group steps too)."""
    total = math.ceil(num_batches / accumulation_steps) * epochs
    return min(total, max_steps) if max_steps else total

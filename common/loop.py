"""The one training loop (and evaluation) every recipe hands its Fabric objects to.

Gradient accumulation is done here once, and done right: the optimizer steps after the k-th micro-batch
of a group (not after the first, the off-by-one that ``batch_idx % k == 0`` gives), each micro-batch's
loss is divided by the size of its group so the summed gradient is the big batch's mean gradient, a
final partial group at the end of an epoch still steps, and gradient synchronisation between processes
is skipped on all but the last micro-batch of a group (``fabric.no_backward_sync``).

Fast mode (``cuda_graphs=True``, one GPU): after a short eager warm-up, each optimizer step - the same
micro-batches, backward passes and update - runs as one CUDA graph (common/graphs.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from common import checkpoints, faults
from common.data import NUM_CLASSES, to_model_input
from common.graphs import WARMUP_STEPS, StepGraph
from common.profiling import Recorder

# batch_fn(model, batch) -> (loss, logits, targets): how a batch becomes a loss; the loop is model-agnostic.
BatchFn = Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def image_classification(image_size: int) -> BatchFn:
    """uint8 images on the device -> resize/normalise on the device -> logits -> cross-entropy."""

    def batch_fn(model, batch):
        images, targets = batch
        logits = model(to_model_input(images, image_size))
        return F.cross_entropy(logits, targets), logits, targets

    return batch_fn


class SchedulerGroup:
    """Several learning-rate schedulers stepped (and checkpointed) as one: with one optimizer per
    parameter (the optimizer step fused into backward) every optimizer has its own schedule."""

    def __init__(self, schedulers) -> None:
        self.schedulers = list(schedulers)

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> dict:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        for scheduler, saved in zip(self.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)


def planned_steps(
    num_batches: int, accumulation_steps: int, epochs: int, max_steps: int | None = None
) -> int:
    """Optimizer steps the loop will take: ceil(batches / k) per epoch (a partial group steps too)."""
    total = math.ceil(num_batches / accumulation_steps) * epochs
    return min(total, max_steps) if max_steps else total


def _accuracy_metric(device, num_classes: int):
    from torchmetrics.classification import MulticlassAccuracy

    # validate_args=False: the checks read tensor values on the host, i.e. synchronise every step.
    return MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False).to(device)


def fit(
    fabric,
    model,
    optimizer,
    train_loader,
    log,
    batch_fn: BatchFn,
    *,
    accumulation_steps: int = 1,
    epochs: int = 1,
    max_steps: int | None = None,
    scheduler=None,
    log_every: int = 10,
    num_classes: int = NUM_CLASSES,
    checkpoint_every: int | None = None,
    checkpoint_dir: str | None = None,
    resume: str | None = None,
    cuda_graphs: bool = False,
    checkpoint_on_stop: bool = False,
    keep_checkpoints: int = 2,
) -> None:
    """Train; every optimizer step is reported to ``log.step_done()`` (an event, no synchronisation).

    ``optimizer`` may be None when the update happens elsewhere (an optimizer step fused into backward
    through parameter hooks): the loop then only counts the steps.
    Losses are summed on the device and read every ``log_every`` steps, not every step, so the host
    does not wait for the GPU inside the loop.
    ``--memory-timeline`` / ``--snapshot`` record the first steps (common/profiling.py); without them
    the recorder does nothing.
    ``cuda_graphs``: fast mode. The first steps run eagerly (warm-up), then every step is one replay of
    a captured CUDA graph (common/graphs.py); the warm-up's peak memory is recorded apart from the
    steady state's (``log.warmup_done``).

    Resumable runs: every ``checkpoint_every`` optimizer steps, ``fabric.save`` writes the model, the
    optimizer, the scheduler, the step, the position in the epoch and the random state that shuffled
    the epoch (and the CUDA generators, for dropout on a GPU) to ``checkpoint_dir/step-NNNNNN.ckpt``.
    ``resume`` (a path) restores all of it: the
    epoch is reshuffled identically and the micro-batches already trained on are skipped, so the
    resumed run continues exactly where the interrupted one stopped. Checkpoints are written atomically
    and only the newest ``keep_checkpoints`` stay (0: all); see common/checkpoints.py.

    A stop request (SIGINT/SIGTERM/SIGUSR1, common/faults.py) is honoured at the next optimizer-step
    boundary, on every process at the same step: with ``checkpoint_on_stop`` a checkpoint is saved
    there, the measurement window is closed, and ``faults.Interrupted`` is raised for ``cli.run``.
    """
    from tqdm.auto import tqdm

    k = accumulation_steps
    num_batches = len(train_loader)
    if num_batches == 0:
        raise ValueError("the training loader is empty: the micro-batch is larger than the training split")
    total = planned_steps(num_batches, k, epochs, max_steps)
    train_acc = _accuracy_metric(fabric.device, num_classes)
    window_loss = torch.zeros((), device=fabric.device)
    window_batches = 0
    step, start_epoch, skip = 0, 0, 0
    stateful = {"model": model}
    if optimizer is not None:
        stateful["optimizer"] = optimizer
    if scheduler is not None:
        stateful["scheduler"] = scheduler
    if resume:
        saved = checkpoints.load(fabric, resume, stateful, total)  # restores model/optimizer/scheduler
        step, start_epoch, skip = saved["step"], saved["epoch"], saved["batch_in_epoch"]
        if saved.get("cuda_rng") is not None and torch.cuda.is_available():
            # dropout on the GPU draws from the CUDA generators; skipped batches never run the model
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        log.optimizer_steps, log.micro_batches = saved["optimizer_steps"], saved["micro_batches"]
        log.extra["resumed_from"] = {"path": resume, "step": step}
    bar = tqdm(
        total=total,
        initial=step,
        desc=log.recipe,
        unit="step",
        disable=not fabric.is_global_zero,
        dynamic_ncols=True,
    )

    def close_window() -> float:
        nonlocal window_loss, window_batches
        mean = (window_loss / max(window_batches, 1)).item()
        if log.loss["first"] is None:
            log.loss["first"] = mean
        log.loss["last"] = mean
        log.loss["curve"].append([step, mean])
        log.accuracy["train"] = train_acc.compute().item()
        metrics = {"train/loss": mean, "train/acc": log.accuracy["train"]}
        if optimizer is not None:
            metrics["train/lr"] = float(optimizer.param_groups[0]["lr"])
        fabric.log_dict(metrics, step=step)
        bar.set_postfix(loss=f"{mean:.4f}", acc=f"{log.accuracy['train']:.3f}")
        train_acc.reset()
        window_loss = torch.zeros((), device=fabric.device)
        window_batches = 0
        return mean

    def save_checkpoint(epoch: int, batch_in_epoch: int, epoch_rng: torch.Tensor) -> str:
        return checkpoints.save(fabric, checkpoint_dir, step, {
            **stateful, "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
            "epoch_rng": epoch_rng, "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "optimizer_steps": log.optimizer_steps, "micro_batches": log.micro_batches,
        }, keep_checkpoints)  # fmt: skip

    model.train()
    graph = StepGraph(fabric, model, optimizer, batch_fn, k, scheduler) if cuda_graphs else None
    warmup_steps = step + (WARMUP_STEPS + 1 if graph else 1)  # + the capture step; else the first step
    recorder = Recorder.for_run(fabric, log).start()
    stop = faults.StopCheck(fabric)  # every process stops after the same step
    stopping, newest = stop.check(), resume  # newest: the checkpoint a stopped run can resume from
    for epoch in range(start_epoch, epochs):
        if stopping:  # a signal during set-up: stop before the first step
            break
        if hasattr(train_loader, "_num_iter_calls"):
            train_loader._num_iter_calls = epoch  # Fabric's loader sets a DistributedSampler's epoch from it
        if resume and epoch == start_epoch:
            # The shuffle order of an epoch is drawn from the global RNG when iteration starts.
            torch.set_rng_state(saved["epoch_rng"])
        epoch_rng = torch.get_rng_state()
        for i, batch in enumerate(train_loader):
            if resume and epoch == start_epoch and i < skip:
                if i + 1 == skip:
                    torch.set_rng_state(saved["rng"])
                continue
            group_size = min(k, num_batches - (i // k) * k)  # the last group of an epoch may be short
            is_step = (i + 1) % k == 0 or i + 1 == num_batches
            if graph is not None and graph.ready:  # fast mode: the graph replays the whole step
                graph.load(i % k, batch)
                if not is_step:
                    continue
                loss_sum, logits, targets = graph.replay(group_size)
                log.micro_batches += group_size
                window_loss += loss_sum
                window_batches += group_size
                train_acc.update(logits, targets)
            else:
                with graph.warmup() if graph is not None else contextlib.nullcontext():
                    with fabric.no_backward_sync(model, enabled=not is_step):
                        with recorder.region("forward"):
                            loss, logits, targets = batch_fn(model, batch)
                        with recorder.region("backward"):
                            fabric.backward(loss / group_size)
                    log.micro_batches += 1
                    window_loss += loss.detach().float()
                    window_batches += 1
                    train_acc.update(logits.detach(), targets)
                    if not is_step:
                        continue
                    if optimizer is not None:
                        with recorder.region("optimizer"):
                            optimizer.step()
                            # frees gradient memory before the next forward (fast mode may keep it: graphs.py)
                            optimizer.zero_grad(set_to_none=graph is None or not graph.persistent_grads)
                if graph is not None:
                    graph.warmup_step_done()
            if scheduler is not None:
                scheduler.step()
            step += 1
            log.step_done()
            if step == warmup_steps:
                log.warmup_done(step)  # peak memory so far (compilation, capture) kept apart
            recorder.step()
            bar.update(1)
            if step % log_every == 0:
                close_window()
            stopping = stop.check()
            periodic = checkpoint_every and step % checkpoint_every == 0
            if (periodic or stopping and checkpoint_on_stop) and step < total:
                if i + 1 == num_batches:  # the epoch is done: resume at the next one, nothing to skip
                    newest = save_checkpoint(epoch + 1, 0, torch.get_rng_state())
                else:
                    newest = save_checkpoint(epoch, i + 1, epoch_rng)
            if step >= total or stopping:
                break
        if step >= total or stopping:
            break
    recorder.close()
    if graph is not None:
        log.extra["cuda_graphs"] = {"graphs": len(graph.graphs), **(graph.memory() or {})}
        graph.close()
    if window_batches:
        close_window()
    bar.close()
    if stopping and step < total:  # a stop at the last step changes nothing: the run is complete
        raise faults.Interrupted(stop.signum, step, total, newest)


@torch.no_grad()
def evaluate(
    fabric, model, loader, batch_fn: BatchFn, max_batches: int | None = None, num_classes: int = NUM_CLASSES
) -> float:
    """Accuracy over ``loader`` (all ranks' shards together), at most ``max_batches`` batches."""
    model.eval()
    acc = _accuracy_metric(fabric.device, num_classes)
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        _, logits, targets = batch_fn(model, batch)
        acc.update(logits, targets)
    model.train()
    return acc.compute().item()


def evaluate_splits(
    fabric,
    model,
    val_loader,
    test_loader,
    batch_fn: BatchFn,
    log,
    max_batches: int | None = None,
    num_classes: int = NUM_CLASSES,
) -> None:
    """Validation and test accuracy into the run's results."""
    log.accuracy["val"] = evaluate(fabric, model, val_loader, batch_fn, max_batches, num_classes)
    log.accuracy["test"] = evaluate(fabric, model, test_loader, batch_fn, max_batches, num_classes)

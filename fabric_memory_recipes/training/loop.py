"""The one training loop (and evaluation) every recipe hands its Fabric objects to.

:func:`fit` is the teaching core: it reads top to bottom like a training script of the article -
forward, backward, accumulation with ``no_backward_sync``, the optimizer step, the schedule, the record -
and every block a rung introduces is marked with that rung (``# rung 05``: gradient accumulation,
``# rung 06``: the schedule, ``# rung 12``: the step inside backward). What a real run needs besides
(resuming, the progress bar and loss window, profiling, stopping on a signal, fast mode's CUDA graph)
is in :class:`fabric_memory_recipes.training.loop_plumbing.TrainingRun`, which the core calls in one line each.

Gradient accumulation is done here once, and done right: the optimizer steps after the k-th
micro-batch of a group (not after the first, the off-by-one that ``batch_idx % k == 0`` gives), each
micro-batch's loss is divided by the size of its group so the summed gradient is the big batch's mean
gradient, a final partial group at the end of an epoch still steps, and gradient synchronisation
between processes is skipped on all but the last micro-batch of a group (``fabric.no_backward_sync``).
"""

from __future__ import annotations

import torch

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.measurement.results import RunResults
from fabric_memory_recipes.training.data import NUM_CLASSES, BatchFn
from fabric_memory_recipes.training.graphs import base_optimizers
from fabric_memory_recipes.training.loop_plumbing import TrainingRun, accuracy_metric, planned_steps

__all__ = ["SchedulerGroup", "evaluate", "evaluate_splits", "fit", "planned_steps", "with_warmup"]


def fit(fabric, model, optimizer, train_loader, batch_fn: BatchFn, cfg: RunConfig, results: RunResults,
        *, scheduler=None, num_classes: int = NUM_CLASSES) -> None:  # fmt: skip
    """Train for ``cfg.epochs`` (at most ``cfg.max_steps`` optimizer steps) with micro-batches of
    ``train_loader`` grouped by ``cfg.accumulation_steps``; ``batch_fn(model, batch)`` returns (loss,
    logits, targets). ``optimizer`` is None when the update happens inside backward (rung 12)."""
    k, num_batches = cfg.accumulation_steps, len(train_loader)
    scheduler = with_warmup(optimizer, scheduler, cfg.warmup_steps)  # --warmup-steps (0: none)
    model.train()
    run = TrainingRun(fabric, model, optimizer, scheduler, train_loader, batch_fn, cfg, results, num_classes)
    for epoch, i, batch in run.micro_batches():  # a resumed run skips what it trained on already
        group_size = min(k, num_batches - (i // k) * k)  # rung 05: the last group of an epoch may be short
        is_step = (i + 1) % k == 0 or i + 1 == num_batches  # rung 05: after the k-th micro-batch
        if run.graph_ready:  # fast mode: one replay of the captured CUDA graph is the whole step
            run.graph.load(i % k, batch)
            if not is_step:
                continue
            loss_sum, logits, targets = run.graph.replay(group_size)
            run.record(loss_sum, logits, targets, micro_batches=group_size)
        else:
            with run.eager_step():  # fast mode's warm-up steps run on the graph's side stream
                # rung 05: no gradient all-reduce between processes until the group's last micro-batch
                with fabric.no_backward_sync(model, enabled=not is_step):
                    with run.region("forward"):
                        loss, logits, targets = batch_fn(model, batch)
                    with run.region("backward"):
                        fabric.backward(loss / group_size)  # rung 05: .grad sums to the group's mean
                run.record(loss.detach().float(), logits.detach(), targets)
                if not is_step:
                    continue
                if optimizer is not None:  # rung 12: None, each parameter stepped inside backward
                    with run.region("optimizer"):
                        optimizer.step()
                        # frees gradient memory before the next forward (fast mode may keep it: graphs.py)
                        optimizer.zero_grad(set_to_none=run.frees_gradients)
            run.warmup_step_done()
        if scheduler is not None:
            scheduler.step()  # rung 06: the learning rate follows its schedule, once per optimizer step
        run.step_done(epoch, i)  # count, time, log, checkpoint; a stop request ends the loop here
    run.finish()  # raises faults.Interrupted if a signal stopped the run before its last step


class SchedulerGroup:
    """Several learning-rate schedulers stepped (and checkpointed) as one: with one optimizer per
    parameter (rung 12: the optimizer step fused into backward) every optimizer has its own schedule."""

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


def with_warmup(optimizer, scheduler, steps: int):
    """``--warmup-steps N``: every optimizer's learning rate rises linearly from 1/N of its value to
    all of it over the first N optimizer steps (torch's ``LinearLR``), multiplied with the rung's own
    schedule, if any: both are chainable schedulers stepped together, so rung 06's cosine still ends at
    zero. Returns ``scheduler`` unchanged when N is 0."""
    optimizers = base_optimizers(optimizer, scheduler)
    if not steps or not optimizers:
        return scheduler
    warm = [torch.optim.lr_scheduler.LinearLR(o, start_factor=1 / steps, total_iters=steps) for o in optimizers]
    own = getattr(scheduler, "schedulers", [] if scheduler is None else [scheduler])  # one flat group
    return SchedulerGroup([*own, *warm])


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # eval mode and no_grad would recompile every compiled graph
def evaluate(
    fabric, model, loader, batch_fn: BatchFn, max_batches: int | None = None, num_classes: int = NUM_CLASSES
) -> float:
    """Accuracy over ``loader`` (all ranks' shards together), at most ``max_batches`` batches. Compiled
    models run their original code here: compiling the evaluation's graphs (another mode, no gradients)
    would cost more start-up time than a few eager batches."""
    model.eval()
    acc = accuracy_metric(fabric.device, num_classes)
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        _, logits, targets = batch_fn(model, batch)
        acc.update(logits, targets)
    model.train()
    return acc.compute().item()


def evaluate_splits(fabric, model, val_loader, test_loader, batch_fn: BatchFn, results: RunResults,
                    max_batches: int | None = None, num_classes: int = NUM_CLASSES) -> None:  # fmt: skip
    """Validation and test accuracy into the run's results."""
    results.accuracy["val"] = evaluate(fabric, model, val_loader, batch_fn, max_batches, num_classes)
    results.accuracy["test"] = evaluate(fabric, model, test_loader, batch_fn, max_batches, num_classes)

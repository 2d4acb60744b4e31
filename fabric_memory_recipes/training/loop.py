"""The one training loop (and evaluation) every recipe hands its Fabric objects to.

:func:`fit` is the teaching core: it reads top to bottom like a training script of the article - group
the micro-batches, run the step (forward, backward, the optimizer step: :func:`train_step`, in
``training/step.py``), step the schedule, record - and every block a rung introduces is marked with that
rung (``# rung 05``: gradient accumulation, ``# rung 06``: the schedule, ``# rung 12``: the step inside
backward). What a real run needs besides (resuming, the progress bar and loss window, profiling,
stopping on a signal, fast mode's CUDA graph) is in
:class:`fabric_memory_recipes.training.loop_plumbing.TrainingRun`, which the core calls in one line each.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from fabric_memory_recipes import faults
from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.measurement.results import RunResults
from fabric_memory_recipes.training.data import NUM_CLASSES, BatchFn
from fabric_memory_recipes.training.graphs import base_optimizers
from fabric_memory_recipes.training.loop_plumbing import (
    StopCheck,
    TrainingRun,
    accuracy_metric,
    planned_steps,
)
from fabric_memory_recipes.training.step import accumulation_groups, train_step
from fabric_memory_recipes.training.techniques.step_in_backward import SchedulerGroup

__all__ = ["evaluate", "evaluate_splits", "fit", "planned_steps", "with_warmup"]


def fit(
    fabric,
    model,
    optimizer,
    train_loader,
    batch_fn: BatchFn,
    cfg: RunConfig,
    results: RunResults,
    *,
    scheduler=None,
    num_classes: int = NUM_CLASSES,
) -> None:
    """Train for ``cfg.epochs`` (at most ``cfg.max_steps`` optimizer steps) with micro-batches of
    ``train_loader`` grouped by ``cfg.accumulation_steps``; ``batch_fn(model, batch)`` returns (loss,
    logits, targets). ``optimizer`` is None when the update happens inside backward (rung 12)."""
    scheduler = with_warmup(optimizer, scheduler, cfg.warmup_steps)  # --warmup-steps (0: none)
    model.train()
    run = TrainingRun(fabric, model, optimizer, scheduler, train_loader, batch_fn, cfg, results, num_classes)
    # rung 05: k micro-batches per optimizer step (a resumed run skips what it trained on already)
    for group in accumulation_groups(run.micro_batches(), cfg.accumulation_steps, len(train_loader)):
        if run.graph_ready:  # fast mode: one replay of the captured CUDA graph is the whole step
            loss_sum, logits, targets = run.graph.replay(group)
            run.record(loss_sum, logits, targets, micro_batches=len(group))
        else:
            with run.eager_step():  # fast mode's warm-up steps run on the graph's side stream
                train_step(  # rungs 05 and 12: step.py
                    fabric,
                    model,
                    optimizer,
                    batch_fn,
                    group,
                    run.record,
                    free_gradients=run.frees_gradients,
                    region=run.region,
                )
            run.warmup_step_done()
        if scheduler is not None:
            scheduler.step()  # rung 06: the learning rate follows its schedule, once per optimizer step
        run.step_done(group)  # count, time, log, checkpoint; a stop request ends the loop here
    run.finish()  # raises faults.Interrupted if a signal stopped the run before its last step


def with_warmup(optimizer, scheduler, steps: int):
    """``--warmup-steps N``: every optimizer's learning rate rises linearly from 1/N of its value to
    all of it over the first N optimizer steps (torch's ``LinearLR``), multiplied with the rung's own
    schedule, if any: both are chainable schedulers stepped together, so rung 06's cosine still ends at
    zero. Returns ``scheduler`` unchanged when N is 0."""
    optimizers = base_optimizers(optimizer, scheduler)
    if not steps or not optimizers:
        return scheduler
    warm = [
        torch.optim.lr_scheduler.LinearLR(o, start_factor=1 / steps, total_iters=steps) for o in optimizers
    ]
    own = getattr(scheduler, "schedulers", [] if scheduler is None else [scheduler])  # one flat group
    return SchedulerGroup([*own, *warm])


def evaluate(
    fabric,
    model,
    loader,
    batch_fn: BatchFn,
    max_batches: int | None = None,
    num_classes: int = NUM_CLASSES,
    desc: str = "eval",
) -> float:
    """Accuracy over ``loader`` (all ranks' shards together), at most ``max_batches`` batches. Compiled
    models run their original code here: compiling the evaluation's graphs (another mode, no gradients)
    would cost more start-up time than a few eager batches. A stop request (Ctrl-C, SIGTERM, SIGUSR1)
    ends it at the next batch with :class:`faults.Interrupted`, as in :func:`evaluate_splits`."""
    value, done, total, signum = _evaluate(fabric, model, loader, batch_fn, max_batches, num_classes, desc)
    if signum:
        raise _stopped(signum, desc, done, total, None)
    return value


def _stopped(signum: int, what: str, done: int, total: int, steps: int | None) -> faults.Interrupted:
    return faults.Interrupted(signum, steps, steps, None, during=f"{what} ({done} of {total} batches)")


@torch.no_grad()  # else every batch's activations stay for a backward that never comes
@torch.compiler.set_stance("force_eager")  # eval mode and no_grad would recompile every compiled graph
def _evaluate(fabric, model, loader, batch_fn, max_batches, num_classes, desc):
    """(accuracy or None, batches done, batches planned, stop signal or 0), with a progress bar; the one
    evaluation of :func:`evaluate` and :func:`evaluate_splits`."""
    model.eval()
    acc = accuracy_metric(fabric.device, num_classes)
    total = len(loader) if max_batches is None else min(len(loader), max_batches)
    stop = StopCheck(fabric)  # every process stops after the same batch
    bar = tqdm(
        total=total,
        desc=desc,
        unit="batch",
        leave=False,
        dynamic_ncols=True,
        disable=not getattr(fabric, "is_global_zero", True),
    )
    done = 0
    with faults.stopping_at("evaluation batch"):
        try:
            for batch in loader:
                if done >= total or stop.check():
                    break
                _, logits, targets = batch_fn(model, batch)
                acc.update(logits, targets)
                done += 1
                bar.update(1)
        finally:
            bar.close()
            model.train()
    return (acc.compute().item() if done else None), done, total, stop.signum


def evaluate_splits(
    fabric,
    model,
    val_loader,
    test_loader,
    batch_fn: BatchFn,
    results: RunResults,
    max_batches: int | None = None,
    num_classes: int = NUM_CLASSES,
) -> None:
    """Validation and test accuracy into the run's results. A stop request during evaluation keeps
    what was measured (``extra.evaluation``: batches done of planned, the accuracy over them) and
    raises :class:`faults.Interrupted` for ``lifecycle.run_recipe``, which records the run as stopped."""
    evaluation = results.extra.setdefault("evaluation", {})
    for split, loader in (("val", val_loader), ("test", test_loader)):
        value, done, total, signum = _evaluate(
            fabric, model, loader, batch_fn, max_batches, num_classes, f"{split} accuracy"
        )
        evaluation[split] = {"batches": done, "of": total, "accuracy": value}
        if signum:
            raise _stopped(signum, f"{split} evaluation", done, total, results.optimizer_steps)
        results.accuracy[split] = value

"""The optimizer step inside backward (rung 12; rung 14, and ``recipes/your_model.py --optimizer-in-backward``).

Each parameter gets an optimizer of its own (:func:`per_parameter`), and a post-accumulate-grad hook
(:func:`register`) steps it the moment that parameter's gradient is complete during the backward pass,
then frees the gradient: the gradients of the whole model never exist at the same time. The training
step is then given no optimizer (``training/step.py``: ``train_step``'s block marked "rung 12"), and
accumulation is refused (``RunConfig.checked``): it would keep every gradient until the last micro-batch.

Every optimizer has its own learning-rate schedule: :class:`SchedulerGroup` steps (and checkpoints) them
as one, and the loop steps it once per optimizer step like any scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def per_parameter(model: torch.nn.Module, make: Callable[..., Any], **options: Any) -> dict:
    """One optimizer per trainable parameter: ``{p: make([p], **options)}``."""
    return {p: make([p], **options) for p in model.parameters() if p.requires_grad}


def register(optimizers: dict) -> dict:
    """Step each parameter's optimizer from a hook as soon as its gradient is accumulated, then free the
    gradient (``zero_grad(set_to_none=True)``); returns ``optimizers``."""

    def step_in_backward(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad(set_to_none=True)  # the gradient is freed right away

    for p in optimizers:
        p.register_post_accumulate_grad_hook(step_in_backward)
    return optimizers


class SchedulerGroup:
    """Several learning-rate schedulers stepped (and checkpointed) as one: with one optimizer per
    parameter every optimizer has its own schedule (and ``--warmup-steps`` adds one to each)."""

    def __init__(self, schedulers: Iterable) -> None:
        self.schedulers = list(schedulers)

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> dict:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        for scheduler, saved in zip(self.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)

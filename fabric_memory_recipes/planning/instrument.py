"""What a recipe records of the model and optimizer it built, in one call: :func:`instrument`.

    with results.phase("model_load"):
        model = models.build_model(...)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, fused=True)
        optimizer = planning.instrument(results, model, cfg, optimizer)  # the estimate, size, --bf16-update
        model, optimizer = fabric.setup(model, optimizer)

It lives in the planning layer because it records the planner's estimate
(:func:`~fabric_memory_recipes.planning.simulation.simulate.for_run`), which the training layer may not
import; the rest is the training layer's (the bf16 update rule) and the measurement layer's (the results).
"""

from __future__ import annotations

from typing import Any

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.measurement.results import RunResults
from fabric_memory_recipes.planning.simulation.simulate import for_run
from fabric_memory_recipes.training import models
from fabric_memory_recipes.training.techniques import bf16


def instrument(results: RunResults, model: Any, cfg: RunConfig, optimizer: Any = None) -> Any:
    """Record what the run built, before ``fabric.setup``: the predicted peak (``results.estimate``, from
    ``model``, ``cfg`` and, when given, ``optimizer``), the model's size (``parameters``), and, when an
    optimizer (or a dict of per-parameter optimizers) is given, apply ``--bf16-update`` and
    ``--lost-updates`` to it (:func:`~fabric_memory_recipes.training.techniques.bf16.updates`, recorded
    under ``updates``). Returns the optimizer to use (None when none was given).

    A recipe that builds its optimizers only after ``fabric.setup`` (rungs 12 and 14: one per parameter)
    calls it without one, and ``bf16.updates`` itself on what it builds."""
    results.estimate = for_run(model, cfg, optimizer)  # the predicted peak (its seconds leave the phase)
    results.set(parameters=models.count_parameters(model))
    return None if optimizer is None else bf16.updates(optimizer, cfg, results)

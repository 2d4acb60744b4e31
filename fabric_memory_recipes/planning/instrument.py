"""What a recipe records of the model and optimizer it built, in one call: :func:`instrument`.

    with results.phase("model_load"):
        model = models.build_model(...)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, fused=True)
        planning.instrument(results, model, cfg, optimizer)  # records the estimate and the model's size
        optimizer = bf16.updates(optimizer, cfg, results)  # the technique stays in the recipe
        model, optimizer = fabric.setup(model, optimizer)

It lives in the planning layer because it records the planner's estimate
(:func:`~fabric_memory_recipes.planning.simulation.simulate.for_run`), which the training layer may not
import. It records only: what changes the training (the bf16 update rule) stays a line of the recipe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.planning.simulation.simulate import for_run
from fabric_memory_recipes.training import models

if TYPE_CHECKING:  # only a type here: importing the results module imports Lightning (seconds of start-up)
    from fabric_memory_recipes.measurement.results import RunResults


def instrument(results: RunResults, model: Any, cfg: RunConfig, optimizer: Any = None) -> None:
    """Record what the run built, before ``fabric.setup``: the predicted peak (``results.estimate``, from
    ``model``, ``cfg`` and, when given, ``optimizer``: the one the recipe built, before ``--bf16-update``
    wraps it) and the model's size (``parameters``)."""
    results.estimate = for_run(model, cfg, optimizer)  # the predicted peak (its seconds leave the phase)
    results.set(parameters=models.count_parameters(model))

"""A tighter speed bound for ``--fit``'s search (planning/your_model/sets.py) over the sets with activation
offload, which spares their simulations when they cannot be among the picks.

A set's bound is the predicted speed of its plain set (no memory techniques). Activation offload's main
cost is not in the plain set: its copies, 2 x the offloaded bytes per micro-batch over B_host
(planning/your_model/step_time.py). Once the same set without offload is simulated, the set with it is
bounded by that set's step (offload only adds copies to the ops it runs) plus the copies of at least the
largest tensor that set saves for backward: offload saves the same tensors, and each one's host copy lives
from the forward pass until backward needs it, so the host holds at least that one at some time. The
simulation measures that tensor in both (``OpCosts.largest_offloadable``)."""

from __future__ import annotations

from typing import Any

from fabric_memory_recipes.techniques import ACTIVATION_OFFLOAD


def _sans_offload(c: Any) -> tuple:
    """What choice ``c`` is without activation offload: its other fields, and its mode."""
    used = tuple(n for n in c.techniques.used if n != ACTIVATION_OFFLOAD.name)
    return (*c.plain, used, c.checkpoint_mode, c.cpu_offload)


def of(planner: Any, c: Any) -> float:
    """samples/s no prediction of choice ``c`` of ``planner`` (a :class:`~.sets.UserPlanner`) is above:
    ``c.speed_bound``, or for a set with activation offload whose set without it is simulated, that set's
    step plus the copies of its largest saved tensor."""
    if not c.techniques.uses(ACTIVATION_OFFLOAD):
        return c.speed_bound
    without = (k for k in planner.choices if not k.techniques.uses(ACTIVATION_OFFLOAD))
    kept = next((k for k in without if _sans_offload(k) == _sans_offload(c)), None)
    simulated = None if kept is None else planner.simulation_of(kept)  # fast mode's own step where it has one
    if simulated is None:  # not simulated yet, or it failed
        return c.speed_bound
    largest = simulated[3].largest_offloadable
    seconds = kept.devices * kept.rung.batch_size / planner.predict(kept).images_per_s
    seconds += c.rung.accumulation_steps * 2 * largest / planner.ceilings.host_bandwidth
    return min(c.speed_bound, c.devices * c.rung.batch_size / seconds)

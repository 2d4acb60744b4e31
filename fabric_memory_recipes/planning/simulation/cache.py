"""Simulated steps kept on disk: a step of ViT-L/16 takes seconds on a CPU, and the planner (``--fit``), the
check of committed runs (``--check``, the reserved margin's replays) and the predicted ladder (``--ladder``,
the CPU path of ``./run_all.sh``, the workshop) ask for the same ones again. An entry is what a simulation
gives them: the peak allocated, the bytes offloaded per micro-batch and the replayed peak reserved, with the
peak's phase and components, by a key the caller makes of what the simulation depends on (a ladder model's
step: :func:`ladder_key`, which ``--check`` and ``--ladder`` share). The file (``FMR_PLAN_CACHE``, default
``~/.cache/fabric-memory-recipes/simulations.json``) is keyed by the estimator's source and torch's
version: an entry of another one is not used. Processes that share the file add to it: each write keeps
what the others wrote meanwhile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fabric_memory_recipes.measurement.results_file import write_json_atomic
from fabric_memory_recipes.planning.plan import Estimate

CACHE_ENV = "FMR_PLAN_CACHE"
SOURCES = (  # what a cached simulation depends on, relative to the package
    "planning/simulation/simulate.py",
    "planning/simulation/modelled.py",
    "planning/simulation/tracking.py",
    "planning/simulation/allocator.py",
    "planning/simulation/streamed.py",
    "planning/simulation/sharded.py",
    "planning/simulation/saved.py",
    "planning/simulation/expandable.py",
    "planning/simulation/compiled/partition.py",
    "planning/plan.py",
    "training/models.py",
    "training/data/__init__.py",
    "planning/simulation/cache.py",  # the entries' own format
)
# kept beside the three numbers (--ladder's rows; the replays under every allocator setting)
DETAILS = ("peak_phase", "components_gb", "static_gb", "reserved_by_allocator")


def ladder_key(plan: Any, model: str | None, image_size: int | None = None, fused: bool = False) -> dict:
    """The key of a ladder model's step (``meta_ladder_model(model, fused_attention=fused,
    image_size=image_size)`` under ``plan``), the same for every allocator setting: an entry keeps each one's
    replay (:meth:`SimulationCache.lookup`'s ``allocator``)."""
    plan = {k: v for k, v in dataclasses.asdict(plan).items() if k != "allocator"}
    return {"plan": plan, "model": model, "image_size": image_size, "fused": fused}


class SimulationCache:
    """(Peak allocated, bytes offloaded per micro-batch, replayed peak reserved) by key, in memory and in
    a JSON file; entries of another estimator source or torch version are not used."""

    def __init__(self, path: str | None = None, use_disk: bool = True) -> None:
        default = Path.home() / ".cache" / "fabric-memory-recipes" / "simulations.json"
        self.path = Path(path or os.environ.get(CACHE_ENV) or default) if use_disk else None
        here = Path(__file__).resolve().parents[2]  # the package
        digest = hashlib.sha256(torch.__version__.encode())
        for name in SOURCES:
            digest.update((here / name).read_bytes())
        self.version = digest.hexdigest()[:16]
        self.entries: dict[str, list[Any]] = self._stored()
        self.simulated = 0
        self.seconds = 0.0

    def _stored(self) -> dict[str, list[Any]]:
        """The file's entries, if it holds this estimator's."""
        if self.path is None:
            return {}
        try:
            stored = json.loads(self.path.read_text())
            return stored["entries"] if stored.get("version") == self.version else {}
        except (OSError, ValueError, KeyError, AttributeError):
            return {}

    def lookup(
        self, key: Any, simulate_it: Callable[[], Estimate], what: str, allocator: str | None = None
    ) -> tuple[float, float, float]:
        """(Peak allocated, bytes offloaded per micro-batch, replayed peak reserved) of ``key`` (anything
        JSON can write), simulated by ``simulate_it`` when there is no entry (a failed simulation raises
        RuntimeError naming ``what`` was simulated); the replay under the caching allocator's setting
        ``allocator`` (plan.ALLOCATORS), by default the simulated plan's."""
        peak, host, reserved, details = self.entry(key, simulate_it, what)
        if allocator is not None and details.get("reserved_by_allocator"):
            reserved = details["reserved_by_allocator"][allocator]
        return peak, host, reserved

    def entry(self, key: Any, simulate_it: Callable[[], Estimate], what: str) -> list[Any]:
        """:meth:`lookup`'s three numbers and a dict of the estimate's :data:`DETAILS`."""
        text = json.dumps(key)
        if text not in self.entries:
            est = simulate_it()
            if est.error or est.peak_gb is None:
                raise RuntimeError(f"the simulation of {what} failed: {est.error}")
            details = {name: getattr(est, name, None) for name in DETAILS}
            self.entries[text] = [est.peak_gb, est.activations_host_gb, est.reserved_gb, details]
            self.simulated += 1
            self.seconds += est.seconds
            self._save()
        return self.entries[text]

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.entries = {**self._stored(), **self.entries}  # another process's entries stay
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(str(self.path), {"version": self.version, "entries": self.entries})
        except OSError:
            self.path = None  # an unwritable cache only costs time

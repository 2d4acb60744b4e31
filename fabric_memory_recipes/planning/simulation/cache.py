"""Simulated steps kept on disk: a step of ViT-L/16 takes seconds on a CPU, and the planner (``--fit``) and
the check of committed runs (``--check``) ask for the same ones again. An entry is what a simulation gives
the planners: the peak allocated, the bytes offloaded per micro-batch and the replayed peak reserved, by
a key the caller makes of what the simulation depends on. The file (``FMR_PLAN_CACHE``, default
``~/.cache/fabric-memory-recipes/simulations.json``) is keyed by the estimator's source and torch's
version: an entry of another one is not used.
"""

from __future__ import annotations

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
    "planning/plan.py",
    "training/models.py",
    "training/data/__init__.py",
)


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
        self.entries: dict[str, list[float]] = {}
        self.simulated = 0
        self.seconds = 0.0
        if self.path is not None:
            try:
                stored = json.loads(self.path.read_text())
                if stored.get("version") == self.version:
                    self.entries = stored["entries"]
            except (OSError, ValueError, KeyError, AttributeError):
                pass

    def lookup(self, key: Any, simulate_it: Callable[[], Estimate], what: str) -> tuple[float, float, float]:
        """The entry of ``key`` (anything JSON can write), made by ``simulate_it`` when there is none (a
        failed simulation raises RuntimeError naming ``what`` was simulated)."""
        text = json.dumps(key)
        if text not in self.entries:
            est = simulate_it()
            if est.error or est.peak_gb is None:
                raise RuntimeError(f"the simulation of {what} failed: {est.error}")
            self.entries[text] = [est.peak_gb, est.activations_host_gb, est.reserved_gb]
            self.simulated += 1
            self.seconds += est.seconds
            self._save()
        return tuple(self.entries[text])

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(str(self.path), {"version": self.version, "entries": self.entries})
        except OSError:
            self.path = None  # an unwritable cache only costs time

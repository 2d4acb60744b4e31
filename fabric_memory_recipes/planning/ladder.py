"""The predicted ladder: every rung's peak at its full size (ViT-L/16, its GPU configuration), simulated
on a CPU, written as ``predicted.json`` beside a results folder for the report to show.

    python -m fabric_memory_recipes.planning --ladder results/cpu        # the rungs that have a results JSON there
    python -m fabric_memory_recipes.planning --ladder results/predicted  # a folder without results: every numbered rung

Why: on a machine without a GPU the CPU track runs each rung with a tiny ViT, and its measured memory is
the process's RSS (the same ~1 GB for every rung). What a rung does to memory is still visible there:
the simulator predicts each rung's full-size peak within a few percent of the committed GPU runs
(docs/memory_anatomy.md), so the report's memory columns show that prediction, labelled as predicted,
next to the tiny run's measurement. The GPU configuration is the rung's declared one (``RUNG`` in its
recipe: batch, precision, optimizer, technique) with ``--accelerator cuda``; sharded rungs keep their
declared device count (per-GPU memory). The simulated steps are kept in the planner's cache
(planning/simulation/cache.py), which ``--check`` of the committed ladder shares.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fabric_memory_recipes.config import RECIPES_DIR, Hardware
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.measurement.results_file import PREDICTED_FILE, PREDICTED_LABEL, write_json_atomic
from fabric_memory_recipes.planning.plan import plan_for
from fabric_memory_recipes.planning.simulation.cache import SimulationCache, ladder_key
from fabric_memory_recipes.planning.simulation.simulate import simulate
from fabric_memory_recipes.training.models import meta_ladder_model

LADDER_SCHEMA = 1


def gpu_config(recipe: str):
    """The rung of ``recipes/<recipe>.py`` as it runs on a GPU machine (checked, mode resolved)."""
    rung, _ = declared_rung(recipe)
    return rung.with_flags(accelerator="cuda").checked(Hardware.planned())


def predict(recipe: str, cache: SimulationCache | None = None) -> dict[str, Any]:
    """One rung's full-size prediction as a row of ``predicted.json`` (an ``error`` instead of a peak
    when the simulation fails: a failed prediction never hides the rest of the ladder); the step is
    simulated once, then kept in ``cache`` (by default the planner's file)."""
    start = time.perf_counter()
    try:
        cfg = gpu_config(recipe)
        model, plan = meta_ladder_model(cfg.model, fused_attention=cfg.fused_attention), plan_for(cfg)
        key = ladder_key(plan, cfg.model, fused=cfg.fused_attention)
        peak, _, _, est = (cache or SimulationCache()).entry(
            key, lambda: simulate(model, plan, model_name=cfg.model), recipe
        )
    except Exception as e:
        return {"recipe": recipe, "peak_allocated_gb": None, "error": f"{type(e).__name__}: {e}"}
    return {
        "recipe": recipe,
        "peak_allocated_gb": round(peak, 4),
        "peak_phase": est["peak_phase"],
        "components_gb": {k: round(v, 4) for k, v in est["components_gb"].items() if v},
        "static_gb": {k: round(v, 4) for k, v in est["static_gb"].items()},
        "config": {
            "model": cfg.model,
            "precision": cfg.precision,
            "batch_size": cfg.batch_size,
            "accumulation_steps": cfg.accumulation_steps,
            "micro_batch_size": cfg.micro_batch_size,
            "devices": cfg.world_size,
            "optimizer": cfg.optimizer,
            "sharding": cfg.sharding,
        },
        "seconds": round(time.perf_counter() - start, 1),
        "error": None,
    }


def recipes_in(results_dir: Path) -> list[str]:
    """The numbered rungs with a results JSON in ``results_dir`` (the rows the report will show)."""
    names = set()
    for path in results_dir.glob("[0-9][0-9]_*.json"):
        try:
            recipe = json.loads(path.read_text()).get("recipe")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(recipe, str) and recipe[:2].isdigit():
            names.add(recipe)
    return sorted(names)


def every_rung() -> list[str]:
    """The numbered recipes (01-15, both 08s): the whole ladder."""
    return sorted(p.stem for p in RECIPES_DIR.glob("[0-9][0-9]_*.py"))


def predict_ladder(results_dir: str | Path, recipes: list[str] | None = None, say=print) -> dict:
    """Predict ``recipes`` (default: those with results in ``results_dir``, or every rung when it has
    none) and write ``results_dir/predicted.json``; returns what was written."""
    results_dir = Path(results_dir)
    if recipes is None:
        recipes = recipes_in(results_dir) if results_dir.is_dir() else []
        recipes = recipes or every_rung()
    rows = []
    for recipe in recipes:
        row = predict(recipe)
        rows.append(row)
        if row["error"]:
            say(f"  {recipe:<30} failed: {row['error']}")
        else:
            c = row["config"]
            say(
                f"  {recipe:<30} {row['peak_allocated_gb']:7.2f} GB  ({c['model']}, {c['precision']},"
                f" batch {c['batch_size']}, {c['devices']} GPU{'s' if c['devices'] > 1 else ''};"
                f" {row['seconds']:.1f} s)"
            )
    payload = {
        "schema_version": LADDER_SCHEMA,
        "what": PREDICTED_LABEL,
        "method": "fabric_memory_recipes.planning: one training step simulated on fake tensors (eager graph), per rung's"
        " declared configuration with --accelerator cuda; peak allocated per GPU",
        "rows": rows,
    }
    write_json_atomic(str(results_dir / PREDICTED_FILE), payload)
    return payload

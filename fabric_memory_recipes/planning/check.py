"""Predicted against measured: every results JSON of a folder next to its prediction."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from fabric_memory_recipes.config import VIT_MODELS, RunConfig, declared_rung
from fabric_memory_recipes.measurement.results_file import SCHEMA_VERSION, estimate_error_pct
from fabric_memory_recipes.planning.plan import plan_for
from fabric_memory_recipes.planning.simulate import simulate
from fabric_memory_recipes.training import models


@functools.cache
def meta_model(name: str, num_classes: int = 10) -> Any:
    """The model built on the meta device: shapes only, no memory, no initialisation cost."""
    with torch.device("meta"):
        return models.build_model(name, None, num_classes=num_classes)


def check_results(dirs: list[str]) -> list[dict[str, Any]]:
    """Compare every results JSON in ``dirs`` with its prediction: the one the recipe recorded
    (``estimate``), or, for runs made before recipes recorded one, a prediction from the recorded
    config and the recipe's declared rung. Only runs measured on CUDA with status ok are compared, and
    only the ViT rungs (the estimator does not model the Hugging Face bonus models)."""
    rows = []
    for d in dirs:
        for path in sorted(Path(d).glob("*.json")):
            try:
                result = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(result, dict) or result.get("schema_version") != SCHEMA_VERSION:
                continue
            if result.get("status") != "ok" or (result.get("memory") or {}).get("kind") != "cuda":
                continue
            rung, _ = declared_rung(result["recipe"])
            if rung.model not in VIT_MODELS:
                continue
            config = result.get("config") or {}
            recorded = result.get("estimate") or {}
            if recorded.get("peak_allocated_gb") is None:
                flags = {f.name for f in RunConfig.flag_fields()}
                recorded_flags = {k: v for k, v in config.items() if k in flags}
                cfg = rung.with_flags(**{**recorded_flags, "accelerator": "cuda"})
                plan = plan_for(cfg)
                model = meta_model(config.get("model", "vit_l_16"))
                recorded = simulate(model, plan, model_name=config.get("model")).to_dict()
            rows.append(
                {
                    "file": str(path),
                    "recipe": result["recipe"],
                    "gpu": (result.get("provenance") or {}).get("gpu_name"),
                    "world_size": (result.get("provenance") or {}).get("world_size", 1),
                    "compile": bool(config.get("compile")),
                    "predicted_gb": recorded["peak_allocated_gb"],
                    "measured_gb": result["memory"]["peak_allocated_gb"],
                    "error_pct": estimate_error_pct({**result, "estimate": recorded}),
                    "peak_phase": recorded.get("peak_phase"),
                    "activations_saved_gb": recorded.get("activations_saved_gb"),
                }
            )
    return rows


def render_check(rows: list[dict[str, Any]]) -> str:
    """Predicted vs measured as a markdown table."""
    lines = [
        "| run | GPU | compile | predicted GB | measured GB | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        gpu = (r["gpu"] or "?").replace("NVIDIA ", "")
        if r["world_size"] and r["world_size"] > 1:
            gpu = f"{r['world_size']}× {gpu} (per GPU)"
        lines.append(
            f"| `{r['file']}` | {gpu} | {'on' if r['compile'] else 'off'} | {r['predicted_gb']:.3f} |"
            f" {r['measured_gb']:.3f} | {r['error_pct']:+.1f}% |"
        )
    return "\n".join(lines)

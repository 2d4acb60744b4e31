"""The convergence runs read for the report (:mod:`fabric_memory_recipes.tools.convergence.report`): grouped
by rung and variant from their tags, each group's numbers over its seeds (test accuracy, final training
loss, lost updates, optimizer steps) and settings (precision, batch, optimizer, learning-rate policy), and
how those numbers are written in its tables (mean ± sd, percent).
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

from fabric_memory_recipes.measurement.report.cells import DASH

BASELINE = "01_baseline"
TAG = re.compile(r"^(?P<variant>.+)-s(?P<seed>\d+)$")
MEMORY_TAG = re.compile(r"^memory-(?P<variant>.+)$")


def short_name(optimizer: str | None) -> str:
    """'torch.optim.adam.Adam' -> 'torch Adam'; 'optimi.sgd.SGD' -> 'optimi SGD'."""
    if not optimizer:
        return DASH
    parts = optimizer.split(".")
    return f"{parts[0]} {parts[-1].lstrip('_')}"


def mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def plus_minus(values: list[float], decimals: int = 3) -> str:
    mean, sd = mean_sd(values)
    if mean is None:
        return DASH
    text = f"{mean:.{decimals}f}"
    return text + (f" ± {sd:.{decimals}f}" if sd is not None else "") + f" (n={len(values)})"


def percent(value: float | None) -> str:
    return DASH if value is None else f"{100 * value:.1f}%"


def groups(results: list[dict]) -> tuple[dict[tuple[str, str], list[dict]], dict[tuple[str, str], dict]]:
    """Accuracy runs by (recipe, variant), and memory runs by (recipe, variant)."""
    acc: dict[tuple[str, str], list[dict]] = {}
    mem: dict[tuple[str, str], dict] = {}
    for r in results:
        tag = str(r.get("tag") or "")
        if m := MEMORY_TAG.match(tag):
            mem[(r["recipe"], m["variant"])] = r
        elif m := TAG.match(tag):
            acc.setdefault((r["recipe"], m["variant"]), []).append(r)
    return acc, mem


def final_loss(result: dict) -> float | None:
    """Mean training loss over the last tenth of the loss curve (at least its last point): one logged
    window alone is too noisy to compare runs by, with Adam at a constant learning rate."""
    curve = (result.get("loss") or {}).get("curve") or []
    if not curve:
        return (result.get("loss") or {}).get("last")
    tail = curve[-max(1, len(curve) // 10) :]
    return statistics.fmean(v for _, v in tail)


def warmup_epochs(result: dict) -> float | None:
    """The run's linear warm-up in epochs: its --warmup-steps over its optimizer steps per epoch."""
    cfg, steps = result.get("config") or {}, (result.get("timing") or {}).get("optimizer_steps")
    if not steps or cfg.get("warmup_steps") is None or not cfg.get("epochs"):
        return None
    return round(cfg["warmup_steps"] * cfg["epochs"] / steps, 1)


def own_policy(s: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """The warm-up and epochs of a rung that differ from the baseline's: a policy of its own (policy.TUNED)."""
    out = []
    if None not in (s["warmup"], base["warmup"]) and s["warmup"] != base["warmup"]:
        out.append(f"warm-up {s['warmup']:g} epochs vs {base['warmup']:g}")
    if s["epochs"] and base["epochs"] and s["epochs"] != base["epochs"]:
        out.append(f"{s['epochs']} epochs vs {base['epochs']}")
    return out


def group_stats(runs: list[dict]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("status") == "ok"]

    def values(get) -> list[float]:
        out = []
        for r in ok:
            v = get(r)
            if isinstance(v, int | float) and math.isfinite(v):
                out.append(float(v))
        return out

    first = ok[0] if ok else (runs[0] if runs else {})
    cfg = first.get("config") or {}
    return {
        "runs": len(runs),
        "ok": len(ok),
        "not_ok": sorted(
            f"s{TAG.match(r.get('tag') or '-s?')['seed']} {r.get('status')}" for r in runs if r not in ok
        ),
        "test": values(lambda r: (r.get("accuracy") or {}).get("test")),
        "loss": values(final_loss),
        "lost": values(lambda r: ((r.get("updates") or {}).get("lost") or {}).get("mean_lost")),
        "steps": values(lambda r: (r.get("timing") or {}).get("optimizer_steps")),
        "precision": cfg.get("precision"),
        "batch": cfg.get("batch_size"),
        "micro": cfg.get("micro_batch_size"),
        "lr": cfg.get("lr"),
        "warmup": warmup_epochs(first),
        "epochs": cfg.get("epochs"),
        "optimizer": (first.get("updates") or {}).get("optimizer"),
        "short": short_name((first.get("updates") or {}).get("optimizer")),
        "rule": (first.get("updates") or {}).get("rule"),
    }

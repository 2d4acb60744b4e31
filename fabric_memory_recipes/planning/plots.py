"""The estimator's figures: the simulated step's memory by component, and predicted against measured."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fabric_memory_recipes.planning.plan import COMPONENT_COLORS, COMPONENTS, Estimate


def plot_timeline(est: Estimate, path: str | os.PathLike, title: str | None = None) -> None:
    """The simulated step as a stacked area per component (x: allocation events, not time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not est.timeline:
        raise ValueError("the estimate has no timeline: simulate(..., record_timeline=True)")
    names = [c for c in COMPONENTS if any(t[1].get(c) for t in est.timeline)]
    xs = range(len(est.timeline))
    ys = [[t[1].get(c, 0.0) for t in est.timeline] for c in names]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.stackplot(xs, ys, labels=names, colors=[COMPONENT_COLORS[c] for c in names], alpha=0.85)
    # phase boundaries
    last = None
    for i, (phase, _) in enumerate(est.timeline):
        if phase != last:
            ax.axvline(i, color="black", lw=0.5, alpha=0.4)
            ax.text(i, ax.get_ylim()[1] * 0.98, " " + phase, rotation=90, va="top", fontsize=7, alpha=0.7)
            last = phase
    ax.axhline(est.peak_gb, color="black", ls="--", lw=0.8)
    ax.set_xlabel("allocation / release events of one simulated training step")
    ax.set_ylabel("GB (1e9 bytes)")
    ax.set_title(title or f"Predicted memory timeline: {est.model}, peak {est.peak_gb:.2f} GB")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_check(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Predicted vs measured peak per run (bars) with the error on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{Path(r['file']).parent.name}/{r['recipe']} ({'compiled' if r['compile'] else 'eager'})"
        for r in rows
    ]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(rows) + 3), 5))
    ax.bar([x - 0.2 for x in xs], [r["measured_gb"] for r in rows], 0.4, color="#08519c", label="measured")
    bars = ax.bar(
        [x + 0.2 for x in xs], [r["predicted_gb"] for r in rows], 0.4, color="#fc9272", label="predicted"
    )
    ax.bar_label(bars, labels=[f"{r['error_pct']:+.1f}%" for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), labels, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("peak allocated, GB (log scale)")
    ax.set_title("fabric_memory_recipes.planning: predicted vs measured peak allocated (label: error)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

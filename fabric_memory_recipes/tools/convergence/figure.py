"""The convergence benchmark's figure: each rung's training-loss curves over the fp32 baseline's."""

from __future__ import annotations

import math
from pathlib import Path

from fabric_memory_recipes.measurement.results_file import write_atomic

BASELINE = "01_baseline"


def render_figure(acc: dict[tuple[str, str], list[dict]], path: Path) -> None:
    """``acc``: the runs by (recipe, variant). One panel per rung/variant: its training-loss curves (one per seed) over the baseline's (grey),
    against epochs (samples seen / training-set size), so rungs with different batches line up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_train = None

    def curve(r: dict) -> tuple[list[float], list[float]]:
        nonlocal n_train
        points = (r.get("loss") or {}).get("curve") or []
        batch = (r.get("config") or {}).get("batch_size") or 1
        epochs = (r.get("config") or {}).get("epochs") or 1
        seen = (r.get("timing") or {}).get("images_seen") or 0
        per_epoch = seen / epochs if seen else None
        xs = [s * batch / per_epoch if per_epoch else s for s, _ in points]
        return xs, [v for _, v in points]

    keys = sorted(acc)
    cols = 4
    rows = max(1, math.ceil(len(keys) / cols))
    fig, axes = plt.subplots(
        rows, cols, figsize=(4 * cols, 2.8 * rows), sharex=True, sharey=True, squeeze=False
    )
    base = acc.get((BASELINE, "default"), [])
    for ax, key in zip(axes.flat, keys, strict=False):
        for r in base:
            ax.plot(*curve(r), color="#999999", lw=1)
        if key != (BASELINE, "default"):
            for r in acc[key]:
                ax.plot(*curve(r), color="#d62728", lw=1)
        ax.set_title(f"{key[0]}" + ("" if key[1] == "default" else f" [{key[1]}]"), fontsize=8)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(keys) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("epochs (samples seen / training split)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("training loss", fontsize=8)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="#999999", lw=1), Line2D([], [], color="#d62728", lw=1)]
    fig.legend(handles, ["01 fp32 baseline", "the rung / variant"], loc="upper right", fontsize=8)
    fig.suptitle("Training loss per rung (one line per seed) against the fp32 baseline", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
    plt.close(fig)

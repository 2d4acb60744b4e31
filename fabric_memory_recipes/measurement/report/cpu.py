"""The CPU track of the report: a results folder of tiny CPU runs, shown with each rung's full-size
prediction (``predicted.json``, written by ``python -m fabric_memory_recipes.planning --ladder DIR``).

On a CPU the measured memory is the process's peak RSS: Python, torch and the tiny model, about the same
for every rung, so it shows nothing of what a rung does. The simulator's prediction of the same rung at
full size (ViT-L/16 in the rung's GPU configuration) shows that, so the memory columns hold it, labelled
as predicted; the tiny run's own measurements (status, RSS, speed, steps) stay beside it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fabric_memory_recipes.measurement.report.cells import DASH, get, label, num, sort_key
from fabric_memory_recipes.measurement.results_file import PREDICTED_FILE, PREDICTED_LABEL, write_atomic


def load_predicted(results_dir: str | os.PathLike) -> dict[str, dict] | None:
    """``{recipe: row}`` from ``results_dir/predicted.json``, or None when there is none (or it is
    unreadable: the report then shows the measured columns only)."""
    path = Path(results_dir) / PREDICTED_FILE
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        return {r["recipe"]: r for r in payload["rows"] if isinstance(r, dict) and r.get("recipe")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _predicted_cells(row: dict | None) -> tuple[str, str]:
    """(predicted GB, the GPU configuration it is for)."""
    if row is None:
        return DASH, "not predicted"
    if row.get("error"):
        return DASH, f"prediction failed: {row['error']}"
    c = row.get("config") or {}
    batch = str(c.get("batch_size", DASH))
    if (c.get("accumulation_steps") or 1) > 1:
        batch += f" ({c.get('micro_batch_size')}×{c['accumulation_steps']})"
    where = f", per GPU of {c['devices']}" if (c.get("devices") or 1) > 1 else ""
    return num(row.get("peak_allocated_gb"), 2), f"{c.get('precision')}, batch {batch}{where}"


def render_cpu_table(results: list[dict], predicted: dict[str, dict], speed_cell) -> str:
    """The CPU track's table: the predicted full-size peak first, then the tiny run's measurements."""
    header = [
        "recipe",
        f"{PREDICTED_LABEL}: peak allocated GB",
        "GPU config predicted",
        "tiny run: status",
        "precision",
        "batch",
        "peak RSS GB (process)",
        "img/s (range)",
        "optimizer steps",
        "train acc",
        "val acc",
    ]
    keep = (
        slice(1, None) if predicted else slice(3, None)
    )  # no prediction (a stopped ladder): no such columns
    align = ["---:", "---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:"][keep.start - 1 :]
    lines = ["| " + " | ".join([header[0], *header[keep]]) + " |", "|---|" + "|".join(align) + "|"]
    for r in sorted(results, key=sort_key):
        gb, config = _predicted_cells(predicted.get(str(r.get("recipe"))))
        accum = get(r, "config.accumulation_steps", 1) or 1
        batch = str(get(r, "config.batch_size", DASH))
        if accum > 1:
            batch += f" ({get(r, 'config.micro_batch_size')}×{accum})"
        row = [
            label(r),
            gb,
            config,
            str(r.get("status") or DASH),
            str(get(r, "config.precision", DASH)),
            batch,
            num(get(r, "memory.peak_reserved_gb"), 2),
            speed_cell(r, "timing.images_per_s", 0),
            str(get(r, "timing.optimizer_steps", DASH)),
            num(get(r, "accuracy.train"), 3),
            num(get(r, "accuracy.val"), 3),
        ]
        lines.append("| " + " | ".join([row[0], *row[keep]]) + " |")
    return "\n".join(lines)


CPU_NOTE = (
    f"**Memory: {PREDICTED_LABEL}.** The GB column is not measured here: it is `fabric_memory_recipes.planning`'s"
    " prediction of each rung's peak allocated memory at full size (ViT-L/16, the rung's declared"
    " configuration on a GPU: one simulated training step on fake tensors, `predicted.json` beside this"
    " file, written by `python -m fabric_memory_recipes.planning --ladder DIR`). The tiny run's own peak is the"
    " process's resident set size (Python, torch and a 2-block ViT: about the same for every rung), so it"
    " says nothing about the rung's technique. Measured GPU peaks: the committed runs in `results/`."
)

CPU_NOTE_UNPREDICTED = (
    "**Memory: no full-size prediction here** (`predicted.json` is written after the last rung by"
    " `python -m fabric_memory_recipes.planning --ladder DIR`; a stopped ladder has none). The peak RSS column is the"
    " tiny run's process (Python, torch and a 2-block ViT): it is neither a GPU peak nor the rung's technique."
)


def _rate(result: dict, which: str, median_rate: float) -> float:
    """img/s at the run's ``which`` (p10 | p90) step time; the median's rate when it has none."""
    step = get(result, f"timing.step_s.{which}")
    return get(result, "config.batch_size", 0) / step if step else median_rate


def render_predicted_figure(results: list[dict], predicted: dict[str, dict], path: str | os.PathLike) -> None:
    """Left: the predicted full-size ladder (GB per rung); right: the tiny CPU runs' img/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted(results, key=sort_key)
    labels = [label(r) for r in results]
    xs = range(len(results))
    gb = [get(predicted.get(str(r.get("recipe"))) or {}, "peak_allocated_gb") for r in results]
    speed = [float(get(r, "timing.images_per_s", 0.0)) for r in results]
    fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(max(10, 1.3 * len(results) + 4), 5.5))
    bars = ax_mem.bar(xs, [g or 0.0 for g in gb], width=0.7, color="#fc9272", hatch="//", edgecolor="#cb181d")
    ax_mem.bar_label(bars, labels=[DASH if g is None else f"{g:.2f}" for g in gb], fontsize=8)
    ax_mem.set_ylabel("GB per GPU (1e9 bytes)")
    ax_mem.set_title(f"Peak allocated: {PREDICTED_LABEL}")
    # the spread: img/s at the p90 and p10 step times (a noisy CPU step shows as a long bar, not a lever)
    low = [max(0.0, v - _rate(r, "p90", v)) for r, v in zip(results, speed, strict=True)]
    high = [max(0.0, _rate(r, "p10", v) - v) for r, v in zip(results, speed, strict=True)]
    speed_bars = ax_speed.bar(
        xs, speed, width=0.6, color="#31a354", yerr=[low, high], capsize=3, ecolor="#555"
    )
    ax_speed.bar_label(speed_bars, labels=[f"{v:.0f}" if v else "" for v in speed], fontsize=8)
    positive = [v for v in speed if v > 0]
    if positive and max(positive) / min(positive) > 30:
        ax_speed.set_yscale("log")
    ax_speed.set_ylabel("images / s")
    ax_speed.set_title("Throughput: measured, tiny ViT on this CPU (bars: p10-p90 step times)")
    for ax in (ax_mem, ax_speed):
        ax.set_xticks(list(xs), labels, rotation=35, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        "Fabric memory ladder, CPU track: memory predicted by fabric_memory_recipes.planning (not measured here),"
        " speed measured on a tiny model",
        fontsize=10,
    )
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)

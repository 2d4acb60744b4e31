"""The ladder figure: peak memory (reserved bar, allocated inside it, the prediction as a mark) and
throughput per run, in the table's order."""

from __future__ import annotations

import os

from fabric_memory_recipes.measurement.report.cells import get, is_text, label, mode_label, sort_key
from fabric_memory_recipes.measurement.results_file import estimate_error_pct, write_atomic


def render_figure(results: list[dict], path: str | os.PathLike) -> None:
    """Two panels in table order: peak memory (reserved bar, allocated bar inside it) and img/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted(results, key=sort_key)
    labels = [  # the mode too: a ladder may mix compiled and eager rows, and their speeds differ
        label(r) + ("" if r.get("status") == "ok" else f" [{r.get('status')}]") + f"\n{mode_label(r)}"
        for r in results
    ]
    xs = range(len(results))
    oom = [r.get("status") == "oom" for r in results]

    def values(key: str) -> list[float]:  # OOM runs (and missing values) plot as 0, drawn over below
        return [0.0 if r.get("status") == "oom" else float(get(r, key, 0.0)) for r in results]

    reserved, allocated = values("memory.peak_reserved_gb"), values("memory.peak_allocated_gb")
    speed = values("timing.samples_per_s" if all(is_text(r) for r in results) else "timing.images_per_s")

    fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(max(10, 1.3 * len(results) + 4), 5.5))

    def text(values: list[float], fmt: str) -> list[str]:
        return [format(v, fmt) if v else "" for v in values]

    res_bars = ax_mem.bar(xs, reserved, width=0.75, color="#9ecae1", label="peak reserved")
    alloc_bars = ax_mem.bar(xs, allocated, width=0.45, color="#08519c", label="peak allocated")
    ax_mem.bar_label(res_bars, labels=text(reserved, ".2f"), fontsize=8)
    ax_mem.bar_label(
        alloc_bars, labels=text(allocated, ".2f"), fontsize=7, label_type="center", color="white"
    )
    predicted = [
        get(r, "estimate.peak_allocated_gb") if estimate_error_pct(r) is not None else None for r in results
    ]
    if any(p is not None for p in predicted):
        px = [x for x, p in zip(xs, predicted, strict=True) if p is not None]
        ax_mem.scatter(
            px,
            [p for p in predicted if p is not None],
            marker="_",
            s=900,
            linewidths=2,
            color="#cb181d",
            zorder=5,
            label="predicted (fabric_memory_recipes.planning)",
        )
    speed_bars = ax_speed.bar(xs, speed, width=0.6, color="#31a354")
    ax_speed.bar_label(speed_bars, labels=text(speed, ".0f"), fontsize=8)
    positive = [v for v in speed if v > 0]
    if positive and max(positive) / min(positive) > 30:
        ax_speed.set_yscale("log")

    for ax, values in ((ax_mem, reserved), (ax_speed, speed)):
        top = max(values, default=0) or 1.0
        for x in xs:
            if oom[x]:  # no peak to show: a hatched placeholder bar, labelled
                ax.bar(x, top, width=0.6, fill=False, hatch="//", edgecolor="#cb181d")
                ax.text(
                    x,
                    top / 2,
                    "OOM",
                    ha="center",
                    va="center",
                    color="#cb181d",
                    fontweight="bold",
                    backgroundcolor="white",
                )
        ax.set_xticks(list(xs), labels, rotation=35, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)

    kinds = {get(r, "memory.kind") for r in results}
    if kinds == {"cpu_rss"}:
        ax_mem.set_ylabel("process peak RSS (GB, CPU)")
    elif "cpu_rss" in kinds:
        ax_mem.set_ylabel("peak memory (GB; CPU runs: process RSS)")
    else:
        ax_mem.set_ylabel("peak GPU memory (GB)")
    ax_mem.set_title("Peak memory (training phase)")
    ax_mem.legend(fontsize=8)
    ax_speed.set_ylabel("samples / s" if all(is_text(r) for r in results) else "images / s")
    ax_speed.set_title("Throughput")
    devices = sorted({get(r, "provenance.gpu_name") or "CPU" for r in results})
    fig.suptitle(f"Fabric memory ladder\n{', '.join(devices)}", fontsize=11)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)

"""The report: every results JSON in a directory -> a markdown table (README.md) and a figure (ladder.png).

    python -m common.report [RESULTS_DIR]        # default: results
    python -m common.report --comparison results/compare-h100/comparison.json --readme README.md:comparison

Why a separate step: each recipe runs in its own process and writes only its own JSON, so the ladder is
assembled afterwards from what the runs recorded. Only the schema-1 keys documented in `common.metrics`
are read, and every number shown comes from those files (principle 3: measure, never claim). A file that
cannot be read is skipped with one line on stderr: one bad file must not hide the rest of the ladder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from common.metrics import SCHEMA_VERSION, estimate_error_pct, write_atomic

STANDARD_PHASES = {"train", "eval", "model_load"}
RANK_FILE = re.compile(r"\.rank\d+\.json$")
DASH = "—"
CPU_MARK = "¹"  # footnote marker on memory cells that hold process RSS, not GPU memory


def _get(d: Any, dotted: str, default: Any = None) -> Any:
    """Nested lookup that tolerates missing keys and nulls: a partial JSON renders, it does not crash."""
    for key in dotted.split("."):
        if not isinstance(d, dict) or d.get(key) is None:
            return default
        d = d[key]
    return d


def _sort_key(result: dict) -> tuple[str, str, bool, str]:
    """Recipe, then tag (untagged first): the order of the file names `<recipe>[-<tag>].json`; a run
    that did not succeed, kept beside a successful one (`<recipe>[-<tag>].<status>.json`), after it."""
    status = str(result.get("status") or "")
    return (str(result.get("recipe") or ""), str(result.get("tag") or ""), status != "ok", status)


def load_results(results_dir: str | os.PathLike) -> list[dict]:
    """Read the schema-1 results JSON files directly inside `results_dir`, sorted by recipe then tag.

    Per-rank side files (`*.rankN.json`) and JSON that is not a results file are skipped silently;
    unreadable files and other schema versions are skipped with a one-line warning on stderr.
    """
    results = []
    for path in sorted(Path(results_dir).glob("*.json")):
        if RANK_FILE.search(path.name) or not path.is_file():
            continue
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"report: skipping {path}: unreadable ({reason})", file=sys.stderr)
            continue
        if not isinstance(payload, dict) or "schema_version" not in payload:
            continue
        if payload["schema_version"] != SCHEMA_VERSION or not payload.get("recipe"):
            print(f"report: skipping {path}: not a schema-{SCHEMA_VERSION} results file", file=sys.stderr)
            continue
        results.append(payload)
    return sorted(results, key=_sort_key)


def _label(result: dict) -> str:
    tag = result.get("tag")
    return f"{result.get('recipe')} ({tag})" if tag else str(result.get("recipe"))


def _num(value: Any, decimals: int) -> str:
    return DASH if not isinstance(value, int | float) else f"{value:.{decimals}f}"


def _is_cpu(result: dict) -> bool:
    return _get(result, "memory.kind") == "cpu_rss"


def _batch(result: dict) -> str:
    batch, accum = _get(result, "config.batch_size"), _get(result, "config.accumulation_steps", 1)
    if batch is None:
        return DASH
    if accum and accum > 1:
        micro = _get(result, "config.micro_batch_size", batch // accum)
        return f"{batch} ({micro}×{accum})"
    return str(batch)


def _memory_cells(result: dict) -> tuple[str, str]:
    if result.get("status") == "oom":
        return "OOM", "OOM"
    mark = CPU_MARK if _is_cpu(result) else ""
    cells = (_num(_get(result, f"memory.peak_{k}_gb"), 2) for k in ("reserved", "allocated"))
    return tuple(c + mark if c != DASH else c for c in cells)  # type: ignore[return-value]


def _real_data(result: dict) -> bool:
    """Accuracy is a score only on real data (CIFAR-10, digits, IMDb); the synthetic stand-ins are
    learnable by construction, so their accuracy only shows that a run learns."""
    return _get(result, "provenance.data_source") not in (None, "synthetic")


def _accuracy(result: dict, split: str) -> str:
    return _num(_get(result, f"accuracy.{split}"), 3) if _real_data(result) else DASH


def _data_note(results: list[dict]) -> str:
    """Which rows' accuracy is a score (real data) and which is not shown (synthetic)."""
    real = [f"{_label(r)} ({_get(r, 'provenance.data_source')})" for r in results if _real_data(r)]
    return (
        "Accuracy is shown for runs on real data only"
        + (f": {', '.join(real)}" if real else " (none here)")
        + f". Runs on synthetic data show {DASH}: memory and speed do not depend on the pixel values, and "
        "accuracy on the learnable stand-in is not a score."
    )


def _mode(result: dict) -> str:
    """How the steps ran: "eager", "compiled" (torch.compile) and/or "graphs" (one CUDA graph per step)."""
    parts = [
        name
        for name, key in (("compiled", "config.compile"), ("graphs", "config.cuda_graphs"))
        if _get(result, key)
    ]
    return " + ".join(parts) if parts else "eager"


def _is_text(result: dict) -> bool:
    """Text runs (the bonus recipes) record their padded sequence length; images do not."""
    return _get(result, "provenance.tokens_per_sample") is not None


def _speed_columns(results: list[dict]) -> list[tuple[str, str, int]]:
    """(header, timing key, decimals): img/s for images; samples/s and tokens/s when there is text."""
    text = [_is_text(r) for r in results]
    columns = [] if text and all(text) else [("img/s", "timing.images_per_s", 0)]
    if any(text):
        columns += [("samples/s", "timing.samples_per_s", 1), ("tokens/s", "timing.tokens_per_s", 0)]
    return columns


def render_table(results: list[dict]) -> str:
    """The ladder as a markdown table, one row per run (sorted by recipe, then tag)."""
    speed = _speed_columns(results)
    header = [
        "recipe", "status", "mode", "precision", "batch", "devices", "peak reserved GB", "peak allocated GB",
        *(h for h, _, _ in speed), "optimizer steps", "train acc", "val acc",
    ]  # fmt: skip
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 4 + ["---:"] * (len(header) - 4)) + "|",
    ]
    for r in sorted(results, key=_sort_key):
        reserved, allocated = _memory_cells(r)
        row = [
            _label(r),
            str(r.get("status") or DASH),
            _mode(r),
            str(_get(r, "config.precision", DASH)),
            _batch(r),
            str(_get(r, "provenance.world_size", DASH)),
            reserved,
            allocated,
            *(_num(_get(r, key), decimals) for _, key, decimals in speed),
            str(_get(r, "timing.optimizer_steps", DASH)),
            _accuracy(r, "train"),
            _accuracy(r, "val"),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def render_estimates(results: list[dict]) -> str | None:
    """Predicted (common.estimate, before the run) vs measured peak allocated, per run with an estimate."""
    rows = [r for r in sorted(results, key=_sort_key) if _get(r, "estimate") is not None]
    if not rows:
        return None
    lines = [
        "| recipe | predicted GB | measured allocated GB | error | predicted peak during | attention | compile |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        err = estimate_error_pct(r)
        measured = "OOM" if r.get("status") == "oom" else _num(_get(r, "memory.peak_allocated_gb"), 2)
        if _is_cpu(r) and measured != DASH:
            measured += CPU_MARK
        failed = _get(r, "estimate.error")
        lines.append(
            "| "
            + " | ".join(
                [
                    _label(r),
                    f"failed: {failed}" if failed else _num(_get(r, "estimate.peak_allocated_gb"), 2),
                    measured,
                    DASH if err is None else f"{err:+.1f}%",
                    str(_get(r, "estimate.peak_phase", DASH)),
                    str(_get(r, "estimate.assumptions.attention_kernel", DASH)),
                    "on" if _get(r, "config.compile") else "off",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def _provenance_lines(results: list[dict]) -> list[str]:
    """One line per distinct (device, world size, versions, data, weights): what produced the numbers."""
    groups: dict[tuple, list[str]] = {}
    for r in results:
        p = r.get("provenance") or {}
        key = (
            p.get("gpu_name") or "CPU",
            p.get("world_size"),
            p.get("torch"),
            p.get("lightning"),
            p.get("data_source"),
            p.get("weights"),
        )
        groups.setdefault(key, []).append(_label(r))
    lines = []
    for (device, world, torch_v, lightning_v, data, weights), labels in groups.items():
        lines.append(
            f"- **{device}** · world size {world if world is not None else '?'} · torch {torch_v} · lightning {lightning_v}"
            f" · data: {data} · weights: {weights} — {', '.join(labels)}"
        )
    return lines


def _format_extra(value: Any) -> str:
    if isinstance(value, dict):
        return " · ".join(f"{k} {_format_extra(v)}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.3g}"
    return str(value)


def render_markdown(results: list[dict], image_name: str = "ladder.png") -> str:
    """The whole README.md: title, provenance, figure, table, per-phase peaks and recipe extras."""
    out = [
        "# Results: the memory ladder",
        "",
        "Generated by `python -m common.report` from the JSON files beside it — do not edit by hand.",
        "",
        f"![ladder]({image_name})",
        "",
        "Produced on:",
        "",
        *_provenance_lines(results),
        "",
        render_table(results),
        "",
        "Memory is the peak of the training phase, in GB (1e9 bytes): `allocated` by tensors and "
        "`reserved` by the caching allocator. Throughput counts all ranks together"
        + ("; tokens/s counts padded tokens." if any(_is_text(r) for r in results) else "."),
        "",
        _data_note(results),
    ]
    estimates = render_estimates(results)
    if estimates:
        out += [
            "",
            "## Predicted vs measured peak",
            "",
            "The prediction is made by `common.estimate` before the run (one training step simulated on fake "
            "tensors: weights, gradients, optimizer state, saved activations, backward working memory; "
            "eager graph). Error = (predicted − measured) / measured allocated. Target: within ±10%.",
            "",
            estimates,
        ]
    if any(_is_cpu(r) for r in results):
        out += [
            "",
            f"{CPU_MARK} CPU run: the memory cells hold the process peak resident set size (RSS), not GPU "
            "memory; it includes Python and the libraries and cannot be reset between phases.",
        ]
    phased = [r for r in results if set(_get(r, "memory.phases", {})) - STANDARD_PHASES]
    if phased:
        out += ["", "## Per-phase peaks", "", "| run | phase | peak allocated GB | peak reserved GB |"]
        out.append("|---|---|---:|---:|")
        for r in phased:
            for name, phase in _get(r, "memory.phases", {}).items():
                alloc, res = (_num(_get(phase, f"peak_{k}_gb"), 2) for k in ("allocated", "reserved"))
                out.append(f"| {_label(r)} | {name} | {alloc} | {res} |")
    with_extra = [r for r in results if r.get("extra")]
    if with_extra:
        out += ["", "## Recipe-specific measurements", ""]
        for r in with_extra:
            for key, value in r["extra"].items():
                out.append(f"- **{_label(r)}** `{key}`: {_format_extra(value)}")
    return "\n".join(out) + "\n"


def render_figure(results: list[dict], path: str | os.PathLike) -> None:
    """Two panels in table order: peak memory (reserved bar, allocated bar inside it) and img/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted(results, key=_sort_key)
    labels = [_label(r) + ("" if r.get("status") == "ok" else f" [{r.get('status')}]") for r in results]
    xs = range(len(results))
    oom = [r.get("status") == "oom" for r in results]

    def values(key: str) -> list[float]:  # OOM runs (and missing values) plot as 0, drawn over below
        return [0.0 if r.get("status") == "oom" else float(_get(r, key, 0.0)) for r in results]

    reserved, allocated = values("memory.peak_reserved_gb"), values("memory.peak_allocated_gb")
    speed = values("timing.samples_per_s" if all(_is_text(r) for r in results) else "timing.images_per_s")

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
        _get(r, "estimate.peak_allocated_gb") if estimate_error_pct(r) is not None else None for r in results
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
            label="predicted (common.estimate)",
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

    kinds = {_get(r, "memory.kind") for r in results}
    if kinds == {"cpu_rss"}:
        ax_mem.set_ylabel("process peak RSS (GB, CPU)")
    elif "cpu_rss" in kinds:
        ax_mem.set_ylabel("peak memory (GB; CPU runs: process RSS)")
    else:
        ax_mem.set_ylabel("peak GPU memory (GB)")
    ax_mem.set_title("Peak memory (training phase)")
    ax_mem.legend(fontsize=8)
    ax_speed.set_ylabel("samples / s" if all(_is_text(r) for r in results) else "images / s")
    ax_speed.set_title("Throughput")
    devices = sorted({_get(r, "provenance.gpu_name") or "CPU" for r in results})
    fig.suptitle(f"Fabric memory ladder\n{', '.join(devices)}", fontsize=11)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)


def _write_text(path: Path, text: str) -> None:
    write_atomic(path, lambda f: f.write(text))


def update_block(document: str, block: str, content: str) -> str:
    """Replace the text between ``<!-- results:BLOCK:start -->`` and ``<!-- results:BLOCK:end -->``.

    This is how the top-level README shows measured tables without anyone copying numbers by hand.
    """
    start, end = f"<!-- results:{block}:start -->", f"<!-- results:{block}:end -->"
    i, j = document.find(start), document.find(end)
    if i < 0 or j < i:
        raise ValueError(f"markers {start} ... {end} not found")
    return document[: i + len(start)] + "\n" + content.rstrip() + "\n" + document[j:]


# ------------------------------------------------------------------ comparison with the article's scripts
COMPARISON_MODES = ("eager", "fast")


def load_comparison(path: str | os.PathLike) -> list[dict]:
    """Rows of a ``comparison.json`` written by ``python -m tools.compare_reference``, sorted by rung.

    Raises ValueError when the file is not a list of rows with a "rung" each (a one-line message)."""
    try:
        rows = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: unreadable ({reason})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and r.get("rung") for r in rows):
        raise ValueError(f"{path}: not a comparison file (a JSON list of rows with a 'rung')")
    return sorted(rows, key=lambda r: str(r["rung"]))


def _ok(side: Any) -> bool:
    return isinstance(side, dict) and side.get("status", "ok") == "ok"


def _comparison_cell(side: Any) -> str:
    """'GB / img/s' of one run, or why there is no number."""
    if side is None:
        return DASH
    status = side.get("status", "ok")
    if status != "ok":
        return "OOM" if status == "oom" else str(status)
    return f"{_num(side.get('peak_reserved_gb'), 2)} / {_num(side.get('images_per_s'), 1)}"


def _ratio(a: Any, b: Any, key: str) -> float | None:
    if not (_ok(a) and _ok(b)):
        return None
    x, y = a.get(key), b.get(key)
    return x / y if isinstance(x, int | float) and isinstance(y, int | float) and y else None


def comparison_ratios(row: dict) -> dict[str, float | None]:
    """fast ÷ reference and fast ÷ eager, for throughput and for peak reserved memory. The reference
    ratios are left out (None) for a reference that is not the rung's configuration (``like_for_like``)."""
    ref = row.get("reference") if row.get("like_for_like", True) else None
    fast, eager = row.get("fast"), row.get("eager")
    return {
        "speed_fast_vs_reference": _ratio(fast, ref, "images_per_s"),
        "speed_fast_vs_eager": _ratio(fast, eager, "images_per_s"),
        "reserved_fast_vs_reference": _ratio(fast, ref, "peak_reserved_gb"),
        "reserved_fast_vs_eager": _ratio(fast, eager, "peak_reserved_gb"),
    }


def _times(value: float | None) -> str:
    return DASH if value is None else f"{value:.2f}×"


def render_comparison_table(rows: list[dict]) -> str:
    """One line per rung: the article's script, the rung in eager and fast mode, and the ratios."""
    lines = [
        "| rung | reference script | reference GB / img/s | eager GB / img/s | fast GB / img/s "
        "| img/s fast ÷ reference | img/s fast ÷ eager | GB fast ÷ reference | GB fast ÷ eager |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ref = row.get("reference")
        script = (ref or {}).get("script") or DASH
        if ref is not None and not row.get("like_for_like", True):
            script += " ²"
        elif ref is not None and row.get("reference_note"):
            script += " ¹"
        r = comparison_ratios(row)
        cells = [
            str(row.get("recipe") or row["rung"]),
            f"`{script}`" if ref is not None else DASH,
            _comparison_cell(ref),
            _comparison_cell(row.get("eager")),
            _comparison_cell(row.get("fast")),
            _times(r["speed_fast_vs_reference"]),
            _times(r["speed_fast_vs_eager"]),
            _times(r["reserved_fast_vs_reference"]),
            _times(r["reserved_fast_vs_eager"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _comparison_call(rows: list[dict]) -> dict:
    """What produced the rows (GPU, torch, steps, command, substitutions): the first row that says."""
    return next((r["call"] for r in rows if isinstance(r.get("call"), dict)), {})


def render_comparison_markdown(rows: list[dict], image: str | None = None) -> str:
    """The table with what produced it, the notes it refers to, and the figure when there is one."""
    call = _comparison_call(rows)
    calls = {json.dumps((r.get("call") or {}).get("started")) for r in rows}
    out = []
    if image:
        out += [f"![memory against throughput]({image})", ""]
    out += [render_comparison_table(rows), ""]
    out.append(
        f"{call.get('gpu_name') or 'GPU not recorded'} · torch {call.get('torch') or '?'} · "
        f"{call.get('steps') or '?'} optimizer steps per run · each run its own process, one after another"
        + (" in one call" if len(calls) == 1 else f" ({len(calls)} calls: each row's runs in one call)")
        + ". GB: peak reserved over the whole run (model load included), 1e9 bytes. img/s: effective "
        "batch ÷ median time between optimizer steps, after the warm-up steps."
    )
    if call.get("substitution_note"):
        out += ["", f"Reference runs: {call['substitution_note']}"]
    notes = [(r["rung"], r["reference_note"]) for r in rows if r.get("reference") and r.get("reference_note")]
    for rung, note in notes:
        mark = "²" if not next(r for r in rows if r["rung"] == rung).get("like_for_like", True) else "¹"
        out += ["", f"{mark} {rung}: {note}"]
    commands = [c for c in dict.fromkeys((r.get("call") or {}).get("command") for r in rows) if c]
    if commands:
        out += ["", "Produced by " + "; ".join(f"`{c}`" for c in commands) + "."]
    return "\n".join(out) + "\n"


def _minor_label(value: float, _pos: Any = None) -> str:
    """Label the 2s and 5s between the decades of a log axis (0.2, 0.5, 2, 5, 20, 50, ...)."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa, 6) in (2.0, 5.0) else ""


def render_comparison_figure(rows: list[dict], path: str | os.PathLike) -> bool:
    """Peak reserved memory (log) against throughput (log): each rung's eager point, an arrow to its
    fast point, and the article's script as a cross. Returns False (figure skipped, one line on stderr)
    when matplotlib is not installed or no run has both numbers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib is not installed: comparison figure skipped", file=sys.stderr)
        return False

    def point(side: Any) -> tuple[float, float] | None:
        if not _ok(side):
            return None
        x, y = side.get("images_per_s"), side.get("peak_reserved_gb")
        return (
            (x, y) if isinstance(x, int | float) and isinstance(y, int | float) and x > 0 and y > 0 else None
        )

    points = [(row, {k: point(row.get(k)) for k in ("reference", *COMPARISON_MODES)}) for row in rows]
    if not any(p for _, sides in points for p in sides.values()):
        print("report: no run in the comparison has both numbers: comparison figure skipped", file=sys.stderr)
        return False
    from matplotlib.ticker import FuncFormatter

    # One cross per script of the article (rung 06's script is rung 07's reference too), named by its rungs.
    references: dict[tuple[float, float], list[str]] = {}
    for row, sides in points:
        if sides["reference"]:
            references.setdefault(sides["reference"], []).append(str(row["rung"]))

    fig, ax = plt.subplots(figsize=(9, 6.5))
    for i, (xy, rungs) in enumerate(references.items()):
        ax.scatter(*xy, marker="X", s=70, color="#525252", zorder=3, label=None if i else "article's script")
        ax.annotate(f"{', '.join(rungs)} ref", xy, xytext=(6, -10), textcoords="offset points", fontsize=8)
    for i, (row, sides) in enumerate(points):
        eager, fast = sides["eager"], sides["fast"]
        if eager:
            ax.scatter(
                *eager, marker="o", s=45, facecolors="none", edgecolors="#3182bd", zorder=3, label="_eager"
            )
        if fast:
            ax.scatter(*fast, marker="o", s=45, color="#e6550d", zorder=4, label="_fast")
        if eager and fast:
            ax.annotate(
                "",
                xy=fast,
                xytext=eager,
                arrowprops=dict(arrowstyle="->", color="#969696", lw=1, shrinkA=4, shrinkB=4),
                zorder=2,
            )
        if fast or eager:  # rung label at the fast point (or the eager one), alternating above and below
            ax.annotate(
                str(row["rung"]),
                fast or eager,
                xytext=(5, 5 if i % 2 == 0 else -12),
                textcoords="offset points",
                fontsize=8,
                color="#a63603",
            )
    handles = [
        plt.Line2D([], [], marker="X", ls="", color="#525252", markersize=8, label="article's script"),
        plt.Line2D(
            [], [], marker="o", ls="", mfc="none", mec="#3182bd", markersize=7, label="this project, eager"
        ),
        plt.Line2D([], [], marker="o", ls="", color="#e6550d", markersize=7, label="this project, fast"),
    ]
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(FuncFormatter(_minor_label))
    ax.set_xlabel("throughput (images / s, log scale): more is better →")
    ax.set_ylabel("peak reserved GPU memory (GB, log scale): less is better ↓")
    call = _comparison_call(rows)
    where = " · ".join(
        str(x) for x in (call.get("gpu_name"), f"{call.get('steps') or '?'} optimizer steps per run") if x
    )
    ax.set_title(
        f"Memory against throughput: the article's scripts and this project's rungs\n{where}", fontsize=10
    )
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)
    return True


def write_comparison(rows: list[dict], folder: str | os.PathLike, figure: bool = True) -> bool:
    """FOLDER/comparison.md (the table and its notes) and, with ``figure``, FOLDER/comparison.png (when
    matplotlib is there: returns whether it was drawn). tools.compare_reference writes the table after
    every run and the figure at the end."""
    folder = Path(folder)
    image = folder / "comparison.png"
    drawn = render_comparison_figure(rows, image) if figure else False
    text = render_comparison_markdown(rows, image.name if drawn else None)
    _write_text(folder / "comparison.md", "# Against the article's scripts\n\n" + text)
    return drawn


def comparison_main(path: str, readme: str | None) -> int:
    """``--comparison PATH``: PATH's folder gets comparison.md and comparison.png; ``--readme PATH:BLOCK``
    also gets the table, the notes and the figure (linked relative to that file)."""
    try:
        rows = load_comparison(path)
    except ValueError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    folder = Path(path).parent
    image = folder / "comparison.png"
    drawn = write_comparison(rows, folder)
    print(f"report: {len(rows)} rungs -> {folder / 'comparison.md'}" + (f", {image}" if drawn else ""))
    if readme:
        target, _, block = readme.rpartition(":")
        link = os.path.relpath(image, Path(target).resolve().parent) if drawn else None
        try:
            text = update_block(Path(target).read_text(), block, render_comparison_markdown(rows, link))
        except (OSError, ValueError) as e:
            print(f"report: --readme {readme}: {e}", file=sys.stderr)
            return 2
        _write_text(Path(target), text)
        print(f"report: comparison -> {target} (block {block})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Render RESULTS_DIR/README.md and RESULTS_DIR/ladder.png; exit 2 if there is nothing to render."""
    parser = argparse.ArgumentParser(prog="python -m common.report", description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", nargs="?", default="results", help="directory of results JSON")
    parser.add_argument(
        "--readme",
        metavar="PATH:BLOCK",
        help="also write the table into the marked block BLOCK of the markdown file PATH",
    )
    parser.add_argument(
        "--comparison",
        metavar="JSON",
        help="render a comparison.json of tools.compare_reference instead (table + figure beside it)",
    )
    args = parser.parse_args(argv)
    if args.comparison:
        return comparison_main(args.comparison, args.readme)
    results_dir = Path(args.results_dir)
    if not results_dir.is_dir():
        print(f"report: {results_dir} is not a directory", file=sys.stderr)
        return 2
    results = load_results(results_dir)
    if not results:
        print(f"report: no schema-{SCHEMA_VERSION} results JSON in {results_dir}", file=sys.stderr)
        return 2
    _write_text(results_dir / "README.md", render_markdown(results, "ladder.png"))
    render_figure(results, results_dir / "ladder.png")
    print(f"report: {len(results)} runs -> {results_dir / 'README.md'}, {results_dir / 'ladder.png'}")
    if args.readme:
        path, _, block = args.readme.rpartition(":")
        try:
            text = update_block(Path(path).read_text(), block, render_table(results))
        except (OSError, ValueError) as e:
            print(f"report: --readme {args.readme}: {e}", file=sys.stderr)
            return 2
        _write_text(Path(path), text)
        print(f"report: table -> {path} (block {block})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The comparison with the article's scripts: a ``comparison.json`` written by ``python -m
fabric_memory_recipes.tools.compare.reference`` -> a markdown table (with its notes) and a figure of memory against
throughput. Rendered by ``python -m fabric_memory_recipes.measurement.report.render --comparison PATH``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from fabric_memory_recipes import techniques
from fabric_memory_recipes.measurement.report.cells import DASH, num, write_into_block, write_text
from fabric_memory_recipes.measurement.results_file import write_atomic

COMPARISON_MODES = techniques.subset(techniques.MODES, "eager", "fast")  # the columns of a rung, in order


def load_comparison(path: str | os.PathLike) -> list[dict]:
    """Rows of a ``comparison.json`` written by ``python -m fabric_memory_recipes.tools.compare.reference``, sorted by rung.

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
    return f"{num(side.get('peak_reserved_gb'), 2)} / {num(side.get('images_per_s'), 1)}"


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


def _as_today(command: str) -> str:
    """A recorded comparison command as it is typed today: the console script instead of the module."""
    return re.sub(r"^python3? -m \S*compare[._]reference(?= |$)", "fmr-compare", command)


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
    commands = [_as_today(c) for c in dict.fromkeys((r.get("call") or {}).get("command") for r in rows) if c]
    if commands:
        out += [
            "",
            "Produced by " + "; ".join(f"`{c}`" for c in commands) + " (each row's `call.command` "
            "holds the command as it ran, under the tool's module path of its day).",
        ]
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
    matplotlib is there: returns whether it was drawn). fabric_memory_recipes.tools.compare.reference writes the table after
    every run and the figure at the end."""
    folder = Path(folder)
    image = folder / "comparison.png"
    drawn = render_comparison_figure(rows, image) if figure else False
    text = render_comparison_markdown(rows, image.name if drawn else None)
    write_text(folder / "comparison.md", "# Against the article's scripts\n\n" + text)
    return drawn


DOCS_BLOCK = "modes"  # the block of a rung's docs page that shows its row


def render_rung_block(row: dict, source: str) -> str:
    """A rung page's view of its row: each run's peak reserved memory and throughput, and the ratios."""
    ratios = comparison_ratios(row)
    ref = row.get("reference") if row.get("like_for_like", True) else None
    lines = ["| run | peak reserved GB | img/s |", "|---|---:|---:|"]
    for name, side in (
        ("the article's script", ref),
        ("eager (`--mode eager`)", row.get("eager")),
        ("fast (default on CUDA)", row.get("fast")),
    ):
        if side is None:
            continue
        if _ok(side):
            lines.append(
                f"| {name} | {num(side.get('peak_reserved_gb'), 2)} | {num(side.get('images_per_s'), 1)} |"
            )
        else:
            lines.append(f"| {name} | {side.get('status')} | {side.get('status')} |")
    said = [
        f"{'img/s' if what == 'speed' else 'peak reserved'}: "
        + ", ".join(
            f"fast ÷ {k.split('_vs_')[1]} {_times(v)}" for k, v in ratios.items() if k.startswith(what) and v
        )
        for what in ("speed", "reserved")
        if any(ratios[f"{what}_fast_vs_{b}"] for b in ("reference", "eager"))
    ]
    call = row.get("call") or {}
    out = ["\n".join(lines), ""]
    if said:
        out += ["; ".join(said) + ".", ""]
    out.append(
        f"{call.get('gpu_name') or 'GPU not recorded'}, {call.get('steps') or '?'} optimizer steps per run, "
        f"each run its own process, all of this table's runs in one call. Generated from `{source}` by "
        f"`{'FMR_PUBLISH=1 ' if 'results/published/' in source else ''}python -m"
        f" fabric_memory_recipes.measurement.report.render --comparison {source} --docs docs`."
    )
    return "\n".join(out)


def write_docs_blocks(rows: list[dict], docs: str | os.PathLike, source: str) -> int:
    """``--docs DIR``: each rung's page DIR/<recipe>.md gets its row in its ``modes`` block; 0, or 2 with
    one line per page that has no page or no block."""
    code = 0
    for row in rows:
        page = Path(docs) / f"{row.get('recipe') or row['rung']}.md"
        block = render_rung_block(row, source)
        if write_into_block(f"{page}:{DOCS_BLOCK}", block, f"rung {row['rung']}") != 0:
            code = 2
    return code


def comparison_main(path: str, readme: str | None, docs: str | None = None) -> int:
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
    if docs and write_docs_blocks(rows, docs, Path(path).as_posix()) != 0:
        return 2
    if readme:
        target = readme.rpartition(":")[0]
        link = os.path.relpath(image, Path(target).resolve().parent) if drawn else None
        return write_into_block(readme, render_comparison_markdown(rows, link), "comparison")
    return 0

"""The report: every results JSON in a directory -> a markdown table (README.md) and a figure (ladder.png).

    python -m fabric_memory_recipes.measurement.report.render [RESULTS_DIR]        # default: runs
    python -m fabric_memory_recipes.measurement.report.render --comparison results/published/h100/compare/comparison.json --readme docs/compare_reference.md:comparison

Why a separate step: each recipe runs in its own process and writes only its own JSON, so the ladder is
assembled afterwards from what the runs recorded. Only the schema-1 keys documented in `fabric_memory_recipes.measurement.results_file`
are read, and every number shown comes from those files (principle 3: measure, never claim). A file that
cannot be read is skipped with one line on stderr: one bad file must not hide the rest of the ladder.
Where ``./run_all.sh`` left a ``run_all.json`` (``measurement.run_manifest``), the table and figure show
its last invocation's runs, and results of earlier runs follow apart ("Earlier runs"). Writing into
``results/published/`` needs ``FMR_PUBLISH=1`` (``fabric_memory_recipes.paths``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from fabric_memory_recipes import paths
from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.measurement import run_manifest
from fabric_memory_recipes.measurement.report.cells import (
    DASH,
    format_extra,
    get,
    is_text,
    label,
    mode_label,
    num,
    provenance_lines,
    sort_key,
    write_into_block,
    write_text,
)
from fabric_memory_recipes.measurement.report.comparison import comparison_main
from fabric_memory_recipes.measurement.report.cpu import (
    CPU_NOTE,
    CPU_NOTE_UNPREDICTED,
    load_predicted,
    render_cpu_table,
    render_predicted_figure,
)
from fabric_memory_recipes.measurement.report.figure import render_figure
from fabric_memory_recipes.measurement.report.loading import load_results
from fabric_memory_recipes.measurement.results_file import SCHEMA_VERSION, estimate_error_pct

STANDARD_PHASES = {"train", "eval", "model_load"}
# timed step intervals needed before a speed cell shows a range (p10 and p90 of fewer say little)
MIN_RANGE = 5
CPU_MARK = "¹"  # footnote marker on memory cells that hold process RSS, not GPU memory


def _is_cpu(result: dict) -> bool:
    return get(result, "memory.kind") == "cpu_rss"


def _batch(result: dict) -> str:
    batch, accum = get(result, "config.batch_size"), get(result, "config.accumulation_steps", 1)
    if batch is None:
        return DASH
    if accum and accum > 1:
        micro = get(result, "config.micro_batch_size", batch // accum)
        return f"{batch} ({micro}×{accum})"
    return str(batch)


def _memory_cells(result: dict) -> tuple[str, str]:
    if result.get("status") == "oom":
        return "OOM", "OOM"
    mark = CPU_MARK if _is_cpu(result) else ""
    cells = (num(get(result, f"memory.peak_{k}_gb"), 2) for k in ("reserved", "allocated"))
    return tuple(c + mark if c != DASH else c for c in cells)  # type: ignore[return-value]


def _device_cell(result: dict) -> str:
    """The whole-device peak (``memory.device_peak_gb``); OOM like the other memory cells."""
    return "OOM" if result.get("status") == "oom" else num(get(result, "memory.device_peak_gb"), 2)


def _real_data(result: dict) -> bool:
    """Accuracy is a score only on real data (CIFAR-10, digits, IMDb); the synthetic stand-ins are
    learnable by construction, so their accuracy only shows that a run learns."""
    return get(result, "provenance.data_source") not in (None, "synthetic")


def _accuracy(result: dict, split: str) -> str:
    return num(get(result, f"accuracy.{split}"), 3) if _real_data(result) else DASH


def _data_note(results: list[dict]) -> str:
    """Which rows' accuracy is a score (real data) and which is not shown (synthetic)."""
    real = [f"{label(r)} ({get(r, 'provenance.data_source')})" for r in results if _real_data(r)]
    return (
        "Accuracy is shown for runs on real data only"
        + (f": {', '.join(real)}" if real else " (none here)")
        + f". Runs on synthetic data show {DASH}: memory and speed do not depend on the pixel values, and "
        "accuracy on the learnable stand-in is not a score."
    )


def _speed_columns(results: list[dict]) -> list[tuple[str, str, int]]:
    """(header, timing key, decimals): img/s for images; samples/s and tokens/s when there is text."""
    text = [is_text(r) for r in results]
    columns = [] if text and all(text) else [("img/s", "timing.images_per_s", 0)]
    if any(text):
        columns += [("samples/s", "timing.samples_per_s", 1), ("tokens/s", "timing.tokens_per_s", 0)]
    return columns


def speed_cell(result: dict, key: str, decimals: int) -> str:
    """A rate at the median step, with its range over the timed steps: ``906 (880–915)``.

    The range is the rate at the p90 and at the p10 step interval (``timing.step_s``): the spread from
    step to step within the run. It is left out where the JSON has no ``timing.step_s`` (older runs)."""
    rate, median = get(result, key), get(result, "timing.median_step_s")
    cell = num(rate, decimals)
    slow, fast = get(result, "timing.step_s.p90"), get(result, "timing.step_s.p10")
    if cell == DASH or not (median and slow and fast) or get(result, "timing.timed_intervals", 0) < MIN_RANGE:
        return cell
    low, high = rate * median / slow, rate * median / fast
    return f"{cell} ({low:.{decimals}f}–{high:.{decimals}f})"


SPEED_NOTE = (
    "Speed: at the median interval between optimizer steps after 3 warm-up steps; in brackets the range"
    " over the timed steps (the rate at the p90 and the p10 step interval, `timing.step_s`): the spread"
    f" within one run, not between runs. Rows without brackets: fewer than {MIN_RANGE} timed steps, or a JSON"
    " that predates the spread."
)


def render_table(results: list[dict]) -> str:
    """The ladder as a markdown table, one row per run (sorted by recipe, then tag)."""
    speed = _speed_columns(results)
    device = any(get(r, "memory.device_peak_gb") is not None for r in results)  # whole-device peaks
    header = [
        "recipe",
        "status",
        "mode",
        "precision",
        "batch",
        "devices",
        "peak reserved GB",
        "peak allocated GB",
        *(["device peak GB"] if device else []),
        *(h for h, _, _ in speed),
        "optimizer steps",
        "train acc",
        "val acc",
    ]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 4 + ["---:"] * (len(header) - 4)) + "|",
    ]
    for r in sorted(results, key=sort_key):
        reserved, allocated = _memory_cells(r)
        row = [
            label(r),
            str(r.get("status") or DASH),
            mode_label(r),
            str(get(r, "config.precision", DASH)),
            _batch(r),
            str(get(r, "provenance.world_size", DASH)),
            reserved,
            allocated,
            *([_device_cell(r)] if device else []),
            *(
                speed_cell(r, key, decimals) if i == 0 else num(get(r, key), decimals)
                for i, (_, key, decimals) in enumerate(speed)
            ),
            str(get(r, "timing.optimizer_steps", DASH)),
            _accuracy(r, "train"),
            _accuracy(r, "val"),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def render_estimates(results: list[dict]) -> str | None:
    """Predicted (fabric_memory_recipes.planning, before the run) vs measured peak allocated, per run with an estimate."""
    rows = [r for r in sorted(results, key=sort_key) if get(r, "estimate") is not None]
    if not rows:
        return None
    lines = [
        "| recipe | predicted GB | measured allocated GB | error | predicted peak during | attention | compile |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        err = estimate_error_pct(r)
        measured = "OOM" if r.get("status") == "oom" else num(get(r, "memory.peak_allocated_gb"), 2)
        if _is_cpu(r) and measured != DASH:
            measured += CPU_MARK
        failed = get(r, "estimate.error")
        lines.append(
            "| "
            + " | ".join(
                [
                    label(r),
                    f"failed: {failed}" if failed else num(get(r, "estimate.peak_allocated_gb"), 2),
                    measured,
                    DASH if err is None else f"{err:+.1f}%",
                    str(get(r, "estimate.peak_phase", DASH)),
                    str(get(r, "estimate.assumptions.attention_kernel", DASH)),
                    "on" if get(r, "config.compile") else "off",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def cpu_track(results: list[dict], predicted: dict[str, dict] | None) -> bool:
    """Every run is a CPU ladder run: the report's CPU track (its GB column the predicted ladder, if any)."""
    return (
        bool(results)
        and all(_is_cpu(r) for r in results)
        and (predicted is not None or not any(map(is_text, results)))
    )


def render_markdown(
    results: list[dict],
    image_name: str | None = "ladder.png",
    predicted: dict[str, dict] | None = None,
    earlier: tuple[str, list[dict]] | None = None,
    stopped: bool = False,
) -> str:
    """The whole README.md: title, provenance, figure, table, per-phase peaks and recipe extras. With
    ``predicted`` (``predicted.json``) and only CPU runs: the CPU track's table (fabric_memory_recipes.measurement.report.cpu).
    ``earlier``: (a sentence, the runs) that earlier invocations left in the folder, in their own section."""
    cpu = cpu_track(results, predicted)
    table = render_table(results) if not cpu else render_cpu_table(results, predicted or {}, speed_cell)
    out = [
        "# Results: "
        + (
            "the memory ladder, CPU track"
            if cpu
            else "the bonus cases"
            if results and all(map(is_text, results))
            else "the memory ladder"
        ),
        "",
        "Generated by `fmr-report` (`python -m fabric_memory_recipes.measurement.report.render`) from the JSON files beside it — do not edit by hand.",
        "",
        *([f"![ladder]({image_name})", ""] if image_name else []),
        "Produced on:",
        "",
        *provenance_lines(results),
        "",
        table,
        "",
        (CPU_NOTE if predicted is not None else CPU_NOTE_UNPREDICTED)
        if cpu
        else "Memory is the peak of the training phase, in GB (1e9 bytes): `allocated` by tensors and "
        "`reserved` by the caching allocator"
        + (
            "; `device peak` is the whole run's peak of the whole device as the process used it (CUDA"
            " context and libraries included: what a card must hold; `memory.device_method` says how)"
            if any(get(r, "memory.device_peak_gb") is not None for r in results)
            else ""
        )
        + ". Throughput counts all ranks together"
        + ("; tokens/s counts padded tokens." if any(is_text(r) for r in results) else "."),
        "",
        SPEED_NOTE,
        "",
        _data_note(results),
    ]
    estimates = None if cpu else render_estimates(results)  # the CPU track: its RSS is no GPU peak
    if estimates:
        out += [
            "",
            "## Predicted vs measured peak",
            "",
            "The prediction is made by `fabric_memory_recipes.planning` before the run (one training step simulated on fake "
            "tensors: weights, gradients, optimizer state, saved activations, backward working memory; "
            "eager graph). Error = (predicted − measured) / measured allocated. Target: within ±10%.",
            "",
            estimates,
        ]
    if any(_is_cpu(r) for r in results) and not cpu:
        out += [
            "",
            f"{CPU_MARK} CPU run: the memory cells hold the process peak resident set size (RSS), not GPU "
            "memory; it includes Python and the libraries and cannot be reset between phases.",
        ]
    # On the CPU track a phase's "peak" is the process RSS so far (never reset): no per-phase story.
    phased = [r for r in results if set(get(r, "memory.phases", {})) - STANDARD_PHASES and not cpu]
    if phased:
        out += ["", "## Per-phase peaks", "", "| run | phase | peak allocated GB | peak reserved GB |"]
        out.append("|---|---|---:|---:|")
        for r in phased:
            for name, phase in get(r, "memory.phases", {}).items():
                alloc, res = (num(get(phase, f"peak_{k}_gb"), 2) for k in ("allocated", "reserved"))
                out.append(f"| {label(r)} | {name} | {alloc} | {res} |")
    with_extra = [r for r in results if r.get("extra")]
    if with_extra:
        out += ["", "## Recipe-specific measurements", ""]
        for r in with_extra:
            for key, value in r["extra"].items():
                out.append(f"- **{label(r)}** `{key}`: {format_extra(value)}")
    if stopped:  # run_all.json's state: Ctrl-C or SIGTERM ended the ladder
        out[1:1] = [
            "",
            f"> **Stopped before it finished**: this `./run_all.sh` was interrupted after {len(results)} run(s).",
        ]
    if earlier and earlier[1]:
        out += ["", "## Earlier runs", "", earlier[0], "", render_table(earlier[1])]
    elif earlier and earlier[0]:  # every row is an earlier run: said under the title
        out[1:1] = ["", f"> {earlier[0]}"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Render RESULTS_DIR/README.md and RESULTS_DIR/ladder.png; exit 2 if there is nothing to render."""
    parser = Parser(
        prog="python -m fabric_memory_recipes.measurement.report.render", description=__doc__.splitlines()[0]
    )
    parser.add_argument("results_dir", nargs="?", default=paths.RUNS, help="directory of results JSON")
    parser.add_argument(
        "--readme",
        metavar="PATH:BLOCK",
        help="also write the table into the marked block BLOCK of the markdown file PATH",
    )
    parser.add_argument(
        "--comparison",
        metavar="JSON",
        help="render a comparison.json of fabric_memory_recipes.tools.compare.reference instead (table + figure beside it)",
    )
    parser.add_argument(
        "--docs",
        metavar="DIR",
        help="with --comparison: also write each rung's row into the 'modes' block of DIR/<recipe>.md",
    )
    args = parser.parse_args(argv)
    if args.docs and not args.comparison:
        parser.error("--docs goes with --comparison")
    results_dir = Path(args.comparison).parent if args.comparison else Path(args.results_dir)
    if refusal := paths.refusal(results_dir, "report: cannot render into"):  # committed evidence
        print(refusal, file=sys.stderr)
        return 2
    if args.comparison:
        return comparison_main(args.comparison, args.readme, args.docs)
    if not results_dir.is_dir():
        print(f"report: {results_dir} is not a directory", file=sys.stderr)
        return 2
    last = run_manifest.load(results_dir)  # the last ./run_all.sh here: its runs apart from earlier ones
    results = load_results(results_dir, last and last.wrote)
    earlier = load_results(results_dir, last.did_not_write) if last else []
    note = last.earlier_note(only_earlier=not results) if last else ""
    only_earlier = not results and bool(earlier)
    if only_earlier:  # it wrote nothing: the earlier runs are all there is, and say so
        results, earlier = earlier, []
        print(f"report: {note}", file=sys.stderr)
    elif not earlier:  # every result is the last invocation's: nothing to set apart
        note = ""
    if not results:
        print(f"report: no schema-{SCHEMA_VERSION} results JSON in {results_dir}", file=sys.stderr)
        return 2
    predicted = load_predicted(results_dir)
    figure = results_dir / "ladder.png"
    try:
        if cpu_track(results, predicted) and predicted is not None:
            render_predicted_figure(results, predicted, figure)
        else:
            render_figure(results, figure)
    except ImportError:  # matplotlib is optional for the table: the figure is skipped with one line
        print("report: matplotlib is not installed: table written, figure skipped", file=sys.stderr)
        figure = None
    stopped = bool(last) and last.state == "stopped"
    markdown = render_markdown(results, figure and figure.name, predicted, (note, earlier), stopped)
    write_text(results_dir / "README.md", markdown)
    also, where = f" (and {len(earlier)} earlier, apart)" if earlier else "", results_dir / "README.md"
    print(
        f"report: {len(results)} run{'s' * (len(results) != 1)}{also} -> {where}"
        + (f", {figure}" if figure else "")
    )
    if args.readme:
        return write_into_block(args.readme, render_table(results), "table")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

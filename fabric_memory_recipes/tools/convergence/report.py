"""The convergence benchmark's report, rendered from the runs' JSON files alone (see
:mod:`fabric_memory_recipes.tools.convergence.benchmark`): the table of test accuracy per rung against the fp32
baseline, the bf16 fixes, the loss-curve figure, and the README block (each group of runs summed up by
:mod:`~fabric_memory_recipes.tools.convergence.run_stats`).

    python -m fabric_memory_recipes.tools.convergence.benchmark --report DIR [--readme README.md:convergence]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from fabric_memory_recipes.measurement.report.cells import DASH, write_into_block
from fabric_memory_recipes.measurement.report.loading import load_results
from fabric_memory_recipes.measurement.results_file import write_atomic
from fabric_memory_recipes.tools.convergence.calls import device_seconds, later_call, own_policy_note
from fabric_memory_recipes.tools.convergence.figure import render_figure
from fabric_memory_recipes.tools.convergence.run_stats import (
    BASELINE,
    group_stats,
    groups,
    mean_sd,
    own_policy,
    percent,
    plus_minus,
    short_name,
)


def differences(s: dict[str, Any], base: dict[str, Any], isolated: dict[str, str] | None = None) -> list[str]:
    """What a group measurably does differently from the baseline: the candidate causes of a gap.
    ``isolated``: per precision, what the rung that differs from the baseline in precision alone measured."""
    out = []
    if s["precision"] != base["precision"]:
        lost, base_lost = mean_sd(s["lost"])[0], mean_sd(base["lost"])[0]
        text = f"precision {s['precision']}"
        if lost is not None:
            text += f" (lost updates {percent(lost)} of parameters per step vs {percent(base_lost)})"
        elif (isolated or {}).get(s["precision"]) and s["rule"] in (None, "plain"):
            text += f" ({isolated[s['precision']]})"
        out.append(text)
    if s["rule"] not in (None, "plain"):
        out.append(f"--bf16-update {s['rule']}")
    if short_name(s["optimizer"]) != short_name(base["optimizer"]) or s["lr"] != base["lr"]:
        out.append(
            f"{short_name(s['optimizer'])} lr {s['lr']:g} vs {short_name(base['optimizer'])} lr {base['lr']:g}"
        )
    out += own_policy(s, base)
    steps, base_steps = mean_sd(s["steps"])[0], mean_sd(base["steps"])[0]
    if s["batch"] != base["batch"] or steps != base_steps:
        micro = (
            f" ({s['micro']}×{s['batch'] // s['micro']})" if s["micro"] and s["micro"] != s["batch"] else ""
        )
        out.append(
            f"batch {s['batch']}{micro}: {steps:.0f} optimizer steps vs {base_steps:.0f}"
            if steps is not None and base_steps is not None
            else f"batch {s['batch']} vs {base['batch']}"
        )
    loss, base_loss = mean_sd(s["loss"])[0], mean_sd(base["loss"])[0]
    if loss is not None and base_loss is not None:
        out.append(f"final training loss {loss:.3f} vs {base_loss:.3f}")
    return out


def isolated_precision(acc: dict, base: dict[str, Any]) -> dict[str, str]:
    """Per precision, what the rung that changes nothing but the precision measured against the baseline
    (same batch, optimizer and learning-rate policy: rung 03 for bf16-true), with its Kahan fix when it ran:
    the measured part of the gap of every later rung that keeps that precision."""
    base_mean = mean_sd(base["test"])[0]
    found: dict[str, str] = {}
    same = ("batch", "micro", "short", "lr", "warmup", "epochs")  # all but the precision
    for (recipe, variant), runs in sorted(acc.items()):
        s = group_stats(runs)
        if variant != "default" or recipe == BASELINE or base_mean is None or s["precision"] in found:
            continue
        if s["precision"] == base["precision"] or [s[k] for k in same] != [base[k] for k in same]:
            continue
        mean, lost = mean_sd(s["test"])[0], mean_sd(s["lost"])[0]
        if mean is None:
            continue
        text = f"{recipe[:2]} changes only that: {mean - base_mean:+.3f}" + (
            f", {percent(lost)} of updates lost" if lost is not None else ""
        )
        kahan = mean_sd(group_stats(acc.get((recipe, "kahan"), []))["test"])[0]
        found[s["precision"]] = text + (
            f"; with --bf16-update kahan {kahan - base_mean:+.3f}" if kahan is not None else ""
        )
    return found


def render_table(results: list[dict]) -> str:
    """Mean ± sd of held-out test accuracy per rung (and bf16 variant), flagged against the baseline."""
    acc, _ = groups(results)
    base = group_stats(acc.get((BASELINE, "default"), []))
    base_mean, base_sd = mean_sd(base["test"])
    isolated = isolated_precision(acc, base)
    lines = [
        "| rung | variant | precision | optimizer | batch | optimizer steps | test accuracy | final train loss¹"
        " | lost updates / step | vs baseline |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for (recipe, variant), runs in sorted(acc.items()):
        s = group_stats(runs)
        mean = mean_sd(s["test"])[0]
        if (recipe, variant) == (BASELINE, "default"):
            verdict = "baseline"
        elif mean is None or base_mean is None or base_sd is None:
            verdict = DASH
        elif abs(mean - base_mean) > 2 * base_sd:
            verdict = f"**outside ± 2 sd** ({mean - base_mean:+.3f}): " + "; ".join(
                differences(s, base, isolated)
            )
        else:
            verdict = f"within ({mean - base_mean:+.3f})"
        if s["ok"] < s["runs"]:
            verdict += f" — {s['runs'] - s['ok']} run(s) not finished: {', '.join(s['not_ok'])}"
        steps = mean_sd(s["steps"])[0]
        row = [
            recipe,
            variant,
            str(s["precision"] or DASH),
            (
                f"{short_name(s['optimizer'])} {s['lr']:g}"
                if s["lr"] is not None
                else short_name(s["optimizer"])
            )
            + "".join(f", {note}" for note in own_policy(s, base)),
            str(
                s["batch"]
                if s["micro"] in (None, s["batch"])
                else f"{s['batch']} ({s['micro']}×{s['batch'] // s['micro']})"
            ),
            DASH if steps is None else f"{steps:.0f}",
            plus_minus(s["test"]),
            plus_minus(s["loss"]),
            percent(mean_sd(s["lost"])[0]),
            verdict,
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


TABLE_NOTE = (
    "¹ Final training loss: the mean of the loss curve's last tenth (about the last 10% of the steps),"
    " averaged over seeds. Lost updates / step: the mean over sampled steps of the fraction of parameters"
    " whose update would move them in fp32 but whose effective weight did not move (fabric_memory_recipes/training/techniques/bf16.py),"
    " measured where shown (`--lost-seeds`: on those seeds, without CUDA graphs)."
)


def render_fixes(results: list[dict]) -> str | None:
    """The bf16 fixes against fp32 master weights: final training loss, accuracy, lost updates, memory."""
    acc, mem = groups(results)
    adam, sgd = ("02_mixed_precision", "default"), ("06_sgd_cosine", "mixed")
    rules = ("default", "plain", "stochastic", "kahan")

    def rule(recipe: str, variant: str) -> str:  # the rule the runs recorded; "default" names the rung's own
        runs = acc.get((recipe, variant)) or [mem.get((recipe, variant)) or {}]
        found = (runs[0].get("updates") or {}).get("rule") or ("plain" if variant == "default" else variant)
        return f"{found} (default)" if variant == "default" else found

    pairs = [(*adam, "Adam: 16-mixed (rung 02)", adam)]
    pairs += [
        ("03_true_half_precision", v, f"Adam: bf16-true {rule('03_true_half_precision', v)} (rung 03)", adam)
        for v in rules
    ]
    pairs += [(*sgd, "SGD: 16-mixed (rung 06 --precision 16-mixed)", sgd)]
    pairs += [
        ("06_sgd_cosine", v, f"SGD: bf16-true {rule('06_sgd_cosine', v)} (rung 06)", sgd) for v in rules
    ]
    pairs += [
        ("14_memory_floor", v, f"SGD in backward: bf16-true {rule('14_memory_floor', v)} (rung 14)", None)
        for v in rules
    ]
    rows = [row for row in pairs if row[:2] in acc or row[:2] in mem]
    if not rows:
        return None
    with_memory = any(row[:2] in mem for row in rows)
    lines = [
        "| run | final train loss¹ | test accuracy | vs 16-mixed | lost updates / step"
        + (" | ViT-L/16 peak allocated GB | ViT-L/16 peak reserved GB |" if with_memory else " |"),
        "|---|---:|---:|---:|---:|" + ("---:|---:|" if with_memory else ""),
    ]
    for recipe, variant, label, reference in rows:
        s = group_stats(acc.get((recipe, variant), []))
        ref = mean_sd(group_stats(acc.get(reference, []))["test"])[0] if reference else None
        mean = mean_sd(s["test"])[0]
        gap = DASH if mean is None or ref is None else f"{mean - ref:+.3f}"
        m = mem.get((recipe, variant)) or {}
        memory = m.get("memory") or {}
        cells = [
            "OOM" if m.get("status") == "oom" else (DASH if memory.get(k) is None else f"{memory[k]:.2f}")
            for k in ("peak_allocated_gb", "peak_reserved_gb")
        ]
        lines.append(
            f"| {label} | {plus_minus(s['loss'])} | {plus_minus(s['test'])} | {gap} | {percent(mean_sd(s['lost'])[0])} |"
            + ("".join(f" {c} |" for c in cells) if with_memory else "")
        )
    return "\n".join(lines)


def _provenance(results: list[dict], settings: dict[str, Any]) -> list[str]:
    acc, _ = groups(results)
    runs = [r for rs in acc.values() for r in rs]
    kinds = sorted(
        {
            f"{(r.get('provenance') or {}).get('gpu_name') or 'CPU'} · torch {(r.get('provenance') or {}).get('torch')}"
            f" · data {(r.get('provenance') or {}).get('data_source')} · model {(r.get('provenance') or {}).get('model')}"
            f" ({(r.get('provenance') or {}).get('weights')} init)"
            for r in runs
        }
    )
    lines = [f"- {k}" for k in kinds]
    if settings:
        size = settings.get("image_size")
        warm = settings.get("warmup_epochs")
        lines.append(
            f"- settings: {settings.get('epochs')} epochs for every run"
            + (f", {warm:g} epoch(s) of linear warm-up (--warmup-steps)" if warm else ", no warm-up")
            + f", Adam lr {settings.get('adam_lr')}, SGD lr {settings.get('sgd_lr')}"
            + (f", {size} px input" if size else "")
            + f", mode {settings.get('mode')}, seeds {settings.get('seeds')}, {settings.get('parallel')} runs"
            f" at a time, extra recipe flags {settings.get('extra_flags') or 'none'}; data: {settings.get('data')}"
        )
    return lines


def render_markdown(results: list[dict], summary: dict[str, Any], figure: str | None) -> str:
    settings = summary.get("settings") or {}
    wall = summary.get("wall_s")
    out = [
        "# Convergence: every rung against the fp32 baseline, on real data",
        "",
        "Generated by `fmr-convergence --report` (`python -m fabric_memory_recipes.tools.convergence.benchmark"
        " --report`) from the JSON files beside it — do not edit by hand. Every run trains on scikit-learn's digits (real 8×8 images, fixed stratified splits) from"
        " random initial weights, for the same number of epochs (the same samples) with the same"
        " learning-rate policy"
        + own_policy_note(summary)
        + "; accuracy is over the whole held-out test split. Each rung keeps its own"
        " precision, batch, accumulation, optimizer, schedule and memory technique."
        f" The model: `{settings.get('model')}`"
        + (f" at {settings['image_size']} px" if settings.get("image_size") else "")
        + ".",
        "",
        "Produced on:",
        "",
        *_provenance(results, settings),
        *(
            [
                f"- {'the first call' if summary.get('later_calls') else 'the whole benchmark'} took {wall:.0f} s (wall)"
            ]
            if isinstance(wall, int | float)
            else []
        ),
        *[later_call(call) for call in summary.get("later_calls") or []],
        *(
            [f"- GPU time of the whole benchmark: {total:.0f} s ({total / 60:.1f} min), every call together"]
            if summary.get("later_calls") and (total := device_seconds(summary)) is not None
            else []
        ),
        "",
        "## Test accuracy per rung",
        "",
        "A rung is flagged when its mean is outside the baseline's mean ± 2 sd; the flag lists what the rung"
        " measurably does differently (the candidate causes).",
        "",
        render_table(results),
        "",
        TABLE_NOTE,
    ]
    fixes = render_fixes(results)
    if fixes:
        out += [
            "",
            "## bf16 weights: plain rounding, stochastic rounding, Kahan summation, fp32 master weights",
            "",
            "Lost updates: per sampled step, the fraction of parameters whose update would move them in"
            " fp32 but whose effective weight did not move (fabric_memory_recipes/training/techniques/bf16.py; stochastic rounding leaves many"
            " unchanged by design). Memory: ViT-L/16, 10 steps on synthetic data, rung defaults, when measured on a GPU.",
            "",
            fixes,
        ]
    if figure:
        out += ["", "## Loss curves", "", f"![loss curves]({figure})"]
    return "\n".join(out) + "\n"


def render(out: Path, readme: str | None = None) -> int:
    """Render OUT/README.md and OUT/loss_curves.png from OUT/runs/*.json (and OUT/benchmark.json)."""
    out = Path(out)
    results = load_results(out / "runs")
    if not results:
        print(f"[convergence] no results JSON in {out / 'runs'}", file=sys.stderr)
        return 2
    summary_path = out / "benchmark.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    render_figure(groups(results)[0], out / "loss_curves.png")
    write_atomic(out / "README.md", lambda f: f.write(render_markdown(results, summary, "loss_curves.png")))
    print(f"[convergence] report: {out / 'README.md'}, {out / 'loss_curves.png'}")
    if readme:  # the table and the figure, into a marked block of another markdown file
        figure = os.path.relpath(out / "loss_curves.png", Path(readme.rpartition(":")[0]).resolve().parent)
        content = f"{render_table(results)}\n\n{TABLE_NOTE}\n\n![loss curves]({figure})"
        return write_into_block(readme, content, "convergence table and figure")
    return 0

"""``python -m fabric_memory_recipes.planning --fit 6GB``: the planner's run and what it prints (its flags
are fmr-estimate's one parser's, planning/arguments.py), and the parsing of ``--fit`` and ``--gpu`` values.

Exit code: 0 something fits, 1 nothing fits (the smallest predicted peak and its command are printed),
2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from fabric_memory_recipes.console import fail
from fabric_memory_recipes.planning.overhead import RESERVED_RULE
from fabric_memory_recipes.planning.plan import GB
from fabric_memory_recipes.planning.planner import calibration
from fabric_memory_recipes.planning.planner.fit import Fit, Planner, SimulationCache
from fabric_memory_recipes.planning.simulation.allocator import RESIDUAL, RESIDUAL_SOURCE

SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(gb|g|gib|mb|m|mib)?\s*$", re.IGNORECASE)
UNITS = {"gb": 1.0, "g": 1.0, "gib": 2**30 / GB, "mb": 1e-3, "m": 1e-3, "mib": 2**20 / GB}


def parse_size(text: str) -> float:
    """'6GB', '6', '6.5 GB', '512MB', '8GiB' -> GB (1e9 bytes); ValueError otherwise."""
    match = SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"--fit {text!r}: expected a memory size such as 6GB, 6.5GB, 512MB, 8GiB or 6 (GB)")
    return float(match.group(1)) * UNITS[(match.group(2) or "gb").lower()]


def budget_text(gb: float, written: str | None = None) -> str:
    """A budget as the answer shows it: in GB to the cards' two decimals, so that a pick under it never
    reads as over (8GiB is 8.589934592 GB: shown as 8.58993 beside a pick of 8.59, it read as over), with
    the size as the user wrote it when that was in another unit: '8GiB = 8.59 GB'."""
    shown = f"{gb:.2f}".rstrip("0").rstrip(".") if gb >= 0.1 else f"{gb:g}"  # 0.001 GB stays 0.001
    match = SIZE.match(written or "")
    if match and (match.group(2) or "gb").lower() not in ("gb", "g"):
        return f"{written.strip()} = {shown} GB"
    return f"{shown} GB"


GPU_KIND = re.compile(r"^[a-z]{1,4}\d{1,4}[a-z]?$")  # what results_file.gpu_slug makes of a GPU's name


def gpu_kind(text: str) -> str:
    """An argparse ``type`` for ``--gpu``: a kind such as h100, h200, a100, l40s (lower-cased)."""
    kind = text.strip().lower()
    if not GPU_KIND.match(kind):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a GPU kind: expected a name such as h100, h200, a100 or l40s"
        )
    return kind


def join_fit_value(argv: list[str]) -> list[str]:
    """``--fit -3GB`` -> ``--fit=-3GB``: argparse takes a value that starts with '-' for a flag, so a
    negative size would be 'expected one argument' instead of what is wrong with it."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--fit" and out[i + 1].startswith("-") and out[i + 1][1:2].isdigit():
            out[i : i + 2] = [f"--fit={out[i + 1]}"]
            break
    return out


def budget(args: argparse.Namespace) -> float | None:
    """``--fit SIZE`` in GB (None without it); a malformed size is one line and exit 2."""
    try:
        return parse_size(args.fit) if args.fit is not None else None
    except ValueError as e:
        fail(str(e))


def to_json(fit: Fit) -> dict[str, Any]:
    return {
        "budget_gb": fit.budget_gb,
        "batch_size": fit.batch_size,
        "model": fit.model,
        "gpu": fit.gpu,
        "fits": [c.to_dict() for c in fit.fits],
        "rejected": fit.rejected.to_dict() if fit.rejected else None,
        "smallest": fit.smallest.to_dict() if fit.smallest else None,
        "reserved_rule": RESERVED_RULE,
        "reserved_residual": RESIDUAL,
        "overhead": {m: o.to_dict() for m, o in fit.overheads.items()},
        "answers_for": "a card" if all(o.gb is not None for o in fit.overheads.values()) else "the allocator",
        "searched": {
            "candidates": fit.considered,
            "simulated": fit.cache.simulated,
            "ruled_out_unsimulated": fit.bounded,
        },
    }


def _row(i: Any, c) -> str:
    source = "measured" if c.speed_source.startswith("measured") else "model"
    return f"  {i!s:>2} {c.images_per_s:7.0f} {source:<9}{c.card_gb:7.2f}   {c.label()}\n       {c.command}"


def _budget_lines(fit: Fit) -> list[str]:
    """What the budget means: a card (peak reserved + the measured overhead), or, where nothing
    measured the overhead, only what the allocator may reserve."""
    if all(o.gb is not None for o in fit.overheads.values()):
        return [
            "  (a card of that size: card GB = predicted peak reserved + what the process holds outside"
            " PyTorch's caching allocator, CUDA context, libraries and kernels, as measured:",
            *(f"   {m}: {o.source}" for m, o in fit.overheads.items()),
            "  )",
        ]
    return [
        "  (no measured card overhead: the budget is what PyTorch's caching allocator may reserve; a card"
        " also holds the CUDA context, libraries and kernels on top, which nothing measured here gives)",
    ]


def render(fit: Fit, verbose: bool = False, written: str | None = None) -> str:
    """The answer as text; ``written``: ``--fit``'s size as given (:func:`budget_text`)."""
    size = budget_text(fit.budget_gb, written)
    lines = [
        f"Which configurations fit {size}? {fit.model}, effective batch {fit.batch_size},"
        f" throughput on {fit.gpu}",
        *_budget_lines(fit),
        "",
    ]
    header = "   # img/s   source    card GB   configuration\n       command"
    if fit.fits:
        lines += [f"Fastest that fit (predicted whole-device peak <= {size}):", header]
        lines += [_row(i, c) for i, c in enumerate(fit.fits, 1)]
    else:
        s = fit.smallest
        lines += [
            f"Nothing fits in {size}. The smallest predicted peak is {s.card_gb:.2f} GB"
            f" (the allocator replay's {s.replayed_gb:.2f} GB reserved x {RESIDUAL}"
            f" + {s.overhead_gb:.2f} GB outside the allocator):",
            header,
            _row("-", s),
        ]
    if fit.rejected:
        lines += ["", "Fastest rejected as too big:", _row("x", fit.rejected)]
    elif fit.fits:
        lines += ["", "Nothing faster than these was predicted too big."]
    lines += [
        "",
        f"Searched {fit.considered} configurations; simulated {fit.cache.simulated} in this call"
        f" ({fit.cache.seconds:.1f} s), the rest from the cache, ruled out by arithmetic (weights +"
        " gradients + optimizer state over the budget) or slower than the picks.",
        f"Peak reserved = the simulated step replayed through a model of the caching allocator x {RESIDUAL}:",
        f"  the largest measured/replayed ratio of the committed eager runs ({RESIDUAL_SOURCE})",
        f"img/s: 'measured' = median of committed {fit.gpu} runs of that command; 'model' = "
        + (
            f"calibrated on the committed {fit.gpu} runs ({fit.speed.own} constants; the rest from"
            f" {calibration.REFERENCE_GPU}'s, as listed)"
            if fit.gpu != calibration.REFERENCE_GPU and fit.speed.own
            else f"calibrated on the committed {fit.gpu} runs"
            if fit.speed.own
            else f"no committed {fit.gpu} run determines it: {calibration.REFERENCE_GPU}'s calibration"
        )
        + ":",
        *(f"  {line}" for line in fit.speed.lines(sources=verbose)),
        *([] if verbose else ["  (--verbose: the committed runs behind each constant)"]),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The ladder's planner for fmr-estimate's parsed flags (planning/arguments.py: --model and --batch-size
    already the planner's own, vit_l_16 and 16, unless given)."""
    args.budget_gb = budget(args)
    try:
        planner = Planner(
            args.batch_size,
            args.model,
            args.gpu,
            precisions=args.precisions,
            modes=args.modes,
            optimizers=args.optimizers,
            folders=tuple(args.results),
            cache=SimulationCache(use_disk=not args.no_cache),
        )
    except LookupError as e:
        fail(str(e))
    fit = planner.fit(args.budget_gb, args.top)
    try:
        print(
            json.dumps(to_json(fit), indent=2) if args.json else render(fit, args.verbose, args.fit),
            flush=True,
        )
    except BrokenPipeError:  # the reader (head, a pager) stopped early: not an error of the planner
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if fit.fits else 1

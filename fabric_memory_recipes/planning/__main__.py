"""``fmr-estimate`` (``python -m fabric_memory_recipes.planning``): predicted peak memory, and what fits a card.

Without ``--check``, ``--fit`` or ``--ladder``: the component table (or JSON) of a rung's predicted peak.
``--check DIR...``: predicted against measured for every results JSON there. ``--fit 6GB``: which
configurations of the ladder fit a GPU memory budget, fastest first (planning/planner/cli.py). ``--ladder DIR``: every
rung with a results JSON in DIR predicted at full size (DIR/predicted.json, shown by the report). One parser
takes every mode's flags (planning/arguments.py); the mode is chosen from what it parsed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from fabric_memory_recipes import paths, processes
from fabric_memory_recipes.config import Hardware, RunConfig, UsageError
from fabric_memory_recipes.console import fail
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.planning import arguments
from fabric_memory_recipes.planning.check import check_results, render_check
from fabric_memory_recipes.planning.ladder import predict_ladder
from fabric_memory_recipes.planning.overhead import card_prediction
from fabric_memory_recipes.planning.plan import plan_for
from fabric_memory_recipes.planning.planner import cli as fit_cli
from fabric_memory_recipes.planning.plots import plot_check, plot_timeline
from fabric_memory_recipes.planning.simulation.simulate import simulate
from fabric_memory_recipes.planning.your_model import cli as user_cli
from fabric_memory_recipes.training.models import meta_ladder_model
from fabric_memory_recipes.training.your_model import models

MODES_HELP = arguments.MODES_HELP


def _estimate_config(args: argparse.Namespace) -> tuple[RunConfig, dict[str, Any], str]:
    """A rung's estimate: the --recipe rung (or the ladder's defaults) with the flags given, checked as a
    run's flags are (for a GPU machine unless --accelerator cpu); the estimator's overrides; the label."""
    rung, label = RunConfig(), "custom"
    if args.recipe is not None:
        try:
            rung, _ = declared_rung(paths.plain_name(args.recipe, "--recipe"))  # a name, not a path
        except (FileNotFoundError, ValueError, SyntaxError, UsageError) as e:
            fail(str(e))
        label = rung.recipe
    flags = arguments.filled(args, rung)
    overrides: dict[str, Any] = {"attention": args.attention}
    if args.optimizer:
        overrides["optimizer"] = args.optimizer
    if args.checkpoint:
        overrides["activation_checkpointing"] = tuple(c for c in args.checkpoint.split(",") if c)
    if flags["model"] not in rung.model_choices:
        fail(
            f"--model {flags['model']!r} is not one of: {', '.join(rung.model_choices)}; your own model:"
            f" {models.EXAMPLES} (docs/your_model.md)"
        )
    try:
        cfg = rung.with_flags(**flags).checked(Hardware.planned())  # 'auto': predict for a GPU
    except UsageError as e:
        fail(str(e))
    return cfg, overrides, label


def _ladder(folder: str) -> int:
    """--ladder DIR: every rung predicted at full size into DIR/predicted.json."""
    if refusal := paths.refusal(folder, "--ladder"):  # it writes predicted.json there
        fail(refusal)
    if problem := paths.folder_problem(folder) or _unwritable(folder):
        fail(f"--ladder {folder}: {problem}")
    start = time.perf_counter()
    print(f"Predicting each rung at full size (ViT-L/16, GPU config) for {folder}:")
    payload = predict_ladder(folder)
    print(f"  -> {folder}/predicted.json ({time.perf_counter() - start:.0f} s)")
    return 0 if payload["rows"] and all(r["error"] is None for r in payload["rows"]) else 2


def _check(args: argparse.Namespace) -> int:
    """--check DIR...: predicted against measured for every results JSON there."""
    missing = [d for d in args.check if not os.path.isdir(d)]
    if missing:
        fail(f"--check: no such folder: {', '.join(missing)}")
    # the files it skipped that could not be read, or why nothing was compared: on stderr
    rows = check_results(args.check, say=lambda line: print(line, file=sys.stderr))
    if not rows:
        return 2
    print(json.dumps(rows, indent=2) if args.json else render_check(rows))
    if args.plot:
        plot_check(rows, args.plot)
    return 0


def _unwritable(folder: str) -> str | None:
    """Why predicted.json cannot be written into ``folder``: found by making it and a temporary file in
    it, before the minutes of predicting (a folder this made is removed again)."""
    made = not os.path.exists(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        return e.strerror or str(e)
    finally:
        if made and os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)
    return None


def card_lines(card: dict[str, Any]) -> str:
    """The card below the component table: peak reserved (the allocator replay, and x the margin a
    planner budgets) and the whole-device peak, with their sources."""
    device = card["device_peak_gb"]
    if card["replayed_reserved_gb"] is None:  # several processes: the sharded ratio
        reserved = f"  {'peak reserved':<22}{card['peak_reserved_gb']:>11.3f}   {card['reserved_rule']}"
    else:
        reserved = (
            f"  {'peak reserved':<22}{card['peak_reserved_gb']:>11.3f}   the allocator replay's"
            f" {card['replayed_reserved_gb']:.3f} x {card['reserved_residual']} (planning/reserved.py)"
        )
    return "\n".join(
        [
            reserved,
            f"  {'whole-device peak':<22}{device:>11.3f}   + {card['overhead_gb']:.3f} GB outside the allocator"
            f" ({card['overhead_source']})"
            if device is not None
            else f"  {'whole-device peak':<22}{'unknown':>11}   {card['overhead_source']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m fabric_memory_recipes.planning``: one parse of the command line (planning/arguments.py),
    then the mode it asks for: your own model (planning/your_model/cli.py), the ladder's ``--fit``
    planner (planning/planner/cli.py), ``--ladder``, ``--check``, or a rung's component table (or JSON)."""
    _, args, mode = arguments.parse(fit_cli.join_fit_value(sys.argv[1:] if argv is None else argv))
    if mode in (arguments.YOURS, arguments.FIT):
        if mode == arguments.FIT:
            arguments.ladder_model(args)
        code = user_cli.run(args) if mode == arguments.YOURS else fit_cli.run(args)
        if args.fit and not processes.in_checkout():  # the picks' commands name recipes/*.py
            print(processes.NEEDS_CHECKOUT)
        return code
    if mode == arguments.LADDER:
        return _ladder(args.ladder)
    if mode == arguments.CHECK:
        return _check(args)
    cfg, overrides, label = _estimate_config(args)
    try:
        plan = plan_for(cfg, **overrides)
    except ValueError as e:
        fail(str(e))
    est = simulate(
        meta_ladder_model(cfg.model, fused_attention=cfg.fused_attention),
        plan,
        record_timeline=bool(args.plot),
        model_name=cfg.model,
    )
    card = card_prediction(
        est.peak_gb,
        replayed_gb=est.reserved_gb,
        graphs=bool(cfg.cuda_graphs),
        compiled=bool(cfg.compile),
        gpu=args.gpu,
        devices=cfg.world_size if cfg.sharding != "none" else 1,
    )
    if args.json:
        print(json.dumps({"recipe": label, **est.to_dict(), **card}, indent=2))
    else:
        print(f"[{label}]")
        print(est.table())
        if not est.error:
            print(card_lines(card))
    if args.plot:
        plot_timeline(est, args.plot, title=f"{label}: predicted memory timeline, peak {est.peak_gb:.2f} GB")
        if not args.json:
            print(f"  timeline plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``fmr-estimate`` (``python -m fabric_memory_recipes.planning``): predicted peak memory, and what fits a card.

Without ``--check``, ``--fit`` or ``--ladder``: the component table (or JSON) of a rung's predicted peak.
``--check DIR...``: predicted against measured for every results JSON there. ``--fit 6GB``: which
configurations of the ladder fit a GPU memory budget, fastest first (``fit_cli``). ``--ladder DIR``: every
rung with a results JSON in DIR predicted at full size (DIR/predicted.json, shown by the report)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from fabric_memory_recipes import paths
from fabric_memory_recipes.config import Hardware, RunConfig, UsageError, declared_rung
from fabric_memory_recipes.console import fail
from fabric_memory_recipes.planning.check import check_results, meta_ladder_model, render_check
from fabric_memory_recipes.planning.ladder import predict_ladder
from fabric_memory_recipes.planning.overhead import card_prediction
from fabric_memory_recipes.planning.plan import ATTENTION_CHOICES, OPTIMIZERS, plan_for
from fabric_memory_recipes.planning.planner import calibration
from fabric_memory_recipes.planning.planner import cli as fit_cli
from fabric_memory_recipes.planning.plots import plot_check, plot_timeline
from fabric_memory_recipes.planning.simulation.simulate import simulate
from fabric_memory_recipes.planning.your_model import cli as user_cli
from fabric_memory_recipes.training import cli
from fabric_memory_recipes.training.your_model import models

MODES_HELP = """fmr-estimate: predicted peak memory, and what fits a card. Its modes:
  fmr-estimate --recipe NN [flags]          a rung's predicted peak (component table; --json, --plot PNG)
  fmr-estimate --fit SIZE [--batch-size N]  which configurations of the ladder fit a card of SIZE (--fit 6GB --help)
  fmr-estimate --check DIR...               predicted against measured for every results JSON in DIR
  fmr-estimate --ladder DIR                 every rung of DIR predicted at full size (DIR/predicted.json)
  fmr-estimate --model SOURCE:NAME [--seq-len N] [--fit SIZE [--measure] [--may-change precision,optimizer]]
                                            your own model (torchvision:, timm:, hf:CONFIG): its estimate, and
                                            with --fit the technique sets that fit (--model hf:X --help)"""


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, RunConfig, dict[str, Any], str]:
    """The estimator's flags: a recipe's (its rung's values as defaults, checked as a run's flags are,
    for a GPU machine unless --accelerator cpu) and its own."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe")
    known, _ = pre.parse_known_args(argv)
    rung, label = RunConfig(), "custom"
    if known.recipe is not None:
        try:
            rung, _ = declared_rung(paths.plain_name(known.recipe, "--recipe"))  # a name, not a path
        except (FileNotFoundError, ValueError, SyntaxError, UsageError) as e:
            fail(str(e))
        label = rung.recipe
    parser = cli.build_parser(rung, MODES_HELP)
    g = parser.add_argument_group("estimate")
    g.add_argument("--recipe", help="take the configuration declared in recipes/<NAME>.py (its RUNG)")
    g.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto", help="attention kernel to model")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help="override the recipe's optimizer")
    g.add_argument("--checkpoint", help="comma-separated module classes to checkpoint (e.g. EncoderBlock)")
    g.add_argument(
        "--fit",
        metavar="SIZE",
        help="which configurations of the ladder fit SIZE (e.g. 6GB), fastest first: see --fit 1GB --help",
    )
    g.add_argument(
        "--gpu",
        default=calibration.REFERENCE_GPU,
        type=fit_cli.gpu_kind,
        help="GPU kind whose measured card overhead gives the whole-device peak (h100, h200, ...)",
    )
    g.add_argument("--json", action="store_true", help="print the estimate as JSON")
    g.add_argument(
        "--plot",
        metavar="PNG",
        help="write the simulated timeline (with --check: predicted vs measured) as a PNG",
    )
    g.add_argument(
        "--check",
        nargs="+",
        metavar="DIR",
        help="predict every results JSON in DIR from its config and compare with its measured peak",
    )
    g.add_argument(
        "--ladder",
        metavar="DIR",
        help="predict every rung with a results JSON in DIR (none there: every rung) at full size"
        " (ViT-L/16, GPU config) and write DIR/predicted.json for the report",
    )
    args = parser.parse_args(argv)
    if args.ladder and (refusal := paths.refusal(args.ladder, "--ladder")):  # it writes predicted.json there
        fail(refusal)
    if args.ladder and (problem := paths.folder_problem(args.ladder) or _unwritable(args.ladder)):
        fail(f"--ladder {args.ladder}: {problem}")
    missing = [d for d in args.check or () if not os.path.isdir(d)]
    if missing:
        fail(f"--check: no such folder: {', '.join(missing)}")
    flags = {f.name: getattr(args, f.name) for f in RunConfig.flag_fields()}
    overrides: dict[str, Any] = {"attention": args.attention}
    if args.optimizer:
        overrides["optimizer"] = args.optimizer
    if args.checkpoint:
        overrides["activation_checkpointing"] = tuple(c for c in args.checkpoint.split(",") if c)
    if args.check or args.ladder:
        return args, rung, overrides, label
    if flags["model"] not in rung.model_choices:
        fail(f"--model {flags['model']!r} is not one of: {', '.join(rung.model_choices)}; your own model:"
             f" {models.EXAMPLES} (docs/your_model.md)")
    try:
        cfg = rung.with_flags(**flags).checked(Hardware.planned())  # 'auto': predict for a GPU
    except UsageError as e:
        fail(str(e))
    return args, cfg, overrides, label


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
    """The card below the component table: peak reserved and whole-device peak, with their sources."""
    device = card["device_peak_gb"]
    return "\n".join([
        f"  {'peak reserved':<22}{card['peak_reserved_gb']:>11.3f}   x {card['reserved_ratio']:.3f}:"
        f" {card['reserved_ratio_source']}",
        f"  {'whole-device peak':<22}{device:>11.3f}   + {card['overhead_gb']:.3f} GB outside the allocator"
        f" ({card['overhead_source']})"
        if device is not None
        else f"  {'whole-device peak':<22}{'unknown':>11}   {card['overhead_source']}",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``python -m fabric_memory_recipes.planning``: print the component table (or JSON) for a recipe's configuration;
    with ``--fit SIZE``, the planner (fabric_memory_recipes/planning/planner/cli.py); with ``--model SOURCE:NAME``,
    your own model (fabric_memory_recipes/planning/your_model/cli.py)."""
    args_in = fit_cli.join_fit_value(sys.argv[1:] if argv is None else argv)
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model")
    if models.is_user_model(model.parse_known_args(args_in)[0].model):
        return user_cli.main(argv)
    if any(a == "--fit" or a.startswith("--fit=") for a in args_in):
        return fit_cli.main(args_in)
    args, cfg, overrides, label = _parse(argv)
    if args.ladder:
        start = time.perf_counter()
        print(f"Predicting each rung at full size (ViT-L/16, GPU config) for {args.ladder}:")
        payload = predict_ladder(args.ladder)
        print(f"  -> {args.ladder}/predicted.json ({time.perf_counter() - start:.0f} s)")
        return 0 if payload["rows"] and all(r["error"] is None for r in payload["rows"]) else 2
    if args.check:
        rows = check_results(args.check)
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            print(render_check(rows))
        if args.plot and rows:
            plot_check(rows, args.plot)
        return 0 if rows else 2
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
    card = card_prediction(est.peak_gb, graphs=bool(cfg.cuda_graphs), compiled=bool(cfg.compile), gpu=args.gpu,
                           devices=cfg.world_size if cfg.sharding != "none" else 1)  # fmt: skip
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

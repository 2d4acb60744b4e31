"""``fmr-estimate --model torchvision:NAME | timm:NAME | hf:ID_OR_PATH``: the estimate for your own model
(the flags of ``recipes/your_model.py``: the same technique set), and with ``--fit SIZE`` the planner.

Exit codes: 0 done (with --fit: something fits), 1 nothing fits or the simulation failed, 2 bad input
(one line on stderr: an unknown model, a malformed config, a hub id while offline, a bad flag).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from fabric_memory_recipes.config import Hardware, UsageError
from fabric_memory_recipes.console import fail
from fabric_memory_recipes.planning import fit_cli
from fabric_memory_recipes.planning.user_estimate import card, estimate, meta_model, plan_of
from fabric_memory_recipes.planning.user_fit import OPTIMIZERS, PRECISIONS, UserPlanner
from fabric_memory_recipes.training import cli, user_run


def parse(argv: list[str] | None):
    rung = user_run.default_config()
    parser = cli.build_parser(rung, __doc__.splitlines()[0])
    parser.prog = "fmr-estimate --model SOURCE:NAME"
    g = parser.add_argument_group("estimate and plan")
    fit_cli.add_plan_arguments(g, required=False, precisions=PRECISIONS, optimizers=OPTIMIZERS,
                               gpu_help="GPU kind whose measured card overhead and committed runs apply (h100, h200, ...)",
                               fit_help="list the fastest technique sets that fit a card of SIZE (6GB, 512MB)")  # fmt: skip
    args = parser.parse_args(argv)
    flags = {f.name: getattr(args, f.name) for f in type(rung).flag_fields()}
    try:
        cfg = rung.with_flags(**flags).checked(Hardware.planned())  # 'auto': predict for a GPU
    except (UsageError, ValueError) as e:
        fail(str(e))
    args.budget_gb = fit_cli.budget(args)
    return args, cfg


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse(argv)
    try:
        um, model, blocks, found_by = meta_model(cfg.model)
    except UsageError as e:
        fail(str(e))
    if args.fit:
        return fit_main(args, cfg)
    if cfg.checkpoint_blocks and not blocks:
        fail(f"--checkpoint-blocks: no repeated blocks found in {cfg.model}")
    est = estimate(model, um, plan_of(cfg, blocks), cfg.seq_len)
    got = card(est, args.gpu, "eager")
    about = {"model": um.ref, "task": um.task, "seq_len": cfg.seq_len if um.is_text else None,
             "repeated_blocks": list(blocks), "blocks_found_by": found_by}  # fmt: skip
    if args.json:
        print(json.dumps({**about, **est.to_dict(), **got}, indent=2))
        return 1 if est.error else 0
    print(f"[{um.ref}] {um.task.replace('_', ' ')}" + (f", {cfg.seq_len} tokens per sample" if um.is_text else "")
          + f"; repeated blocks: {', '.join(blocks) or 'none'} ({found_by})")  # fmt: skip
    print(est.table())
    if not est.error:
        device = got["device_peak_gb"]
        print(f"  {'peak reserved':<22}{got['peak_reserved_gb']:>11.3f}   the allocator replay's"
              f" {got['replayed_reserved_gb']:.3f} x {got['reserved_residual']} (planning/reserved.py)")
        print(f"  {'whole-device peak':<22}" + (f"{device:>11.3f}   + {got['overhead_gb']:.3f} GB outside the"
              f" allocator ({got['overhead_source']})" if device is not None else f"{'unknown':>11}"))  # fmt: skip
    return 1 if est.error else 0


def fit_main(args: Any, cfg: user_run.YourModelConfig) -> int:
    planner = UserPlanner(cfg.model, cfg.batch_size, cfg.seq_len, args.gpu, precisions=args.precisions,
                          optimizers=args.optimizers)  # fmt: skip
    fits, rejected = planner.fit(args.budget_gb, args.top)
    ref, seq = planner.ref, planner.seq_len
    if args.json:
        smallest = None if fits else planner.smallest()
        payload = {"budget_gb": args.budget_gb, "model": ref, "batch_size": cfg.batch_size, "seq_len": seq,
                   "gpu": args.gpu, "repeated_blocks": list(planner.blocks), "fits": [c.to_dict() for c in fits],
                   "rejected": rejected.to_dict() if rejected else None,
                   "smallest": smallest.to_dict() if smallest else None, "speed": planner.speed_lines()}  # fmt: skip
        _print(json.dumps(payload, indent=2))
        return 0 if fits else 1
    if not fits:
        s = planner.smallest()
        _print(f"Nothing fits in {args.budget_gb:g} GB: the smallest predicted peak is {s.card_gb:.2f} GB"
               f" ({s.label()}): {s.command}")  # fmt: skip
        return 1
    lines = [f"Which technique sets fit {args.budget_gb:g} GB? {ref}, batch {cfg.batch_size}"
             + (f" x {seq} tokens" if seq else "") + f", repeated blocks {', '.join(planner.blocks) or 'none'}"
             f" ({planner.found_by}), eager mode, {args.gpu}", "",
             "   # samples/s  card GB  technique set\n       command"]  # fmt: skip
    for i, c in enumerate(fits, 1):
        lines.append(f"  {i:>2} {c.images_per_s:9.1f} {c.card_gb:8.2f}   {c.label()}\n       {c.command}")
    if rejected:
        lines += ["", f"Fastest rejected as too big: {rejected.label()}, {rejected.card_gb:.2f} GB,"
                  f" {rejected.images_per_s:.1f} samples/s"]  # fmt: skip
    lines += ["", "card GB = predicted peak reserved (simulated peak allocated, with the margin of"
              " planning/user_estimate.py) + the measured card overhead of the GPU kind in eager mode.",
              *planner.speed_lines()]  # fmt: skip
    _print("\n".join(lines))
    return 0


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # the reader (head, a pager) stopped early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

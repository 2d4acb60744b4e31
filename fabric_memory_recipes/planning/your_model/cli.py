"""``fmr-estimate --model torchvision:NAME | timm:NAME | hf:ID_OR_PATH``: the estimate for your own model
(the flags of ``recipes/your_model.py``: the same technique set), and with ``--fit SIZE`` the planner.

Exit codes: 0 done (with --fit: something fits), 1 nothing fits or the simulation failed, 2 bad input
(one line on stderr: an unknown model or an architecture the runner cannot train, a malformed config, a
hub id while offline, --seq-len beyond the model's positions, a card smaller than the weights, --measure
without a CUDA GPU, a bad flag).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fabric_memory_recipes.config import Hardware, UsageError
from fabric_memory_recipes.console import fail
from fabric_memory_recipes.measurement.card_overhead import overhead_mode
from fabric_memory_recipes.measurement.results_file import peak_bf16_flops
from fabric_memory_recipes.planning import arguments
from fabric_memory_recipes.planning.inference import cli as inference_cli
from fabric_memory_recipes.planning.planner import cli as fit_cli
from fabric_memory_recipes.planning.planner import workers
from fabric_memory_recipes.planning.your_model import measure, saved_file
from fabric_memory_recipes.planning.your_model.estimate import (
    card,
    estimate,
    meta_user_model,
    plan_of,
)
from fabric_memory_recipes.planning.your_model.sets import UserPlanner
from fabric_memory_recipes.techniques import ACTIVATION_CHECKPOINTING, switches
from fabric_memory_recipes.training.techniques import refusal_of
from fabric_memory_recipes.training.your_model import runner

# the caching allocator's settings (config.FAST_ALLOCATOR: fast mode's)
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
PROGRESS_S = 5.0  # a --fit search that has run this long says on stderr each set it simulates


def parse(args: argparse.Namespace) -> tuple[argparse.Namespace, runner.YourModelConfig]:
    """fmr-estimate's parsed flags (planning/arguments.py) as your model's checked configuration:
    the flags given, the rest recipes/your_model.py's."""
    rung = runner.default_config()
    if args.optimizer is not None and args.optimizer not in runner.OPTIMIZERS:
        fail(
            f"argument --optimizer: invalid choice for your model: {args.optimizer!r}"
            f" (choose from {', '.join(runner.OPTIMIZERS)})"
        )
    flags = arguments.filled(args, rung)
    users_alloc_conf = os.environ.get(ALLOC_CONF)
    try:
        cfg = rung.with_flags(**flags).checked(Hardware.planned())  # 'auto': predict for a GPU
    except (UsageError, ValueError) as e:
        fail(str(e))
    finally:  # checked() sets fast mode's allocator for a run in this process; this one trains nothing,
        # and each --measure run starts from the user's setting, its runner sets its own (measure.py)
        if users_alloc_conf is None:
            os.environ.pop(ALLOC_CONF, None)
    args.budget_gb = fit_cli.budget(args)
    if (args.measure or args.may_change) and not args.fit:
        fail("--measure and --may-change go with --fit SIZE")
    if args.measure and not torch.cuda.is_available():
        fail(
            "--measure runs the candidates on a CUDA GPU, and this machine has none: leave it out for the"
            " predicted ranking"
        )
    if args.measure and cfg.world_size > torch.cuda.device_count():
        fail(
            f"--measure with --devices {cfg.world_size} runs each FSDP set on {cfg.world_size} GPUs (each capped"
            f" at --fit's size), and this machine has {torch.cuda.device_count()}"
        )
    if args.measure and not measure.RUNNER.is_file():
        fail(
            f"--measure runs {measure.RUNNER.relative_to(measure.REPO)}, which an installed wheel"
            " does not have: run it from a checkout"
        )
    return args, cfg


def run(parsed: argparse.Namespace) -> int:
    args, cfg = parse(parsed)
    if cfg.infer:  # generate() or a forward pass under inference_mode (planning/inference/)
        return inference_cli.run(args, cfg)
    try:
        um, model, blocks, found_by = meta_user_model(cfg.model, cfg.lora_rank, cfg.lora_targets)
        runner.resolve(cfg)  # --seq-len (and an encoder-decoder's --target-len) within its positions, --data
        # a switch's module may refuse the model (the fused loss: BART's bias after its projection, ...)
        for t in (t for t in switches() if cfg.uses(t)):
            if why := refusal_of(t, model):
                raise UsageError(why)
    except UsageError as e:
        fail(str(e))
    if args.fit and cfg.world_size > 1 and not blocks:
        fail(
            f"--fit with --devices {cfg.world_size}: FSDP shards the repeated blocks, and {cfg.model} has none found"
        )
    if args.fit:
        return fit_main(args, cfg)
    if cfg.uses(ACTIVATION_CHECKPOINTING) and not blocks:
        fail(f"{ACTIVATION_CHECKPOINTING.flag}: no repeated blocks found in {cfg.model}")
    # fast mode sets expandable segments where RunConfig chooses CUDA graphs, which the runner may then leave out
    expandable = bool(cfg.cuda_graphs) or (args.cuda_graphs is None and cfg.graphs_by_default())
    plan = plan_of(cfg, blocks, expandable, um)
    est = estimate(model, um, plan, cfg.seq_len, target_len=cfg.target_len)
    # the overhead of the mode estimated, as --fit takes it per set and --memory-budget-gb caps the run
    got = card(est, args.gpu, overhead_mode(cfg.flags()), cfg.world_size if cfg.fsdp else 1)
    about = {
        "model": um.ref,
        "task": um.task,
        "seq_len": cfg.seq_len if um.is_text else None,
        "target_len": runner.target_len(cfg) if um.task == "seq2seq_lm" else None,
        "repeated_blocks": list(blocks),
        "blocks_found_by": found_by,
    }
    saved = None if cfg.fsdp else saved_file.predict(model, cfg)  # FSDP saves a folder of shards
    if args.json:
        checkpoint = {"saved_checkpoint": saved.to_dict() if saved else None}
        print(json.dumps({**about, **est.to_dict(), **got, **checkpoint}, indent=2))
        return 1 if est.error else 0
    print(
        f"[{um.ref}] {um.task.replace('_', ' ')}"
        + (f", {cfg.seq_len} tokens per sample" if um.is_text else "")
        + (f" -> {runner.target_len(cfg)} target tokens" if um.task == "seq2seq_lm" else "")
        + f"; repeated blocks: {', '.join(blocks) or 'none'} ({found_by})"
    )
    print(est.table())
    if not est.error:
        device = got["device_peak_gb"]
        print(
            f"  {'peak reserved':<22}{got['peak_reserved_gb']:>11.3f}   the allocator replay's"
            f" {got['replayed_reserved_gb']:.3f} x {got['reserved_residual']} (planning/reserved.py)"
        )
        print(
            f"  {'whole-device peak':<22}"
            + (
                f"{device:>11.3f}   + {got['overhead_gb']:.3f} GB outside the"
                f" allocator ({got['overhead_source']})"
                if device is not None
                else f"{'unknown':>11}"
            )
        )
    if saved:
        print(
            f"  {'checkpoint file':<22}{saved.total_bytes / 1e9:>11.3f}   on disk, each --checkpoint-every N:"
            f" {saved.line().split(': ', 1)[1]} (planning/your_model/saved_file.py)"
        )
    return 1 if est.error else 0


def fit_main(args: Any, cfg: runner.YourModelConfig) -> int:
    start = time.perf_counter()
    try:
        asked = workers.wanted()
    except ValueError as e:
        fail(str(e))
    planner = UserPlanner(
        cfg.model,
        cfg.batch_size,
        cfg.seq_len,
        args.gpu,
        precision=cfg.precision,
        optimizer=cfg.optimizer,
        may_change=args.may_change,
        devices=cfg.world_size,
        lora_rank=cfg.lora_rank,
        lora_targets=cfg.lora_targets,
        target_len=cfg.target_len,
    )
    if planner.weights_gb() >= args.budget_gb:
        per_gpu = f" per GPU (sharded over {cfg.world_size})" if cfg.world_size > 1 else ""
        fail(
            f"--fit {args.fit}: {planner.ref}'s weights alone take {planner.weights_gb():.2f} GB{per_gpu}"
            f" ({planner.parameters / 1e6:.0f} M parameters in {cfg.precision if 'precision' not in args.may_change else 'bf16'}):"
            " no technique set fits a smaller card"
        )
    planner.progress = lambda p, c: _progress(p, c, time.perf_counter() - start)
    planner.workers_asked = asked  # simulations ahead of the search on the other cores
    try:
        fits, rejected = planner.fit(args.budget_gb, args.top)
    except RuntimeError as e:  # a simulation failed: one line, exit 1 (the contract above)
        print(f"fmr-estimate: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    ref, seq = planner.ref, planner.seq_len
    kept = [w for w in ("precision", "optimizer") if w not in args.may_change]
    yours = {"precision": cfg.precision, "optimizer": cfg.optimizer}
    if args.json and not args.measure:
        smallest = None if fits else planner.smallest()
        payload = {
            "budget_gb": args.budget_gb,
            "model": ref,
            "batch_size": cfg.batch_size,
            "seq_len": seq,
            "gpu": args.gpu,
            "kept": {w: yours[w] for w in kept},
            "repeated_blocks": list(planner.blocks),
            "fits": [c.to_dict() for c in fits],
            "rejected": rejected.to_dict() if rejected else None,
            "smallest": smallest.to_dict() if smallest else None,
            "card_overhead": planner.overhead_legend,
            "left_out": list(planner.failed.values()),
            "speed": planner.speed_lines(True),
        }
        _print(json.dumps(payload, indent=2))
        return 0 if fits else 1
    if not fits:
        s = planner.smallest()
        _print(
            f"Nothing fits in {fit_cli.budget_text(args.budget_gb, args.fit)}: the smallest predicted peak is {s.card_gb:.2f} GB"
            f" ({s.label()}): {s.command}"
            + (
                ""
                if args.may_change
                else "\n(--may-change precision,optimizer also tries other precisions and optimizers)"
            )
        )
        return 1
    lines = [
        f"Which technique sets fit {fit_cli.budget_text(args.budget_gb, args.fit)}? {ref}, batch {cfg.batch_size}"
        + (f" x {seq} tokens" if seq else "")
        + f", repeated blocks {', '.join(planner.blocks) or 'none'}"
        f" ({planner.found_by}), {args.gpu}"
        + (f", FSDP over {cfg.world_size} GPUs (card GB per GPU)" if cfg.world_size > 1 else ""),
        "Kept as yours: "
        + (", ".join(f"{w} {yours[w]}" for w in kept) or "nothing (--may-change)")
        + ("" if not kept else " (--may-change precision,optimizer lets the planner change them)"),
        "",
        "Each set once, at its fastest micro-batch that fits (batch = micro-batch x accumulation):",
        "   # samples/s    MFU  card GB  technique set\n       command",
    ]
    peak = peak_bf16_flops(args.gpu.upper())
    for i, c in enumerate(fits, 1):
        mfu = c.mfu(peak)
        lines.append(
            f"  {i:>2} {c.images_per_s:9.1f} {f'{100 * mfu:5.1f}%' if mfu else '    —':>6} {c.card_gb:8.2f}"
            f"   {c.label()}\n       {c.command}"
        )
        lines += [f"       accuracy: {cost.line()}" for cost in c.changes]
    lines += [f"Left out, its simulation failed: {why}" for why in planner.failed.values()]
    if rejected:
        lines += [
            "",
            f"Fastest rejected as too big: {rejected.label()}, {rejected.card_gb:.2f} GB,"
            f" {rejected.images_per_s:.1f} samples/s",
        ]
    lines += [
        "",
        "card GB = predicted peak reserved (the allocator replay, planning/your_model/estimate.py) + "
        f"{planner.overhead_legend}. MFU = the model's training FLOPs per sample (recompute not counted) x"
        " samples/s over the GPU's bf16 peak.",
        *planner.speed_lines(args.verbose),
    ]
    _print("\n".join(lines))
    if args.measure:
        return measure_main(args, cfg, fits)
    return 0


def measure_main(args: Any, cfg: runner.YourModelConfig, fits: list) -> int:
    slug = re.sub(r"[^\w.+-]", "_", f"{cfg.model.split(':', 1)[1].rstrip('/').split('/')[-1]}-{args.fit}")
    out = Path(args.measure_dir or Path("runs") / "fit" / slug)
    rows = [{**c.to_dict(), "label": c.label(), "predicted_rank": i} for i, c in enumerate(fits, 1)]
    _print(
        f"\nMeasuring the {len(rows)} sets on {torch.cuda.get_device_name()} as a {fit_cli.budget_text(args.budget_gb, args.fit)} card,"
        f" {args.measure_steps} steps each, one at a time -> {out}/"
    )
    best = measure.measure(rows, args.budget_gb, out, args.measure_steps, say=_print)
    measure.write(
        out,
        rows,
        args.budget_gb,
        {
            "model": cfg.model,
            "batch_size": cfg.batch_size,
            "seq_len": cfg.seq_len,
            "gpu": torch.cuda.get_device_name(),
        },
    )
    _print("\n" + measure.render(rows, args.budget_gb))
    if not best:
        _print("None of the measured sets fitted the card: see the statuses above.")
        return 1
    _print(
        f"Fastest measured that fits: {best[0]['command']} ({best[0]['measured_samples_per_s']:.1f} samples/s)"
        f"\n-> {out}/plan.json, {out}/plan.md"
    )
    if args.json:
        _print(json.dumps({"sets": rows, "measured_pick": best[0]["command"]}, indent=2))
    return 0


def _progress(planner: UserPlanner, c: Any, elapsed: float) -> None:
    """A line on stderr for each set simulated once the search has run :data:`PROGRESS_S` (a quick plan says
    nothing), with the worker processes that simulate ahead of it (planning/planner/workers.py)."""
    if elapsed >= PROGRESS_S:
        ahead = f", {len(planner.pool)} worker processes ahead" if planner.pool else ""
        print(
            f"[fit {elapsed:4.0f} s] {planner.simulations} simulated{ahead}: {c.label()}: {c.card_gb:.2f} GB,"
            f" {c.images_per_s:.1f} samples/s",
            file=sys.stderr,
            flush=True,
        )


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # the reader (head, a pager) stopped early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

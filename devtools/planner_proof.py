"""Prove the planner on a GPU: emulate smaller cards with ``--memory-budget-gb`` and run what it chose.

    python -m devtools.planner_proof --out results/published/h100/planner --budgets 2,4,8 --gpu h100

For each budget the planner (``python -m fabric_memory_recipes.planning --fit``) names its first pick, the next
fitting configurations (``--candidates``, 3 in all) and the fastest configuration it rejected as too
big. Each runs as its own recipe process, one after another (a clean GPU for each, so throughput is
comparable), with ``--memory-budget-gb`` emulating a card of the budget's size: the process's CUDA
caching allocator is capped (``torch.cuda.set_per_process_memory_fraction``, set before the model is
built) at the budget less the card overhead measured for the GPU kind and mode (CUDA context,
libraries, kernels: ``fabric_memory_recipes.planning.overhead``), the same overhead the planner adds
to a predicted peak reserved to decide what fits a card; ``--data synthetic
--weights none --max-steps N --eval-batches 1``. A command the plan needs at several budgets runs
once: a fitting one at the smallest of them (what fits under a smaller cap fits under a larger one), a
rejected one at the largest (out of memory under a cap means out of memory under a smaller one); each
row says where it was measured (``measured_at_budget_gb``). Order: the picks, then the rejected, then
the other candidates, so that ``--budget`` (seconds; no run starts after it) keeps what matters most.

Writes ``DIR/plan.json`` (the planner's choices; reused by a later call with the same arguments, so
the GPU machine need not simulate: ``--dry-run`` on a CPU writes it), ``DIR/runs/`` (each run's
results JSON and log) and, rewritten after every run, ``DIR/fit.json``: a list of rows
``{"budget_gb", "role" (pick | candidate | rejected), "command", "predicted_peak_gb" (reserved),
"predicted_device_gb" (the card: reserved + overhead_gb), "measured_peak_reserved_gb",
"measured_device_peak_gb" (the run's whole-device peak), "predicted_images_per_s",
"measured_images_per_s", "status"}`` (status ``ok`` or ``oom`` from the recipe's results JSON;
``error``, ``timeout`` or ``not run`` otherwise), and ``DIR/fit.md``, the same as a table with the
targets checked.

Time: each run costs ~15-35 s (start-up, compiling the blocks in fast mode, N steps); 2,4,8 GB at
batch 16 plan about 9 distinct runs: 4-6 minutes on one H100 (``--budget 420`` keeps a call within
~8 minutes; the table is written after every run). Exit code 0 when every run that was
started finished as planned (picks ok, rejected out of memory), 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from devtools.capped_card.fit_table import MEASURED, check_targets, render, with_outcome
from fabric_memory_recipes.config import VIT_MODELS, at_least
from fabric_memory_recipes.console import Parser, comma_list
from fabric_memory_recipes.measurement.card_overhead import card_overhead
from fabric_memory_recipes.measurement.results_file import write_json_atomic
from fabric_memory_recipes.paths import output_folder
from fabric_memory_recipes.planning.planner.cli import parse_size
from fabric_memory_recipes.planning.planner.fit import (
    PLANNED_OPTIMIZERS,
    PLANNED_PRECISIONS,
    Candidate,
    Planner,
    SimulationCache,
)
from fabric_memory_recipes.processes import Run, execute, run_env
from fabric_memory_recipes.techniques import MODES
from fabric_memory_recipes.tools.compare.rows import summarize_project

REPO = Path(__file__).resolve().parents[1]
RUN_ARGS = ("--data", "synthetic", "--weights", "none", "--eval-batches", "1")
ROLES = ("pick", "rejected", "candidate")  # the order the runs go in
Runner = Callable[[Run, dict, float], dict]


def _budgets(text: str) -> list[float]:
    try:
        values = sorted({parse_size(x) for x in text.split(",") if x.strip()})
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("--fit ", "")) from None
    if not values:
        raise argparse.ArgumentTypeError("expected comma-separated sizes such as 1,2,4,8 (GB)")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    lowbit = importlib.util.find_spec("torchao") is not None
    p = Parser(
        prog="python -m devtools.planner_proof",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
    )
    p.add_argument(
        "--out",
        required=True,
        type=output_folder("--out"),
        help="output folder (e.g. runs/planner; results/published/<gpu>/planner with FMR_PUBLISH=1)",
    )
    p.add_argument(
        "--budgets",
        type=_budgets,
        default=[2.0, 4.0, 8.0],
        help="card sizes in GB, comma-separated (default 2,4,8)",
    )
    p.add_argument(
        "--gpu",
        default="h100",
        help="GPU kind whose runs predict throughput and card overhead (default h100)",
    )
    p.add_argument("--batch-size", type=at_least(1), default=16, help="effective batch (default 16)")
    p.add_argument("--model", choices=VIT_MODELS, default="vit_l_16", help="default vit_l_16")
    p.add_argument(
        "--candidates",
        type=at_least(1),
        default=3,
        help="fitting configurations per budget, the pick included (default 3)",
    )
    p.add_argument(
        "--optimizers",
        type=comma_list(PLANNED_OPTIMIZERS),
        default=PLANNED_OPTIMIZERS if lowbit else ("adam", "sgd"),
        help="optimizers to plan with (default: adam,sgd,adamw8bit; without torchao installed, adam,sgd)",
    )
    p.add_argument("--steps", type=at_least(5), default=15, help="optimizer steps per run (default 15)")
    p.add_argument(
        "--timeout", type=at_least(1), default=180, help="seconds per run before it is killed (default 180)"
    )
    p.add_argument(
        "--budget", type=float, default=None, help="seconds after which no run starts (default: none)"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="plan (write DIR/plan.json) and print the commands; run nothing",
    )
    p.add_argument(
        "--replan", action="store_true", help="plan again even if DIR/plan.json has these arguments"
    )
    args = p.parse_args(argv)
    args.out = args.out.resolve()  # the runs start in the repository's root
    return args


# ------------------------------------------------------------------------------------------ the plan
def _row(budget: float, role: str, c: Candidate) -> dict[str, Any]:
    return {
        "budget_gb": budget,
        "role": role,
        "command": c.command,
        "recipe": c.rung.recipe,
        "argv": c.argv(),
        "predicted_peak_gb": c.predicted_gb,
        "simulated_peak_allocated_gb": c.simulated_gb,
        "overhead_gb": c.overhead_gb,
        "predicted_device_gb": c.card_gb,
        "measured_device_peak_gb": None,
        "predicted_images_per_s": c.images_per_s,
        "speed_source": c.speed_source,
        "measured_at_budget_gb": None,
        "measured_peak_reserved_gb": None,
        "measured_peak_allocated_gb": None,
        "measured_images_per_s": None,
        "status": "not run",
        "error": None,
        "result_json": None,
    }


def make_plan(args: argparse.Namespace, planner: Planner | None = None) -> dict[str, Any]:
    """The rows (budget x role) and the distinct runs that measure them."""
    planner = planner or Planner(
        args.batch_size,
        args.model,
        args.gpu,
        precisions=PLANNED_PRECISIONS,
        modes=MODES,
        optimizers=args.optimizers,
        cache=SimulationCache(),
    )
    rows = []
    for budget in args.budgets:
        fit = planner.fit(budget, top=args.candidates)
        if fit.fits:
            rows.append(_row(budget, "pick", fit.fits[0]))
            rows += [_row(budget, "candidate", c) for c in fit.fits[1:]]
        rejected = planner.fastest_rejected(budget)
        if rejected is not None:
            rows.append(_row(budget, "rejected", rejected))
    runs: dict[tuple, dict[str, Any]] = {}  # (command, fits?) -> the run
    for role in ROLES:
        for row in rows:
            if row["role"] != role:
                continue
            fits = role != "rejected"
            key = (row["command"], fits)
            at = runs[key]["budget_gb"] if key in runs else None
            at = row["budget_gb"] if at is None else (min if fits else max)(at, row["budget_gb"])
            run = runs.setdefault(key, {k: row[k] for k in ("command", "recipe", "argv")})
            run.update(expect="ok" if fits else "oom", budget_gb=at)
    for row in rows:
        row["measured_at_budget_gb"] = runs[(row["command"], row["role"] != "rejected")]["budget_gb"]
    return {
        "arguments": plan_key(args),
        "rows": rows,
        "runs": list(runs.values()),
        "versions": {"torch": torch.__version__},
    }


def plan_key(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments a stored plan answers, and the card overheads it added (a plan made before the
    overhead table changed is made again)."""
    overheads = {m: card_overhead(args.gpu, m).gb for m in MODES}
    return {
        "budgets": args.budgets,
        "gpu": args.gpu,
        "batch_size": args.batch_size,
        "model": args.model,
        "candidates": args.candidates,
        "optimizers": list(args.optimizers),
        "card_overhead_gb": overheads,
    }


def load_or_plan(args: argparse.Namespace, planner: Planner | None = None) -> dict[str, Any]:
    path = args.out / "plan.json"
    if not args.replan and path.exists():
        try:
            plan = json.loads(path.read_text())
            if plan.get("arguments") == plan_key(args):
                print(f"planner_proof: using the plan in {path} (--replan to make it again)", flush=True)
                return plan
        except (OSError, ValueError):
            pass
    t0 = time.perf_counter()
    plan = make_plan(args, planner)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(str(path), plan)
    print(f"planner_proof: planned in {time.perf_counter() - t0:.1f} s -> {path}", flush=True)
    return plan


def run_argv(run: dict[str, Any], steps: int, results_dir: Path) -> list[str]:
    recipe = str(REPO / "recipes" / f"{run['recipe']}.py")
    return [  # flag and value pairs, as a command line reads
        sys.executable, recipe, *run["argv"], *RUN_ARGS,
        "--max-steps", str(steps), "--memory-budget-gb", f"{run['budget_gb']:g}",
        "--results-dir", str(results_dir),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------ running
def _slug(run: dict[str, Any]) -> str:
    flags = "".join(a.strip("-").replace("-", "")[:6] if a.startswith("-") else a for a in run["argv"])
    return re.sub(r"[^\w.+-]", "_", f"{run['recipe'][:2]}-{flags}-{run['budget_gb']:g}gb")  # a portable name


def measure(run: dict[str, Any], args: argparse.Namespace, env: dict, runner: Runner, timeout: float) -> None:
    """Run one recipe process; fill the run's outcome from its results JSON."""
    results_dir = args.out / "runs" / _slug(run)
    cmd = run_argv(run, args.steps, results_dir)
    json_path = results_dir / f"{run['recipe']}.json"
    proc = runner(
        Run("project", run["recipe"], None, cmd, json_path, results_dir.with_suffix(".log")), env, timeout
    )
    summary = summarize_project(json_path)
    status = summary["status"] if summary else proc.get("status", "error")  # timeout: no JSON
    run.update(
        {
            "status": status,
            "run_command": shlex.join(cmd),
            "wall_s": round(proc.get("wall_s", 0.0), 1),
            "error": (summary or {}).get("error") or proc.get("error"),
            "measured_peak_reserved_gb": (summary or {}).get("peak_reserved_gb"),
            "measured_peak_allocated_gb": (summary or {}).get("peak_allocated_gb"),
            "measured_device_peak_gb": (summary or {}).get("device_peak_gb"),
            "measured_images_per_s": (summary or {}).get("images_per_s") if status == "ok" else None,
            "result_json": str(json_path.relative_to(args.out)) if summary else None,
        }
    )


def fill_rows(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The plan's rows with the outcome of the run that measured each, and that run's command line."""
    runs = {(r["command"], r["expect"] == "ok"): r for r in plan["runs"]}
    keys = (*MEASURED, "run_command")
    return [
        with_outcome(row, runs[(row["command"], row["role"] != "rejected")], keys) for row in plan["rows"]
    ]


def write(out: Path, plan: dict[str, Any]) -> list[dict[str, Any]]:
    rows = fill_rows(plan)
    write_json_atomic(str(out / "fit.json"), rows)  # type: ignore[arg-type]
    (out / "fit.md").write_text(render(rows))
    write_json_atomic(str(out / "plan.json"), plan)
    return rows


def main(argv: list[str] | None = None, runner: Runner | None = None, planner: Planner | None = None) -> int:
    args = parse_args(argv)
    plan = load_or_plan(args, planner)
    runs = plan["runs"]
    print(
        f"planner_proof: {len(plan['rows'])} rows, {len(runs)} distinct runs, {args.steps} steps each,"
        f" one process at a time, timeout {args.timeout} s"
        + (f", budget {args.budget:g} s" if args.budget else ""),
        flush=True,
    )
    if args.dry_run:
        for i, run in enumerate(runs, 1):
            print(
                f"[{i:2d}/{len(runs)}] expect {run['expect']}: {shlex.join(run_argv(run, args.steps, args.out / 'runs' / _slug(run)))}"
            )
        return 0
    runner = runner or execute
    log_dir = tempfile.mkdtemp(prefix="planner-proof-logs-")
    env = run_env(log_dir)
    t0 = time.perf_counter()
    for i, run in enumerate(runs, 1):
        elapsed = time.perf_counter() - t0
        if args.budget is not None and elapsed >= args.budget:
            run.update(status="not run", error=f"--budget {args.budget:g} s spent")
        else:
            timeout = min(args.timeout, args.budget - elapsed) if args.budget else args.timeout
            print(
                f"[{i:2d}/{len(runs)}] {run['budget_gb']:g} GB, expect {run['expect']}: {run['command']}",
                flush=True,
            )
            measure(run, args, env, runner, timeout)
        print(
            f"[{i:2d}/{len(runs)}] {run['status']}, {run.get('measured_peak_reserved_gb') or 0:.2f} GB reserved,"
            f" {run.get('measured_images_per_s') or 0:.0f} img/s, {run.get('wall_s', 0):.0f} s"
            + (f" ({run['error']})" if run.get("error") and run["status"] != run["expect"] else ""),
            flush=True,
        )
        rows = write(args.out, plan)
    rows = write(args.out, plan)
    print(
        f"planner_proof: {len(runs)} runs in {time.perf_counter() - t0:.0f} s -> {args.out / 'fit.json'}, fit.md"
    )
    print("\n".join(check_targets(rows)))
    return 0 if all(r["status"] in (r["expect"], "not run") for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Prove the estimate and ``--fit`` for models outside the ladder on a GPU.

    python -m devtools.model_proof --out runs/your-model --deadline 480
    FMR_PUBLISH=1 python -m devtools.model_proof --out results/published/h100/your-model

Two parts, each run as ``recipes/your_model.py`` processes one after another (``--data synthetic
--weights none --max-steps N --eval-batches 1``), through devtools.planner_proof's runner:

* estimate: every row of :data:`ROWS` (five models outside the ladder: three vision models from
  torchvision and timm, BERT-base and Qwen2-0.5B's architecture from ``examples/configs/``, a causal LM
  with a 151,936-token vocabulary; three or more technique sets each, every flag once); each run
  records its own prediction (``extra.predicted_card``), compared with its measured peak reserved and
  whole-device peak (the whole run's: model load, training, evaluation);
* fit: ``--fit`` for ``--fit-model`` at ``--budgets`` card sizes, the card emulated with
  ``--memory-budget-gb`` (the allocator capped at the budget less the card overhead): the pick and the
  next fitting set must run, the fastest rejected set must run out of memory, and the pick's measured
  speed is compared with the fastest measured set that fits (the target: within 20 %).

The estimate runs measure memory only (4 steps; ``--jobs N`` runs N of them at a time on the GPU: each
measures its own process, the whole-device peak through NVML's entry for that process); the fit runs go
one at a time (``--steps``), as their speeds are compared.

Writes ``DIR/rows.json`` (every run), ``DIR/fit.json`` (planner_proof's row format) and
``DIR/table.md`` after every run, so a call stopped at its limit keeps what finished; a later call with
the same ``--out`` skips the runs already there (ok, out of memory or error; ``--redo`` runs them
again) and goes on. ``--deadline`` (seconds) starts no run after it. The ``--fit`` plan is stored in
``DIR/fit_plan.json`` and reused while its arguments and the card overheads are the same (``--dry-run``
on a CPU writes it, so the GPU machine need not simulate).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from devtools import planner_proof
from devtools.capped_card import fit_table
from fabric_memory_recipes.config import at_least
from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.measurement.card_overhead import card_overhead
from fabric_memory_recipes.measurement.results_file import write_json_atomic
from fabric_memory_recipes.paths import output_folder
from fabric_memory_recipes.planning.your_model.sets import UserPlanner
from fabric_memory_recipes.processes import execute, run_env
from fabric_memory_recipes.techniques import MAY_CHANGE

REPO = Path(__file__).resolve().parents[1]
QWEN, BERT = "hf:examples/configs/qwen2-0.5b", "hf:examples/configs/bert-base-uncased"
# (model, [the flags after --model, each flag once, per technique set])
ROWS: list[tuple[str, list[list[str]]]] = [
    ("torchvision:resnet50", [
        ["--batch-size", "64", "--precision", "bf16-mixed"],
        ["--batch-size", "64", "--precision", "bf16-true", "--optimizer", "sgd"],
        ["--batch-size", "64", "--precision", "32-true", "--checkpoint-blocks"]]),
    ("timm:convnext_tiny", [
        ["--batch-size", "64", "--precision", "bf16-mixed"],
        ["--batch-size", "64", "--precision", "bf16-true", "--checkpoint-blocks"],
        ["--batch-size", "64", "--precision", "32-true", "--accumulation-steps", "4"]]),
    ("timm:vit_base_patch16_224", [
        ["--batch-size", "32", "--precision", "bf16-mixed"],
        ["--batch-size", "32", "--precision", "bf16-true", "--checkpoint-blocks"],
        ["--batch-size", "32", "--precision", "bf16-true", "--activation-offload", "--accumulation-steps", "2"]]),
    (BERT, [
        ["--batch-size", "16", "--seq-len", "512", "--precision", "bf16-true"],
        ["--batch-size", "16", "--seq-len", "512", "--precision", "bf16-mixed", "--checkpoint-blocks"],
        ["--batch-size", "16", "--seq-len", "512", "--precision", "32-true", "--accumulation-steps", "4"]]),
    # a large-vocabulary causal LM (151,936 tokens)
    (QWEN, [
        ["--batch-size", "8", "--seq-len", "512", "--precision", "bf16-true", "--accumulation-steps", "4"],
        ["--batch-size", "8", "--seq-len", "512", "--precision", "bf16-true", "--checkpoint-blocks",
         "--accumulation-steps", "2"],
        ["--batch-size", "8", "--seq-len", "512", "--precision", "bf16-mixed", "--checkpoint-blocks",
         "--accumulation-steps", "8"],
        ["--batch-size", "2", "--seq-len", "512", "--precision", "bf16-true", "--optimizer", "sgd",
         "--optimizer-in-backward"]]),
]  # fmt: skip
# The estimate runs measure memory only: the steady peak comes with the second step (a step of Qwen2's
# 8 x 512 tokens with 152k logits is the slow one); --steps is for --fit's runs, whose speeds are compared.
ESTIMATE_STEPS = 4
FINISHED = ("ok", "oom", "error")  # what a later call does not run again (timeout, not run: it does)
CARD_GB = 80.0  # the estimate part: an H100's card, no cap that matters


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog="python -m devtools.model_proof", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=output_folder("--out"), help="output folder")
    p.add_argument("--parts", default="estimate,fit", help="estimate, fit or both (default estimate,fit)")
    p.add_argument("--models", default=None, help="comma-separated subset of the models (default: all)")
    p.add_argument(
        "--fit-model", default="torchvision:resnet50", help="the model --fit plans (default resnet50)"
    )
    p.add_argument("--fit-batch", type=at_least(1), default=128, help="its batch (default 128)")
    p.add_argument("--fit-top", type=at_least(2), default=3, help="fitting sets run per budget (default 3)")
    p.add_argument("--fit-seq-len", type=at_least(8), default=256, help="its sequence length (text models)")
    p.add_argument(
        "--budgets",
        type=planner_proof._budgets,
        default=[3.0, 4.0, 8.0],
        help="card sizes in GB (default 3,4,8)",
    )
    p.add_argument("--gpu", default="h100", help="GPU kind for the card overhead and speed (default h100)")
    p.add_argument("--steps", type=at_least(3), default=8, help="optimizer steps per --fit run (default 8)")
    p.add_argument("--timeout", type=at_least(1), default=120, help="seconds per run (default 120)")
    p.add_argument("--deadline", type=float, default=None, help="seconds after which no run starts")
    p.add_argument(
        "--jobs",
        type=at_least(1),
        default=1,
        help="estimate runs at a time on the GPU (each"
        " measures its own process; speeds of those runs are then not the GPU's alone; default 1)",
    )
    p.add_argument("--redo", action="store_true", help="run again what --out already holds")
    p.add_argument("--dry-run", action="store_true", help="plan and print the runs; run nothing")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    args.parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    return args


def repeated_flags(argv: list[str]) -> list[str]:
    """The flags given more than once (argparse would keep the last one silently)."""
    flags = [a for a in argv if a.startswith("--")]
    return sorted({f for f in flags if flags.count(f) > 1})


def estimate_runs(models: str | None) -> list[dict[str, Any]]:
    keep = None if models is None else {m.strip() for m in models.split(",")}
    runs = []
    for ref, sets in ROWS:
        if keep is not None and ref not in keep:
            continue
        for flags in sets:
            argv = ["--model", ref, *flags]
            if repeated_flags(argv):
                raise ValueError(
                    f"model_proof row {shlex.join(argv)}: {', '.join(repeated_flags(argv))} twice"
                )
            runs.append(
                {
                    "part": "estimate",
                    "model": ref,
                    "recipe": "your_model",
                    "argv": argv,
                    "budget_gb": CARD_GB,
                    "expect": "ok",
                    "steps": ESTIMATE_STEPS,
                }
            )
    return runs


def estimator_digest() -> str:
    """The planning code and torch's version: a stored plan made by other code is made again."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted((REPO / "fabric_memory_recipes" / "planning").glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def fit_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's picks, next fitting sets and fastest rejected set per budget: planner_proof rows and
    the distinct runs that measure them (picks first, then the rejected, then the other fitting sets).
    Stored in ``DIR/fit_plan.json`` and reused while its arguments are the same."""
    key = {
        "model": args.fit_model,
        "batch": args.fit_batch,
        "seq_len": args.fit_seq_len,
        "gpu": args.gpu,
        "budgets": args.budgets,
        "top": args.fit_top,
        "card_overhead_gb": card_overhead(args.gpu, "eager").gb,
        "estimator": estimator_digest(),
    }
    path = args.out / "fit_plan.json"
    if path.exists():
        try:
            stored = json.loads(path.read_text())
            if stored.get("arguments") == key:
                print(f"model_proof: using the --fit plan in {path}", flush=True)
                return stored
        except (OSError, ValueError):
            pass
    planner = UserPlanner(
        args.fit_model, args.fit_batch, args.fit_seq_len, args.gpu, may_change=MAY_CHANGE
    )  # --fit's search
    rows = []
    runs: dict[tuple, dict[str, Any]] = {}
    for budget in args.budgets:
        fits, rejected = planner.fit(budget, top=args.fit_top)
        roles = [("pick", fits[0])] if fits else []
        roles += [("candidate", c) for c in fits[1:]] + ([("rejected", rejected)] if rejected else [])
        for role, c in roles:
            argv = c.argv()
            fits_card = role != "rejected"
            run = runs.setdefault((shlex.join(argv), fits_card), {
                "part": "fit", "model": planner.ref, "recipe": "your_model", "argv": argv, "budget_gb": budget,
                "expect": "ok" if fits_card else "oom", "steps": None, "role": role})  # fmt: skip
            run["budget_gb"] = (min if fits_card else max)(run["budget_gb"], budget)
            if planner_proof.ROLES.index(role) < planner_proof.ROLES.index(run["role"]):
                run["role"] = role
            rows.append({**planner_proof._row(budget, role, c), "key": [shlex.join(argv), fits_card]})
    for row in rows:
        row["measured_at_budget_gb"] = runs[tuple(row["key"])]["budget_gb"]
    ordered = sorted(runs.values(), key=lambda r: planner_proof.ROLES.index(r.pop("role")))
    plan = {"arguments": key, "rows": rows, "runs": ordered}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(str(path), plan)
    return plan


def run_key(run: dict[str, Any]) -> tuple:
    return (run["part"], shlex.join(run["argv"]), run["budget_gb"], run["expect"])


def earlier_runs(out: Path) -> dict[tuple, dict[str, Any]]:
    """The finished runs a previous call left in ``out/rows.json``, by what they ran."""
    try:
        rows = json.loads((out / "rows.json").read_text())
    except (OSError, ValueError):
        return {}
    return {run_key(r): r for r in rows if isinstance(r, dict) and r.get("status") in FINISHED}


def read_prediction(run: dict[str, Any], out: Path) -> None:
    """The run's own prediction, recorded in its results JSON."""
    path = out / run["result_json"] if run.get("result_json") else None
    result = json.loads(path.read_text()) if path and path.exists() else {}
    card = (result.get("extra") or {}).get("predicted_card") or {}
    run.update(
        predicted_peak_gb=card.get("peak_reserved_gb"),
        predicted_device_gb=card.get("device_peak_gb"),
        predicted_allocated_gb=(result.get("estimate") or {}).get("peak_allocated_gb"),
        device_method=(result.get("memory") or {}).get("device_method"),
    )


def pct(p: Any, m: Any) -> str:
    return (
        f"{100 * (p / m - 1):+.1f}%"
        if isinstance(p, float | int) and isinstance(m, float | int) and m
        else "—"
    )


def render(runs: list[dict[str, Any]], fit_rows: list[dict[str, Any]]) -> str:
    f = fit_table.fmt
    lines = [
        "## Predicted against measured (one H100, eager, whole run)",
        "",
        "| model | technique set | status | predicted reserved GB | measured | error | predicted device GB | measured | error |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (r for r in runs if r["part"] == "estimate"):
        flags = " ".join(r["argv"][2:])
        lines.append(
            f"| {r['model']} | `{flags}` | {r.get('status', 'not run')} | {f(r.get('predicted_peak_gb'), '.2f')} |"
            f" {f(r.get('measured_peak_reserved_gb'), '.2f')} | {pct(r.get('predicted_peak_gb'), r.get('measured_peak_reserved_gb'))} |"
            f" {f(r.get('predicted_device_gb'), '.2f')} | {f(r.get('measured_device_peak_gb'), '.2f')} |"
            f" {pct(r.get('predicted_device_gb'), r.get('measured_device_peak_gb'))} |"
        )
    shared = {r.get("jobs") for r in runs if r["part"] == "estimate"} - {None, 1}
    if shared:  # runs that shared the GPU: only a per-process whole-device reading is theirs alone
        methods = sorted(
            {str(r.get("device_method")) for r in runs if r["part"] == "estimate" and r.get("status") == "ok"}
        )
        lines += [
            "",
            f"Estimate runs shared the GPU ({', '.join(map(str, sorted(shared)))} at a time); whole device"
            f" read by: {', '.join(methods)} (nvml-process: the process's own).",
        ]
    if fit_rows:
        lines += ["", "## --fit on a capped GPU", "", fit_table.render(fit_rows)]
    return "\n".join(lines) + "\n"


def fill_fit_rows(runs: list[dict[str, Any]], fit_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """planner_proof's rows with the outcome of the run that measured each."""
    by_key = {(shlex.join(r["argv"]), r["expect"] == "ok"): r for r in runs if r["part"] == "fit"}
    return [fit_table.with_outcome(row, by_key[tuple(row["key"])]) for row in fit_rows]


def write(out: Path, runs: list[dict[str, Any]], fit_rows: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(str(out / "rows.json"), runs)  # type: ignore[arg-type]
    filled = fill_fit_rows(runs, fit_rows)
    write_json_atomic(str(out / "fit.json"), filled)  # type: ignore[arg-type]
    (out / "table.md").write_text(render(runs, filled))


def main(argv: list[str] | None = None, runner=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    runs = estimate_runs(args.models) if "estimate" in args.parts else []
    fit_rows: list[dict[str, Any]] = []
    if "fit" in args.parts:
        plan = fit_plan(args)
        runs += plan["runs"]
        fit_rows = plan["rows"]
        print(
            f"model_proof: --fit plan for {args.fit_model} ready after {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    done = {} if args.redo else earlier_runs(args.out)
    for run in runs:  # a previous call's results: kept, not run again
        run.update({k: v for k, v in done.pop(run_key(run), {}).items() if k not in run})
    runs += done.values()  # what an earlier call ran for a part not asked now stays in rows.json
    todo = [run for run in runs if run.get("status") not in FINISHED]
    print(
        f"model_proof: {len(runs)} runs, {len(runs) - len(todo)} already in {args.out}, {len(todo)} to run,"
        f" {ESTIMATE_STEPS} steps each to estimate, {args.steps} to fit",
        flush=True,
    )
    if args.dry_run:
        for i, run in enumerate(todo, 1):
            print(
                f"[{i:2d}/{len(todo)}] {run['part']}, expect {run['expect']} at {run['budget_gb']:g} GB:"
                f" {shlex.join(planner_proof.run_argv(run, run['steps'] or args.steps, args.out / 'runs' / planner_proof._slug(run)))}"
            )
        return 0
    runner, env = runner or execute, run_env(tempfile.mkdtemp(prefix="model-proof-logs-"))
    lock, counter = threading.Lock(), iter(range(1, len(todo) + 1))

    def one(run: dict[str, Any]) -> None:
        elapsed = time.perf_counter() - t0
        if args.deadline is not None and elapsed >= args.deadline:
            run.update(status="not run", error=f"--deadline {args.deadline:g} s spent")
            return
        with lock:
            i = next(counter)
        print(
            f"[{i:2d}/{len(todo)}] {elapsed:.0f} s: {run['part']} {run['budget_gb']:g} GB, expect {run['expect']}:"
            f" {shlex.join(run['argv'])}",
            flush=True,
        )
        timeout = min(args.timeout, args.deadline - elapsed) if args.deadline else args.timeout
        run["jobs"] = args.jobs if run["part"] == "estimate" else 1
        planner_proof.measure(
            run,
            argparse.Namespace(**{**vars(args), "steps": run["steps"] or args.steps}),
            env,
            runner,
            timeout,
        )
        read_prediction(run, args.out)
        print(
            f"[{i:2d}/{len(todo)}] {run['status']}: reserved {run.get('measured_peak_reserved_gb') or 0:.2f} GB"
            f" (predicted {run.get('predicted_peak_gb') or 0:.2f}), device {run.get('measured_device_peak_gb') or 0:.2f} GB"
            f" (predicted {run.get('predicted_device_gb') or 0:.2f}), {run.get('measured_images_per_s') or 0:.1f}/s,"
            f" {run.get('wall_s', 0):.0f} s",
            flush=True,
        )
        with lock:
            write(args.out, runs, fit_rows)

    # the estimate part's runs may share the GPU (--jobs): each measures its own process's memory; the
    # fit part's run one at a time, as their speeds are compared
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, [r for r in todo if r["part"] == "estimate"]))
    for run in (r for r in todo if r["part"] != "estimate"):
        one(run)
    write(args.out, runs, fit_rows)
    left = sum(r.get("status") not in FINISHED for r in runs)
    print(
        f"model_proof: {time.perf_counter() - t0:.0f} s, {len(runs) - left} of {len(runs)} runs done"
        + (f" ({left} left: call again with the same --out)" if left else "")
        + f" -> {args.out / 'table.md'}"
    )
    if fit_rows:
        print("\n".join(fit_table.check_targets(fill_fit_rows(runs, fit_rows))))
    return 0 if all(r.get("status") in (r["expect"], "not run") for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

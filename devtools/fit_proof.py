"""Prove the advice on GPUs: ``fmr-estimate --model M --fit SIZE --measure`` for models outside the
published proof, two card sizes each, and check the targets.

    python -m devtools.fit_proof --out DIR --gpus 0,1,2,3   # on a GPU machine
    python -m devtools.fit_proof --report DIR            # the table again, on any machine

Each (model, card) is one ``fmr-estimate ... --fit SIZE --measure`` process (planning/your_model/measure.py: the
planner's top five sets, each its own runner process on the emulated card, one at a time); with
``--gpus 0,1,2,3`` the jobs are shared out over those GPUs (``CUDA_VISIBLE_DEVICES``), one job per GPU at a time, so
every measured set has a GPU to itself. Each job writes ``DIR/<job>/plan.json`` after every set, so a
call stopped at its limit keeps what finished; a later call skips the finished jobs.

The targets, per job: the CPU ranking's pick (predicted rank 1) fits its card and runs at >= 90 % of the
fastest of the measured sets that fit; the measured pick fits; no set changes the user's precision or
optimizer. ``DIR/table.md`` has one row per job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fabric_memory_recipes.config import at_least
from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.measurement.results_file import write_atomic
from fabric_memory_recipes.paths import output_folder
from fabric_memory_recipes.processes import REPO, DeviceSlots, project_env

PRECISION, OPTIMIZER = "bf16-mixed", "adamw"  # the user's, in every job
# (job name, the model's flags, card sizes): none of these models is in results/published/h100/your-model/
MATRIX: list[tuple[str, list[str], list[str]]] = [
    ("efficientnet_b0", ["--model", "torchvision:efficientnet_b0", "--batch-size", "128"], ["4GB", "6GB"]),
    ("swin_t", ["--model", "torchvision:swin_t", "--batch-size", "64"], ["3GB", "5GB"]),
    ("roberta-base", ["--model", "hf:examples/configs/roberta-base", "--seq-len", "512", "--batch-size", "32"],
     ["6GB", "8GB"]),
    ("tinyllama-1.1b", ["--model", "hf:examples/configs/tinyllama-1.1b", "--seq-len", "512", "--batch-size", "8"],
     ["22GB", "28GB"]),
]  # fmt: skip
TARGET = 0.90
LONGEST_FIRST = {"tinyllama-1.1b": 3, "roberta-base": 2}  # the queue's order: the longest jobs start first


def jobs(only: tuple[str, ...] = ()) -> list[tuple[str, list[str]]]:
    out = []
    for name, flags, cards in MATRIX:
        if only and name not in only:
            continue
        for card in cards:
            out.append(
                (
                    f"{name}-{card}",
                    [*flags, "--precision", PRECISION, "--optimizer", OPTIMIZER, "--fit", card],
                )
            )
    return out


def finished(folder: Path) -> bool:
    try:
        plan = json.loads((folder / "plan.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(plan["sets"]) and all("status" in s for s in plan["sets"])


def run(out: Path, gpus: list[str], steps: int, only: tuple[str, ...], deadline: float) -> None:
    todo = []
    for job in sorted(jobs(only), key=lambda j: -LONGEST_FIRST.get(j[0].rsplit("-", 1)[0], 0)):
        if finished(out / job[0]):
            print(f"[fit_proof] {job[0]}: done before, skipped", flush=True)
        else:
            todo.append(job)
    start, slots = time.perf_counter(), DeviceSlots(gpus, 1)  # one job per GPU: each set has it to itself

    def one(name: str, argv: list[str]) -> None:
        gpu, env = slots.take(project_env(PYTHONUNBUFFERED="1"))
        try:
            if time.perf_counter() - start >= deadline:
                return  # no job starts after the deadline
            cmd = [sys.executable, "-m", "fabric_memory_recipes.planning", *argv, "--measure",
                   "--measure-dir", str(out / name), "--measure-steps", str(steps)]  # fmt: skip
            print(f"[fit_proof {time.perf_counter() - start:5.0f} s] GPU {gpu}: {name} ...", flush=True)
            with open(out / f"{name}.log", "w") as log:
                code = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            print(
                f"[fit_proof {time.perf_counter() - start:5.0f} s] GPU {gpu}: {name} exit {code}", flush=True
            )
            write_report(out)
        finally:
            slots.release(gpu)

    with ThreadPoolExecutor(max_workers=len(gpus)) as pool:
        for future in [pool.submit(one, name, argv) for name, argv in todo]:
            future.result()


def check(plan: dict[str, Any]) -> dict[str, Any]:
    """One job's targets from its plan.json."""
    sets = plan["sets"]
    fitting = [s for s in sets if s.get("fits")]
    fastest = max((s["measured_samples_per_s"] for s in fitting), default=None)
    pick = sets[0] if sets else {}
    ratio = pick["measured_samples_per_s"] / fastest if pick.get("fits") and fastest else None
    kept = all(
        s["precision"] == PRECISION and not s.get("changes") and s["technique"].startswith("AdamW")
        for s in sets
    )
    return {
        "pick": pick.get("command"),
        "pick_fits": bool(pick.get("fits")),
        "ratio": ratio,
        "pick_ok": bool(pick.get("fits")) and ratio is not None and ratio >= TARGET,
        "kept": kept,
        "measured": len([s for s in sets if "status" in s]),
        "fitting": len(fitting),
        "fastest": fastest,
        "device_errors": [
            s["predicted_device_peak_gb"] / s["measured_device_peak_gb"] - 1
            for s in sets
            if s.get("measured_device_peak_gb")
        ],
    }


def write_report(out: Path) -> list[dict[str, Any]]:
    rows = []
    for name, _ in jobs():
        try:
            plan = json.loads((out / name / "plan.json").read_text())
        except (OSError, ValueError):
            continue
        rows.append({"job": name, "gpu": plan.get("gpu"), **check(plan)})
    lines = [
        "| job | GPU | sets measured (fit) | CPU pick fits | CPU pick ÷ fastest measured | target ≥ 0.90 |"
        " precision and optimizer kept | predicted ÷ measured whole device − 1 |",
        "|---|---|---:|---|---:|---|---|---|",
    ]
    for r in rows:
        errs = r["device_errors"]
        spread = f"{100 * min(errs):+.1f} % to {100 * max(errs):+.1f} %" if errs else "—"
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['job']} | {r['gpu']} | {r['measured']} ({r['fitting']}) | {'yes' if r['pick_fits'] else 'no'}"
            f" | {ratio} | {'met' if r['pick_ok'] else 'missed'} | {'yes' if r['kept'] else 'no'} | {spread} |"
        )
    text = (
        "\n".join(lines)
        + "\n\nWith --measure the pick is the fastest measured set that fits (planning/your_model/measure.py).\n"
    )
    write_atomic(out / "table.md", lambda f: f.write(text))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m devtools.fit_proof", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=output_folder("--out"), required=True, metavar="DIR", help="where the jobs write"
    )
    p.add_argument(
        "--gpus", default="0", help="comma-separated GPU indices to share the jobs over (one job per GPU)"
    )
    p.add_argument("--deadline", type=float, default=1e9, help="seconds after which no job starts")
    p.add_argument("--steps", type=at_least(4), default=12, help="optimizer steps per measured set")
    p.add_argument("--only", default="", help="comma-separated job models (default: all of MATRIX)")
    p.add_argument("--report", action="store_true", help="only render DIR/table.md from what is there")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
        run(args.out, gpus, args.steps, tuple(x for x in args.only.split(",") if x), args.deadline)
    rows = write_report(args.out)
    print((args.out / "table.md").read_text())
    return 0 if rows and all(r["pick_ok"] and r["kept"] for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("FMR_OFFLINE", "1")
    raise SystemExit(main())

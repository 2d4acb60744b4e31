"""A rung's learning rate, warm-up and epochs chosen on the validation split, never the test split.

    python -m fabric_memory_recipes.tools.convergence.sweep --out runs/sweep --parallel 12 \\
        --grid "06,10 lr=0.03,0.06,0.12 warmup=2,6" --grid "15 lr=1e-4,2e-4 warmup=2,6"
    python -m fabric_memory_recipes.tools.convergence.sweep --report runs/sweep   # the summary again

Why. The convergence benchmark (``benchmark.py``) trains every rung with one policy (``policy.PRESETS``). A
rung that misses the fp32 baseline there may miss it for its policy rather than its memory technique: plain
SGD at 4 x 4 (rungs 06, 07, 10, 11) and rung 15's 120 steps at batch 256. A fair policy for such a rung
is chosen the way it would be without a test set: on data neither trained on nor tested on. That is the
digits' validation split (``training/data/digits.py``: 10 % of each class, fixed by its own seed, disjoint
from train and test), which every run already scores at its end (``accuracy.val``). This tool reads that
number only; a setting it picks goes into ``policy.TUNED``, and the benchmark's test split judges it.

Each ``--grid`` names rungs (prefixes of one optimizer) and lists of ``lr=``, ``warmup=`` (epochs) and
``epochs=``; what a grid leaves out is the preset's. Every combination runs on each of its rungs and
``--seed-list`` seeds, planned by the benchmark itself (its flags, fast mode, no variants, no lost-update
measurement; ``sweep_grid.py``) and run as it runs them (``--parallel`` per GPU). Today's setting is not run again where
``--reference`` (the committed benchmark) holds runs of it: their validation accuracy is read instead.

The pick, fixed before any number: per grid, the setting with the highest mean validation accuracy over
its runs; settings within one validation image of it (1/179) tie, and a tie goes to today's setting, then
to the one nearest it (the preset's epochs, then the learning rate nearest on a log scale, then the
warm-up). One seed on 179 images separates large effects only: the benchmark's three seeds on the test
split are the measurement. Output: ``OUT/runs/<recipe>-<setting>-s<seed>.json``, ``OUT/logs/``,
``OUT/reference/runs/`` (the committed runs read), ``OUT/sweep.json`` (every run and the summary) and
``OUT/sweep.md``. Grids of the same rungs are one (one table, one pick).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.measurement.report.cells import write_into_block, write_text
from fabric_memory_recipes.measurement.results_file import write_json_atomic
from fabric_memory_recipes.paths import output_folder
from fabric_memory_recipes.processes import DeviceSlots
from fabric_memory_recipes.tools.convergence import benchmark, run_plan
from fabric_memory_recipes.tools.convergence.policy import CPU_MODEL, MODEL, PRESETS
from fabric_memory_recipes.tools.convergence.run_stats import BASELINE, final_loss
from fabric_memory_recipes.tools.convergence.sweep_grid import (
    Grid,
    Setting,
    merged,
    parse_grid,
    reference_runs,
    setting_jobs,
)
from fabric_memory_recipes.training.data import digits

REFERENCE = run_plan.REPO / "results" / "published" / "h100" / "convergence"


# ------------------------------------------------------------------------------------------- summary
def _row(setting: Setting, runs: list[dict], today: Setting) -> dict[str, Any]:
    val = [r["val"] for r in runs if r["val"] is not None]
    return dataclasses.asdict(setting) | {
        "name": setting.name,
        "today": setting == today,
        "runs": runs,
        "val_mean": statistics.fmean(val) if val else None,
        "val_sd": statistics.stdev(val) if len(val) > 1 else None,
        "n": len(val),
    }


def _run(d: dict, source: str) -> dict[str, Any]:
    """What the sweep keeps of a run: never its test accuracy."""
    return {
        "recipe": d.get("recipe"),
        "seed": (d.get("config") or {}).get("seed"),
        "status": d.get("status"),
        "val": (d.get("accuracy") or {}).get("val") if d.get("status") == "ok" else None,
        "final_loss": final_loss(d),
        "optimizer_steps": (d.get("timing") or {}).get("optimizer_steps"),
        "source": source,
        "device": f"{(d.get('provenance') or {}).get('gpu_name') or 'CPU'} · torch {(d.get('provenance') or {}).get('torch')}",
    }


def choose(rows: list[dict], today: Setting, margin: float) -> dict[str, Any] | None:
    """The pick (see the module's docstring): highest mean validation accuracy; within ``margin`` of it,
    today's setting, then the one nearest today's."""
    scored = [r for r in rows if r["val_mean"] is not None]
    if not scored:
        return None
    best = max(r["val_mean"] for r in scored)
    tied = [r for r in scored if r["val_mean"] >= best - margin]
    return min(
        tied,
        key=lambda r: (
            not r["today"],
            r["epochs"] != today.epochs,
            abs(math.log(r["lr"] / today.lr)),
            abs(r["warmup"] - today.warmup),
        ),
    )


def summarise(out: Path, grids: list[Grid], args: argparse.Namespace) -> dict:
    """Per grid, each setting's runs (this folder's, or the reference's for today's) and the pick.
    ``args``: the model, seeds, mode, extra flags and reference of the sweep."""
    n_val = len(digits.split_indices(digits.raw()[1])[1])
    summary: dict[str, Any] = {"validation_images": n_val, "model": args.model, "seeds": args.seed_list}
    summary["grids"] = []
    for grid in grids:
        rows = []
        for setting in grid.settings:
            runs = []
            for recipe in grid.rungs:
                paths = [out / "runs" / f"{recipe}-{setting.name}-s{s}.json" for s in args.seed_list]
                runs += [_run(json.loads(p.read_text()), "this sweep") for p in paths if p.exists()]
            if setting == grid.today:  # the rungs this sweep did not run: the committed runs
                ran = {r["recipe"] for r in runs}
                for job in {j.recipe: j for j in setting_jobs(grid, setting, args, cuda=True)}.values():
                    found = reference_runs(job, args.reference, args.model) if job.recipe not in ran else []
                    runs += [_run(d, "reference") for d in found]
            rows.append(_row(setting, runs, grid.today))
        pick = choose(rows, grid.today, 1 / n_val)
        summary["grids"].append(
            {
                "spec": grid.spec,
                "rungs": grid.rungs,
                "kind": grid.kind,
                "rows": rows,
                "pick": pick and pick["name"],
            }
        )
    paths = sorted((args.reference / "runs").glob(f"{BASELINE}-default-s*.json")) if args.reference else []
    runs = [d for d in map(json.loads, (p.read_text() for p in paths)) if d["config"]["model"] == args.model]
    base = [v for v in (_run(d, "reference")["val"] for d in runs) if v is not None]
    if len(base) > 1:
        mean, sd = statistics.fmean(base), statistics.stdev(base)
        summary["baseline"] = {"val_mean": mean, "val_sd": sd, "n": len(base), "bar": mean - 2 * sd}
    return summary


def render_summary(summary: dict[str, Any]) -> str:
    """The table per grid: validation accuracy per setting and run, the pick. No test accuracy."""
    n_val = summary["validation_images"]
    lines = [
        f"Validation accuracy (the digits' validation split, {n_val} images: one image is {1 / n_val:.4f}),"
        " never the test split. The pick: the highest mean; within one image of it, today's setting,"
        " then the nearest to it.",
    ]
    devices = sorted({r["device"] for g in summary["grids"] for row in g["rows"] for r in row["runs"]})
    lines += ["", f"Model `{summary['model']}`, seeds {summary['seeds']}; produced on: {'; '.join(devices)}."]
    if base := summary.get("baseline"):
        lines += [
            "",
            f"The fp32 baseline (rung 01, committed runs): {base['val_mean']:.3f} ± {base['val_sd']:.3f}"
            f" (n={base['n']}); its mean − 2 sd: {base['bar']:.3f}.",
        ]
    for grid in summary["grids"]:
        lines += ["", f"`{grid['spec']}` ({grid['kind']}: {', '.join(grid['rungs'])})", ""]
        lines += [
            "| setting | lr | warm-up (epochs) | epochs | validation accuracy per run | mean (n) | final train loss | |",
            "|---|---:|---:|---:|---|---:|---:|---|",
        ]
        for row in grid["rows"]:
            runs = ", ".join(
                f"{r['recipe'][:2]} s{r['seed']} "
                + (f"{r['val']:.3f}" if r["val"] is not None else str(r["status"]))
                for r in row["runs"]
            )
            losses = [r["final_loss"] for r in row["runs"] if r["final_loss"] is not None]
            mean = "—" if row["val_mean"] is None else f"{row['val_mean']:.3f} ({row['n']})"
            marks = [
                m for m, on in (("today's", row["today"]), ("**pick**", row["name"] == grid["pick"])) if on
            ]
            source = " (committed runs)" if any(r["source"] == "reference" for r in row["runs"]) else ""
            lines.append(
                f"| {row['name']}{source} | {row['lr']:g} | {row['warmup']:g} | {row['epochs']} | {runs or '—'}"
                f" | {mean} | {f'{statistics.fmean(losses):.3f}' if losses else '—'} | {' '.join(marks)} |"
            )
    return "\n".join(lines)


def write_summary(out: Path, record: dict[str, Any], readme: str | None = None) -> int:
    write_json_atomic(str(out / "sweep.json"), record)
    text = render_summary(record["summary"])
    head = "# Learning rate, warm-up and epochs on the validation split\n\nGenerated by"
    head += " `python -m fabric_memory_recipes.tools.convergence.sweep --report` from `sweep.json`:"
    head += f" `{record['command']}`.\n\n"
    write_text(out / "sweep.md", head + text + "\n")
    return write_into_block(readme, text, "sweep summary") if readme else 0


# ------------------------------------------------------------------------------------------- running
def run(args: argparse.Namespace, grids: list[Grid]) -> int:
    import torch

    cuda = torch.cuda.is_available() and "cpu" not in args.extra
    out, logs = Path(args.out), Path(args.out) / "logs"
    (logs / "fabric").mkdir(parents=True, exist_ok=True)
    jobs: list[run_plan.Job] = []
    kept = out / "reference" / "runs"  # the committed runs read, kept beside the sweep's own
    kept.mkdir(parents=True, exist_ok=True)
    for grid in grids:
        for setting in grid.settings:
            for job in setting_jobs(grid, setting, args, cuda):
                if setting == grid.today and (found := reference_runs(job, args.reference, args.model)):
                    for d in found:  # today's setting: read from the committed runs
                        write_json_atomic(str(kept / f"{job.recipe}-{d['tag']}.json"), d)
                elif not run_plan.finished(job, out):
                    jobs.append(job)
    for path in (
        sorted((args.reference / "runs").glob(f"{BASELINE}-default-s*.json")) if args.reference else []
    ):
        write_json_atomic(str(kept / path.name), json.loads(path.read_text()))  # the baseline's bar
    args.reference = out / "reference"
    jobs.sort(key=lambda j: -j.micro_batches)  # longest first
    env = benchmark.child_env(argparse.Namespace(mode=args.mode or ("fast" if cuda else "eager")), logs)
    slots, lock = DeviceSlots(args.gpus, args.parallel), threading.Lock()
    start = time.monotonic()
    deadline = start + (args.deadline_s or float("inf"))
    record = {
        "tool": "fabric_memory_recipes.tools.convergence.sweep",
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["sweep", *(sys.argv[1:] if args.argv is None else args.argv)]),
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "grids": args.grid,
        "model": args.model,
        "seeds": args.seed_list,
        "mode": args.mode,
        "extra_flags": args.extra,
        "data": digits.splits()[1],
    }
    print(
        f"[sweep] {len(jobs)} runs, {args.parallel} at a time, on {'CUDA' if cuda else 'CPU'}; in {out}",
        flush=True,
    )

    def save() -> None:
        record["wall_s"] = time.monotonic() - start
        fields = ("recipe", "tag", "returncode", "wall_s", "skipped")
        record["jobs"] = [{key: getattr(j, key) for key in fields} for j in jobs]
        record["summary"] = summarise(out, grids, args)
        write_summary(out, record, args.readme)

    def one(job: run_plan.Job) -> None:  # run, then record what finished so far
        gpu, job_env = slots.take(env)
        try:
            benchmark.run_job(job, out, logs, job_env, args.extra, deadline)
        finally:
            slots.release(gpu)
        with lock:
            save()

    with ThreadPoolExecutor(max_workers=args.parallel * args.gpus) as pool:
        list(pool.map(one, jobs))
    save()
    print(Path(out / "sweep.md").read_text(), flush=True)
    return 1 if any(j.returncode not in (0, None) or j.skipped for j in jobs) else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    given = list(sys.argv[1:] if argv is None else argv)
    ours, extra = (
        (given[: given.index("--")], given[given.index("--") + 1 :]) if "--" in given else (given, [])
    )
    p = Parser(
        prog="python -m fabric_memory_recipes.tools.convergence.sweep", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", default="runs/sweep", type=output_folder("--out"), help="results folder")
    p.add_argument("--report", metavar="DIR", type=output_folder("--report"), help="only summarise DIR again")
    p.add_argument(
        "--grid", action="append", default=[], help='"RUNGS lr=A,B warmup=W,V epochs=E" (repeatable)'
    )
    p.add_argument(
        "--model", choices=sorted(PRESETS), help=f"default: {MODEL} on a GPU, {CPU_MODEL} on a CPU"
    )
    p.add_argument("--seed-list", default="0", help="comma-separated seeds of every setting (default 0)")
    p.add_argument("--parallel", type=int, default=1, help="runs at once per GPU")
    p.add_argument("--gpus", type=int, default=1, help="GPUs to spread the runs over")
    p.add_argument("--deadline-s", type=float, help="start no run after this many seconds")
    p.add_argument("--mode", choices=("fast", "eager"), help="the recipes' --mode (default: theirs)")
    p.add_argument("--reference", type=Path, default=REFERENCE, help="committed benchmark with today's runs")
    p.add_argument(
        "--no-reference", dest="reference", action="store_const", const=None, help="run today's too"
    )
    p.add_argument("--readme", metavar="PATH:BLOCK", help="also write the summary into a marked block")
    args = p.parse_args(ours)
    args.extra, args.argv = extra, argv
    args.seed_list = [int(s) for s in args.seed_list.split(",") if s.strip()]
    if args.report:
        return args
    if args.model is None:
        import torch

        args.model = MODEL if torch.cuda.is_available() and "cpu" not in extra else CPU_MODEL
    if not args.grid:
        p.error("--grid: give at least one grid")
    try:
        args.grids = merged([parse_grid(spec, args.model) for spec in args.grid])
    except ValueError as e:
        p.error(f"--grid {e}")
    if args.reference is not None and not (args.reference / "runs").is_dir():
        args.reference = None  # no committed runs there: today's setting runs too
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:  # the summary again, from sweep.json's record and the runs' files
        record = json.loads((Path(args.report) / "sweep.json").read_text())
        args.model, args.seed_list, args.reference = (
            record["model"],
            record["seeds"],
            Path(args.report) / "reference",
        )
        args.mode, args.extra = record.get("mode"), record.get("extra_flags") or []
        grids = merged([parse_grid(spec, args.model) for spec in record["grids"]])
        record["summary"] = summarise(Path(args.report), grids, args)
        return write_summary(Path(args.report), record, args.readme)
    return run(args, args.grids)


if __name__ == "__main__":
    raise SystemExit(main())

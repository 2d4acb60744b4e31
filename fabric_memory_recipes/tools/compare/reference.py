"""Run the article's scripts and this project's matching rungs (eager and fast) in one call, and compare.

    python -m fabric_memory_recipes.tools.compare.reference --reference DIR [--rungs 01,02,...] [--steps 25]
        [--out runs/compare-<gpu>] [--modes eager,fast] [--timeout 300] [--budget SECONDS] [--devices N]

DIR is a checkout of the article's repository, rasbt/pytorch-memory-optim (Apache-2.0): its training
scripts (``01-2_pytorch-fabric.py`` ... ``06_sgd-with-scheduler.py``, ``09_fsdp-act-checkp.py``, ...)
and ``local_utilities.py`` side by side in its top folder. Nothing of it is copied here: each script runs
from DIR through ``fabric_memory_recipes/tools/compare/runner.py``, offline, with only the data and the weights swapped
(see that module), and stops after ``--steps`` optimizer steps. Each rung of this project runs as
``python recipes/NN_*.py --data synthetic --weights none --max-steps N ... --mode eager|fast``.

Every run is its own process, one after another (they share the GPU, and a comparison is a ratio
measured in one call). Outputs in ``--out``: ``runs/`` (each run's JSON and log), ``comparison.json``
(a list of rows ``{"rung", "reference", "eager", "fast", ...}``, each side with ``peak_reserved_gb`` and
``images_per_s``), ``comparison.md`` and ``comparison.png`` (``fabric_memory_recipes.measurement.report.render``). The files are
rewritten after every run, so an interrupted call keeps what it measured. Rows of rungs that this call
does not run are kept from an earlier ``comparison.json`` in ``--out`` (each row records its call).

Exit code: 0 every run ok, 1 some run failed, timed out or was not started (summary on stderr), 2 bad
arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fabric_memory_recipes.config import at_least
from fabric_memory_recipes.console import Parser, fail
from fabric_memory_recipes.measurement.results_file import gpu_slug
from fabric_memory_recipes.paths import RUNS, output_folder
from fabric_memory_recipes.processes import Run, execute, gpu_probe, run_env
from fabric_memory_recipes.tools.compare.plan import (
    MIN_STEPS,
    MODE_ARGS,
    MODES,
    RUNGS,
    SINGLE_GPU_RUNGS,
    SUBSTITUTION_NOTE,
    Reference,
    devices_of,
    plan_runs,
)
from fabric_memory_recipes.tools.compare.rows import (
    build_row,
    call_info,
    side_of,
    summarize_project,
    summarize_reference,
    write_outputs,
)


# -------------------------------------------------------------------------------------------- main
def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "n/a"


def _side(run: Run, out_dir: Path) -> dict[str, Any]:
    summary = (summarize_reference if run.kind == "reference" else summarize_project)(run.json)
    return side_of(run, summary, out_dir) or {}


def _describe(side: dict[str, Any], run: Run) -> str:
    """'ok, 3.25 GB reserved, 88.7 img/s, 21.3 s' or 'timeout (killed after 300 s), 300.0 s'."""
    text = str(side.get("status"))
    if side.get("status") == "ok":
        text += (
            f", {_fmt(side.get('peak_reserved_gb'), '.2f')} GB reserved,"
            f" {_fmt(side.get('images_per_s'), '.1f')} img/s"
        )
    elif side.get("error"):
        text += f" ({side['error']})"
    return text + f", {_fmt((run.result or {}).get('wall_s'), '.1f')} s"


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(
        prog="python -m fabric_memory_recipes.tools.compare.reference",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--reference", required=True, help="a checkout of rasbt/pytorch-memory-optim")
    p.add_argument(
        "--rungs", default=",".join(SINGLE_GPU_RUNGS), help="comma-separated rungs (default: one GPU's)"
    )
    p.add_argument("--steps", type=at_least(MIN_STEPS), default=25, help="optimizer steps per run")
    p.add_argument("--out", type=output_folder("--out"), help="output folder (default: runs/compare-<gpu>)")
    p.add_argument("--modes", default=",".join(MODES), help="project modes to run: eager,fast")
    p.add_argument("--timeout", type=at_least(1), default=300, help="seconds per run before it is killed")
    p.add_argument(
        "--budget", type=at_least(1), help="seconds for the whole call: later runs are not started"
    )
    p.add_argument(
        "--map",
        action="append",
        default=[],
        metavar="RUNG=SCRIPT[:DEVICES]",
        help="use another of the article's scripts as a rung's reference (e.g. 09=11_delay-allocation.py:4)",
    )
    p.add_argument(
        "--mode-args", help=f"project flags per mode, {{mode}} replaced (default: {' '.join(MODE_ARGS)})"
    )
    p.add_argument("--project-args", default="", help="more flags for every project run")
    p.add_argument(
        "--devices",
        type=at_least(2),
        help="GPUs of the sharded rungs (08, 08-fsdp2, 09) and of the article's FSDP script (default: 4)",
    )
    p.add_argument("--python", default=sys.executable, help="interpreter for the runs")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = p.parse_args(argv)

    args.reference = Path(args.reference)
    if not args.reference.is_dir():
        fail(f"--reference {args.reference}: not a directory (a checkout of rasbt/pytorch-memory-optim)")
    args.rungs = _csv(args.rungs)
    unknown = [r for r in args.rungs if r not in RUNGS]
    if unknown or not args.rungs:
        fail(f"--rungs: unknown rung {', '.join(unknown) or '(none given)'}; known: {', '.join(RUNGS)}")
    args.modes = _csv(args.modes)
    if not set(args.modes) <= set(MODES):
        fail(f"--modes: choose from {', '.join(MODES)}, got {','.join(args.modes)}")
    args.mapping = {}
    for item in args.map:
        rung, _, target = item.partition("=")
        script, _, devices = target.partition(":")
        if rung not in RUNGS or not script or (devices and not devices.isdigit()):
            fail(f"--map {item}: expected RUNG=SCRIPT[:DEVICES] with a known rung")
        default = RUNGS[rung].reference
        if default is not None and default.script == script and not devices:
            continue  # the mapping's own choice, with its notes
        args.mapping[rung] = Reference(script, int(devices or 1), note=f"reference chosen with --map {item}")
    missing = sorted(
        {
            ref.script
            for rung in args.rungs
            if (ref := args.mapping.get(rung, RUNGS[rung].reference)) is not None
            and not (args.reference / ref.script).is_file()
        }
    )
    if missing:
        fail(
            f"--reference {args.reference} lacks {', '.join(missing)}"
            " (expected the top folder of a rasbt/pytorch-memory-optim checkout)"
        )
    if (args.reference / "local_utilities.py").is_file() is False and any(
        args.mapping.get(r, RUNGS[r].reference) for r in args.rungs
    ):
        fail(f"--reference {args.reference} lacks local_utilities.py, which the article's scripts import")
    args.mode_args = tuple(shlex.split(args.mode_args)) if args.mode_args is not None else MODE_ARGS
    args.project_args = tuple(shlex.split(args.project_args))
    return args


def _earlier_rows(out_dir: Path, rungs: list[str]) -> list[dict]:
    """Rows of an earlier comparison.json in ``out_dir`` for rungs that this call does not run."""
    try:
        previous = json.loads((out_dir / "comparison.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    kept = [r for r in previous if isinstance(r, dict) and r.get("rung") and r["rung"] not in rungs]
    if kept:
        print(
            f"compare: keeping rows {', '.join(sorted(r['rung'] for r in kept))} from {out_dir / 'comparison.json'}"
        )
    return kept


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m fabric_memory_recipes.tools.compare.reference " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    references = [args.mapping.get(r, RUNGS[r].reference) for r in args.rungs]
    needs = max(
        [devices_of(RUNGS[r].devices, args.devices) for r in args.rungs]
        + [devices_of(ref.devices, args.devices) for ref in references if ref]
    )
    gpus, gpu_name = gpu_probe(args.python) if args.out is None or needs > 1 else (None, None)
    out_dir = Path(args.out or Path(RUNS) / f"compare-{gpu_slug(gpu_name)}")
    runs_dir = out_dir / "runs"
    runs = plan_runs(
        args.rungs,
        args.modes,
        args.reference.resolve(),
        runs_dir.resolve(),
        args.steps,
        args.python,
        args.mapping,
        args.mode_args,
        args.project_args,
        args.devices,
    )
    print(
        f"compare: {len(runs)} runs ({sum(r.kind == 'reference' for r in runs)} of the article's scripts, "
        f"{len(args.rungs)} rungs × {len(args.modes)} modes), {args.steps} optimizer steps each, one process "
        f"at a time, timeout {args.timeout} s per run" + (f", budget {args.budget} s" if args.budget else ""),
        flush=True,
    )
    print(f"compare: reference runs: {SUBSTITUTION_NOTE}", flush=True)
    if args.dry_run:
        for i, run in enumerate(runs, 1):
            print(f"[{i:2d}/{len(runs)}] {run.label}: {shlex.join(run.cmd)}")
        return 0
    runs_dir.mkdir(parents=True, exist_ok=True)
    kept = _earlier_rows(out_dir, args.rungs)

    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    log_dir = tempfile.mkdtemp(prefix="compare-logs-")  # Fabric's CSV logs of the project runs
    env = run_env(log_dir)
    t0 = time.perf_counter()
    for i, run in enumerate(runs, 1):
        spec = devices_of(RUNGS[run.rows[0]].devices, args.devices) if run.kind == "project" else 1
        devices = max(spec, _devices_of(run))
        elapsed = time.perf_counter() - t0
        if gpus is not None and devices > 1 and devices > gpus:  # one process runs anywhere
            run.result = {"status": "not run", "error": f"needs {devices} GPUs, found {gpus}", "wall_s": 0.0}
        elif args.budget and elapsed >= args.budget:
            run.result = {"status": "not run", "error": f"--budget {args.budget} s spent", "wall_s": 0.0}
        else:
            timeout = min(args.timeout, args.budget - elapsed) if args.budget else args.timeout
            print(f"[{i:2d}/{len(runs)}] {run.label}: started", flush=True)
            run.result = execute(run, env, timeout)
        side = _side(run, out_dir)
        run.result["final"] = side.get("status")
        print(f"[{i:2d}/{len(runs)}] {run.label}: {_describe(side, run)}", flush=True)
        if run.result["status"] not in ("ok", "not run") or side.get("status") != "ok":
            print("    " + "\n    ".join(run.result.get("tail", "").strip().splitlines()[-5:]), flush=True)
        info = call_info(runs, started, args.steps, command)
        rows = [build_row(r, runs, out_dir, args.modes, info, args.mapping) for r in args.rungs]
        write_outputs(out_dir, kept + rows, figure=i == len(runs))  # the figure once, at the end
    shutil.rmtree(log_dir, ignore_errors=True)

    total = time.perf_counter() - t0
    by_kind = {}
    for run in runs:
        key = "reference" if run.kind == "reference" else run.mode
        by_kind[key] = by_kind.get(key, 0.0) + (run.result or {}).get("wall_s", 0.0)
    split = ", ".join(f"{k} {v:.0f} s" for k, v in by_kind.items())
    print(f"compare: {len(runs)} runs in {total:.1f} s ({split}) -> {out_dir / 'comparison.json'}, .md, .png")
    failed = [r for r in runs if r.result.get("final") != "ok"]
    if failed:
        lines = [f"{r.label}: {_describe(_side(r, out_dir), r)}" for r in failed]
        print(
            f"compare: {len(failed)} of {len(runs)} runs did not finish ok:",
            *lines,
            sep="\n  ",
            file=sys.stderr,
        )
        return 1
    return 0


def _devices_of(run: Run) -> int:
    if "--nproc-per-node" in run.cmd:
        return int(run.cmd[run.cmd.index("--nproc-per-node") + 1])
    return 1


if __name__ == "__main__":
    raise SystemExit(main())

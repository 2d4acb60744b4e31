"""Run the article's scripts and this project's matching rungs (eager and fast) in one call, and compare.

    python -m fabric_memory_recipes.tools.compare_reference --reference DIR [--rungs 01,02,...] [--steps 25]
        [--out runs/compare-<gpu>] [--modes eager,fast] [--timeout 300] [--budget SECONDS]

DIR is a checkout of the article's repository, rasbt/pytorch-memory-optim (Apache-2.0): its training
scripts (``01-2_pytorch-fabric.py`` ... ``06_sgd-with-scheduler.py``, ``09_fsdp-act-checkp.py``, ...)
and ``local_utilities.py`` side by side in its top folder. Nothing of it is copied here: each script runs
from DIR through ``fabric_memory_recipes/tools/reference_runner.py``, offline, with only the data and the weights swapped
(see that module), and stops after ``--steps`` optimizer steps. Each rung of this project runs as
``python recipes/NN_*.py --data synthetic --weights none --max-steps N ... --mode eager|fast``.

Every run is its own process, one after another (they share the GPU, and a comparison is a ratio
measured in one call). Outputs in ``--out``: ``runs/`` (each run's JSON and log), ``comparison.json``
(a list of rows ``{"rung", "reference", "eager", "fast", ...}``, each side with ``peak_reserved_gb`` and
``images_per_s``), ``comparison.md`` and ``comparison.png`` (``fabric_memory_recipes.measurement.report``). The files are
rewritten after every run, so an interrupted call keeps what it measured. Rows of rungs that this call
does not run are kept from an earlier ``comparison.json`` in ``--out`` (each row records its call).

Exit code: 0 every run ok, 1 some run failed, timed out or was not started (summary on stderr), 2 bad
arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fabric_memory_recipes.config import at_least
from fabric_memory_recipes.console import Parser, fail
from fabric_memory_recipes.measurement.comparison import comparison_ratios, write_comparison
from fabric_memory_recipes.measurement.results_file import WARMUP_STEPS, gpu_slug, write_json_atomic
from fabric_memory_recipes.paths import RUNS, output_folder
from fabric_memory_recipes.tools.project_env import project_env

REPO = Path(__file__).resolve().parents[2]

SUBSTITUTION_NOTE = (
    "the article's scripts run unchanged (their Fabric set-up, precision, model, optimizer, loop, batch "
    "size and CPU data pipeline with its DataLoader workers) except for what needs the network: CIFAR-10 "
    "is replaced by deterministic random 32×32 images and labels of its sizes (50,000 / 10,000), read "
    "through CIFAR-10's own dataset class and the script's Resize/ToTensor transforms, and pretrained "
    "weights by a random init of the same architecture (fabric_memory_recipes/tools/reference_runner.py). Each stops after the "
    "same number of optimizer steps as the project's runs; memory and speed depend on shapes, not values."
)


@dataclass(frozen=True)
class Reference:
    """One of the article's scripts, as found in the top folder of its repository."""

    script: str
    devices: int = 1  # processes it needs (its Fabric(devices=...)); > 1 runs under torchrun
    like_for_like: bool = True  # False: not the rung's configuration; no ratios against it
    note: str | None = None


@dataclass(frozen=True)
class Rung:
    rung: str
    recipe: str  # recipes/<recipe>.py
    reference: Reference | None = None
    devices: int = 1


_FSDP_NOTE = (
    "the article's script for this step trains ViT-H/14 at 518×518 px in 16-mixed precision, batch 4 per "
    "GPU, on 4 GPUs (Fabric(devices=4)); the rung trains ViT-L/16 at 224 px in fp32, batch 64 per GPU. "
    "Its numbers are shown, not compared. The article's ViT-L/16 fp32 batch-64 FSDP scripts are "
    "11_delay-allocation.py (with cpu_offload=True: rung 09's configuration; --map 09=11_delay-allocation.py) "
    "and 12_fsdp-overlap.py (which imports fsdp_overlap_step_with_backward, no longer in Lightning 2.6)."
)
RUNGS: dict[str, Rung] = {
    r.rung: r
    for r in (
        Rung(
            "01",
            "01_baseline",
            Reference(
                "01-2_pytorch-fabric.py",
                note="the script leaves float32 matmuls at full precision; the rung uses TF32 matmuls",
            ),
        ),
        Rung("02", "02_mixed_precision", Reference("02_mixed-precision.py")),
        Rung("03", "03_true_half_precision", Reference("03_bfloat16.py")),
        Rung("04", "04_lower_batch_size", Reference("04_lower-batchsize.py")),
        Rung("05", "05_gradient_accumulation", Reference("05_gradient-accum.py")),
        Rung("06", "06_sgd_cosine", Reference("06_sgd-with-scheduler.py")),
        Rung(
            "07",
            "07_init_module",
            Reference(
                "06_sgd-with-scheduler.py",
                note="the article's 07_0*_init-module.py scripts only build a model and print its memory (no "
                "training loop); rung 07 trains rung 06's configuration, so the 06 script is its reference "
                "(one run serves both rows)",
            ),
        ),
        Rung(
            "08",
            "08_fsdp",
            Reference("09_fsdp-act-checkp.py", devices=4, like_for_like=False, note=_FSDP_NOTE),
            devices=4,
        ),
        Rung(
            "09",
            "09_cpu_offload",
            Reference("10_fsdp-with-cpu-offload.py", devices=4, like_for_like=False, note=_FSDP_NOTE),
            devices=4,
        ),
        Rung("10", "10_activation_checkpointing"),
        Rung("11", "11_activation_offload"),
        Rung("12", "12_optimizer_in_backward"),
        Rung("13", "13_lowbit_optimizer"),
        Rung("14", "14_memory_floor"),
        Rung("15", "15_speed"),
    )
}
DEFAULT_RUNGS = ("01", "02", "03", "04", "05", "06", "07", "10", "11", "12", "13", "14", "15")  # one GPU
MODES = ("eager", "fast")
# The flags of every project run, and those of each mode ({mode} is replaced). `--eval-batches 2` keeps
# the evaluation short; it still runs, so its memory is in the whole-run peak.
PROJECT_ARGS = ("--data", "synthetic", "--weights", "none", "--eval-batches", "2")
MODE_ARGS = ("--tag", "{mode}", "--mode", "{mode}")
MIN_STEPS = WARMUP_STEPS + 2  # at least two timed intervals after the warm-up steps


# ------------------------------------------------------------------------------------------- the plan
@dataclass
class Run:
    """One process: an article script (serving one or more rows) or one rung in one mode."""

    kind: str  # "reference" | "project"
    name: str  # reference: the script; project: the rung
    mode: str | None
    cmd: list[str]
    json: Path  # what it writes (rank 0)
    log: Path
    rows: list[str] = field(default_factory=list)
    result: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        return f"reference {self.name}" if self.kind == "reference" else f"{self.name} {self.mode}"


def reference_json(runs_dir: Path, script: str) -> Path:
    return runs_dir / f"reference-{Path(script).stem}.json"


def project_json(runs_dir: Path, recipe: str, mode: str) -> Path:
    return (
        runs_dir / f"{recipe}-{mode}.json"
    )  # fabric_memory_recipes.measurement.results_file.results_path with --tag <mode>


def plan_runs(
    rungs: list[str],
    modes: list[str],
    reference_dir: Path,
    runs_dir: Path,
    steps: int,
    python: str = sys.executable,
    mapping: dict[str, Reference] | None = None,
    mode_args: tuple[str, ...] = MODE_ARGS,
    extra_args: tuple[str, ...] = (),
) -> list[Run]:
    """The runs in the order they go: per rung, its reference script (once per script), then each mode."""
    mapping = mapping or {}
    runs: list[Run] = []
    by_script: dict[str, Run] = {}
    for rung in rungs:
        spec = RUNGS[rung]
        ref = mapping.get(rung, spec.reference)
        if ref is not None:
            if ref.script not in by_script:
                out = reference_json(runs_dir, ref.script)
                runner = [
                    "-m",
                    "fabric_memory_recipes.tools.reference_runner",
                    str(reference_dir / ref.script),
                ]
                launch = [python, *runner]
                if ref.devices > 1:
                    launch = [python, "-m", "torch.distributed.run", "--standalone"]
                    launch += ["--nproc-per-node", str(ref.devices), *runner]
                cmd = [*launch, "--steps", str(steps), "--out", str(out)]
                by_script[ref.script] = Run("reference", ref.script, None, cmd, out, out.with_suffix(".log"))
                runs.append(by_script[ref.script])
            by_script[ref.script].rows.append(rung)
        for mode in modes:
            out = project_json(runs_dir, spec.recipe, mode)
            cmd = [python, str(REPO / "recipes" / f"{spec.recipe}.py"), *PROJECT_ARGS]
            cmd += ["--max-steps", str(steps), "--results-dir", str(runs_dir)]
            cmd += [a.format(mode=mode) for a in mode_args] + list(extra_args)
            runs.append(Run("project", rung, mode, cmd, out, out.with_suffix(".log"), rows=[rung]))
    return runs


# ---------------------------------------------------------------------------------- reading the runs
def _first_line(text: str | None) -> str | None:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else None


def _read_json(path: Path) -> dict | None:
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return payload if isinstance(payload, dict) else None


def summarize_reference(path: Path) -> dict[str, Any] | None:
    """The reference side of a row from the runner's JSON (rank files merged: memory is the maximum
    over ranks, i.e. per GPU; img/s counts all ranks). None when the runner wrote nothing."""
    main = _read_json(path)
    if main is None:
        return None
    ranks = [main] + [p for p in map(_read_json, sorted(path.parent.glob(f"{path.stem}.rank*.json"))) if p]

    def peak(key: str) -> float | None:
        values = [r.get(key) for r in ranks if isinstance(r.get(key), int | float)]
        return max(values) if values else None

    return {
        "status": main.get("status", "error"),
        "peak_reserved_gb": peak("peak_reserved_gb"),
        "images_per_s": main.get("images_per_s"),
        "peak_allocated_gb": peak("peak_allocated_gb"),
        "steps": main.get("steps"),
        "median_step_s": main.get("median_step_s"),
        "effective_batch": main.get("effective_batch"),
        "world_size": main.get("world_size"),
        "script_constants": main.get("script_constants"),
        "warmup": (main.get("memory") or {}).get("warmup"),
        "steady": (main.get("memory") or {}).get("steady"),
        "error": main.get("error"),
        "substitutions": main.get("substitutions"),
        "provenance": main.get("provenance"),
    }


def summarize_project(path: Path) -> dict[str, Any] | None:
    """One mode's side of a row from a recipe's results JSON: img/s = timing.images_per_s, memory = the
    maximum over memory.phases.* (model load, train, eval: the whole run), warm-up/steady peaks when the
    results carry them. None when the recipe wrote nothing."""
    result = _read_json(path)
    if result is None:
        return None
    memory = result.get("memory") or {}
    phases = [p for p in (memory.get("phases") or {}).values() if isinstance(p, dict)]

    def peak(key: str) -> float | None:
        values = [p.get(key) for p in phases if isinstance(p.get(key), int | float)]
        return max(values) if values else memory.get(key)

    timing, config = result.get("timing") or {}, result.get("config") or {}
    return {
        "status": result.get("status", "error"),
        "peak_reserved_gb": peak("peak_reserved_gb"),
        "images_per_s": timing.get("images_per_s"),
        "peak_allocated_gb": peak("peak_allocated_gb"),
        "train_peak_reserved_gb": memory.get("peak_reserved_gb"),
        "device_peak_gb": memory.get(
            "device_peak_gb"
        ),  # the whole device (fabric_memory_recipes.measurement.device_memory)
        "steps": timing.get("optimizer_steps"),
        "median_step_s": timing.get("median_step_s"),
        "warmup": memory.get("warmup"),
        "steady": memory.get("steady"),
        "mode": config.get("mode"),
        "compile": config.get("compile"),
        "error": result.get("error"),
        "provenance": result.get("provenance"),
    }


def side_of(run: Run | None, summary: dict[str, Any] | None, out_dir: Path) -> dict[str, Any] | None:
    """A row's side: the JSON's numbers with how the process ended (exit code, wall time, log)."""
    if run is None and summary is None:
        return None
    side: dict[str, Any] = dict(
        summary or {"status": "error", "peak_reserved_gb": None, "images_per_s": None}
    )
    side.pop("provenance", None)  # in the row's "call" instead
    outcome = (run.result if run else None) or {}
    if outcome.get("status") in ("timeout", "not run"):
        side["status"] = outcome["status"]
    elif outcome and outcome.get("exit_code") not in (0, None) and side.get("status") == "ok":
        side["status"] = "error"  # a JSON saying ok from a process that failed afterwards
    if outcome:
        side["exit_code"] = outcome.get("exit_code")
        side["wall_s"] = outcome.get("wall_s")
        if side.get("status") != "ok" and not side.get("error"):
            side["error"] = outcome.get("error")
    if run is not None:
        side["json"] = os.path.relpath(run.json, out_dir)
        side["log"] = os.path.relpath(run.log, out_dir)
        if run.kind == "reference":
            side["script"] = run.name
    if not side.get("status"):
        side["status"] = "error"
    return side


def build_row(
    rung: str,
    runs: list[Run],
    out_dir: Path,
    modes: list[str],
    call: dict[str, Any],
    mapping: dict[str, Reference] | None = None,
) -> dict[str, Any]:
    """The comparison row of one rung from the files its runs wrote (and how the processes ended)."""
    spec = RUNGS[rung]
    ref = (mapping or {}).get(rung, spec.reference)
    ref_run = next((r for r in runs if r.kind == "reference" and rung in r.rows), None)
    row: dict[str, Any] = {"rung": rung, "recipe": spec.recipe}
    row["reference"] = side_of(ref_run, summarize_reference(ref_run.json) if ref_run else None, out_dir)
    for mode in MODES:
        run = next((r for r in runs if r.kind == "project" and r.name == rung and r.mode == mode), None)
        row[mode] = (
            side_of(run, summarize_project(run.json) if run else None, out_dir) if mode in modes else None
        )
    row["like_for_like"] = ref.like_for_like if ref else None
    row["reference_note"] = ref.note if ref else "the article has no script for this rung"
    row["ratios"] = comparison_ratios(row)
    row["call"] = call
    return row


def call_info(runs: list[Run], started: str, steps: int, command: str) -> dict[str, Any]:
    """What produced the rows: GPU and versions (from the first run that recorded them), steps, command."""
    provenance: dict[str, Any] = {}
    for run in runs:
        payload = _read_json(run.json) or {}
        provenance = payload.get("provenance") or {}
        if provenance.get("gpu_name"):
            break
    return {
        "started": started,
        "gpu_name": provenance.get("gpu_name"),
        "torch": provenance.get("torch"),
        "lightning": provenance.get("lightning"),
        "steps": steps,
        "command": command,
        "substitution_note": SUBSTITUTION_NOTE,
    }


def write_outputs(out_dir: Path, rows: list[dict], figure: bool = True) -> None:
    """comparison.json (rows sorted by rung), comparison.md and, with ``figure``, comparison.png."""
    rows = sorted(rows, key=lambda r: r["rung"])
    write_json_atomic(str(out_dir / "comparison.json"), rows)  # type: ignore[arg-type]
    write_comparison(rows, out_dir, figure=figure)


# ----------------------------------------------------------------------------------------- running
def execute(run: Run, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run one process (its own process group, output to its log); kill the group on timeout."""
    for stale in (run.json, *run.json.parent.glob(f"{run.json.stem}.rank*.json")):
        stale.unlink(missing_ok=True)  # a failed run must not be read as an older file
    run.log.parent.mkdir(
        parents=True, exist_ok=True
    )  # planner_proof's logs sit beside not-yet-made run folders
    start = time.perf_counter()
    with open(run.log, "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(run.cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            run.cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
            status = "ok" if code == 0 else "oom" if code == 3 else "error"  # recipes: 2 bad flags, 3 OOM
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code, status = None, "timeout"
        finally:
            _kill_group(proc)  # whatever it left behind (DataLoader workers, ranks)
    wall = time.perf_counter() - start
    tail = run.log.read_text(encoding="utf-8", errors="replace")[-4000:]
    error = f"killed after {timeout:.0f} s" if status == "timeout" else None
    if status not in ("ok", "timeout"):
        error = _first_line(tail)
    return {"status": status, "exit_code": code, "wall_s": wall, "error": error, "tail": tail}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group started for this run, nothing else
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


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


def gpu_probe(python: str) -> tuple[int, str | None]:
    """(CUDA devices, name of the first) from a short child process: this process stays off the GPU."""
    code = (
        "import torch;n=torch.cuda.device_count();print(n);print(torch.cuda.get_device_name(0) if n else '')"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        count, name = (out.stdout.strip().splitlines() + ["", ""])[:2]
        return int(count), name or None
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0, None


# -------------------------------------------------------------------------------------------- main
def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(
        prog="python -m fabric_memory_recipes.tools.compare_reference",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--reference", required=True, help="a checkout of rasbt/pytorch-memory-optim")
    p.add_argument(
        "--rungs", default=",".join(DEFAULT_RUNGS), help="comma-separated rungs (default: one GPU's)"
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


def run_env(log_dir: str) -> dict[str, str]:
    """The project runs' environment: this checkout first on PYTHONPATH, offline, logs in ``log_dir``."""
    return project_env(PYTHONUNBUFFERED="1", FMR_OFFLINE="1", FMR_LOG_DIR=log_dir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m fabric_memory_recipes.tools.compare_reference " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    references = [args.mapping.get(r, RUNGS[r].reference) for r in args.rungs]
    needs = max([RUNGS[r].devices for r in args.rungs] + [ref.devices for ref in references if ref])
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
        devices = max(RUNGS[run.rows[0]].devices if run.kind == "project" else 1, _devices_of(run))
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

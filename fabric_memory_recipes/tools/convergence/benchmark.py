"""Convergence benchmark: every single-GPU rung trains ViT-L/16 on the real digits, several seeds, against fp32.

    fmr-convergence --seeds 3 --parallel 8 --deadline-s 500                  # on a GPU: into runs/convergence
    fmr-convergence --model vit_tiny --seed-list 0 --parallel 2             # the same code path on a CPU
    FMR_PUBLISH=1 fmr-convergence --report results/published/h100/convergence --readme README.md:convergence

Why. The ladder's accuracy columns cannot tell rungs apart on synthetic data. Here each single-GPU rung
(01-07, 10-15) trains the ladder's own model, torchvision's ViT-L/16 from random weights, on
scikit-learn's digits (training/data/digits.py) for the same epochs (the same samples) and is scored on the
whole test split. A rung whose mean falls outside the fp32 baseline's mean +- 2 sd is flagged with
what it measurably does differently (report.py renders it from the JSON files alone).

Fixed for every rung (``policy.PRESETS``, each overridable by its flag): the epochs, a linear warm-up over
the first epoch(s) (``--warmup-steps``, times the rung's own schedule), one Adam and one SGD learning rate,
and the input size; a rung in ``policy.TUNED`` (chosen on the validation split by ``sweep.py``) keeps its
own learning rate, warm-up or epochs unless ``--no-tuned`` (each run and its flags: ``run_plan.py``). The
digits are 8x8 pixels, so ViT-L/16 reads them at 64 px (16 patches + the class token); its 24 blocks and
303 M parameters are the ladder's, only the position embedding is shorter.
Rungs keep their precision, batch, accumulation, optimizer, schedule, memory technique and way of
building the model, so initial weights are drawn per rung and seed. ``--model vit_tiny`` is the CPU
test of the same code path.

Runs use the recipes' default mode (fast on a GPU). ``--lost-updates`` reads the weights between steps:
the rungs that compare precisions (``LOST_RUNGS``) measure it on the ``--lost-seeds`` without CUDA graphs
(about a third of the speed at micro-batch 4), their other seeds run in full fast mode. The other bf16
update rules (``--bf16-update``, training/techniques/bf16.py) run as variants of rungs 03 (Adam, plain by default) and
06 (SGD, stochastic rounding by default), against 16-mixed; ``--memory`` adds their ViT-L/16 peak memory
(224 px, 10 steps on synthetic data).

Runs share a GPU (``--parallel`` at a time on each; ``--gpus N`` spreads them over N). A call stopped by
``--deadline-s`` keeps what finished: each run writes its JSON, ``benchmark.json`` is rewritten after every
run, and a later call with the same ``--out`` runs only what is missing or ran another bf16 update rule
(``--rerun``: everything), recorded under ``later_calls``. Output:
``OUT/runs/<recipe>-<variant>-s<seed>.json``, ``OUT/benchmark.json``, ``OUT/logs/``, ``OUT/README.md``
and ``OUT/loss_curves.png``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.measurement.results_file import write_json_atomic
from fabric_memory_recipes.paths import output_folder
from fabric_memory_recipes.processes import DeviceSlots, project_env
from fabric_memory_recipes.techniques import MODES
from fabric_memory_recipes.tools.convergence.policy import (
    CPU_MODEL,
    MEMORY_PARALLEL,
    MODEL,
    PRESETS,
    TUNED,
    VARIANTS,
)
from fabric_memory_recipes.tools.convergence.report import (  # noqa: F401 (the report, from this command too)
    BASELINE,
    render,
    render_markdown,
    render_table,
)
from fabric_memory_recipes.tools.convergence.run_plan import REPO, Job, finished, plan, single_gpu_rungs
from fabric_memory_recipes.training.data import digits

SETTINGS = tuple("model image_size epochs warmup_epochs adam_lr sgd_lr lost_seeds parallel gpus mode".split())


# -------------------------------------------------------------------------------------------- running
def child_env(args: argparse.Namespace, logs: Path) -> dict[str, str]:
    env = project_env(FMR_LOG_DIR=str(logs / "fabric"))
    env.setdefault("OMP_NUM_THREADS", "1")  # several runs at once: one intra-op thread each
    env.setdefault("TQDM_MININTERVAL", "30")  # a progress line every 30 s in the logs, not every 0.1 s
    env["PYTHONUNBUFFERED"] = "1"
    if args.mode == "eager":
        env["TORCHDYNAMO_DISABLE"] = "1"  # torchao's optimizers compile their step otherwise
    return env


def run_job(job: Job, out: Path, logs: Path, env: dict[str, str], extra: list[str], deadline: float) -> Job:
    if time.monotonic() > deadline:
        job.skipped = "deadline"
        return job
    cmd = [sys.executable, str(REPO / "recipes" / f"{job.recipe}.py"), *job.args, *extra]
    cmd += ["--results-dir", str(out / "runs"), "--tag", job.tag]
    log = logs / f"{job.recipe}-{job.tag}.log"
    job.log = str(log)
    start = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        job.returncode = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    job.wall_s = time.monotonic() - start
    status = "ok" if job.returncode == 0 else f"exit {job.returncode}"
    print(f"[convergence] {job.recipe} {job.tag}: {status} in {job.wall_s:.0f} s", flush=True)
    return job


def call_summary(args: argparse.Namespace, jobs: list[Job], wall: float, cuda: bool, gpu: str | None) -> dict:
    """This call's record: settings, wall time, and every planned run (exit code, wall, or why skipped)."""
    return {
        "tool": "fabric_memory_recipes.tools.convergence.benchmark",
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "settings": {k: getattr(args, k) for k in SETTINGS}
        | {"seeds": args.seed_list, "extra_flags": args.extra, "device": "cuda" if cuda else "cpu"}
        | {
            "gpu_name": gpu,
            "data": digits.splits()[1],
            "tuned": TUNED.get(args.model, {}) if args.tuned else {},
        },
        "wall_s": wall,
        "runs": [
            {k: v for k, v in asdict(j).items() if k not in ("args", "extra")}
            | {"tag": j.tag, "args": j.args}
            for j in jobs
        ],
    }


def save_summary(path: Path, summary: dict, earlier: dict | None) -> None:
    """benchmark.json: this call's summary, or, after an earlier call, the earlier one with this call
    under ``later_calls`` (the report names each call and adds their wall times)."""
    if earlier is None:
        write_json_atomic(str(path), summary)
        return
    calls = [c for c in earlier.get("later_calls") or [] if c.get("started") != summary.get("started")]
    write_json_atomic(str(path), earlier | {"later_calls": [*calls, summary]})


def run_all(args: argparse.Namespace) -> int:
    import torch

    cuda = torch.cuda.is_available() and "cpu" not in args.extra
    gpu = torch.cuda.get_device_name(0) if cuda else None
    out, logs = Path(args.out), Path(args.logs or Path(args.out) / "logs")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (logs / "fabric").mkdir(parents=True, exist_ok=True)
    summary_path = out / "benchmark.json"
    earlier = json.loads(summary_path.read_text()) if summary_path.exists() else None
    planned = plan(args, cuda)
    jobs = planned if args.rerun else [j for j in planned if not finished(j, out)]
    if len(jobs) < len(planned):
        print(
            f"[convergence] {len(planned) - len(jobs)} of {len(planned)} runs finished in an earlier call:"
            " not run again (--rerun runs them)",
            flush=True,
        )
    # seed by seed (a run cut short by the deadline still leaves whole seeds), longest jobs first
    order = {s: i for i, s in enumerate(args.seed_list)}
    jobs.sort(key=lambda j: (-1 if j.seed is None else order[j.seed], -j.micro_batches))
    env = child_env(args, logs)
    print(
        f"[convergence] {len(jobs)} runs, {args.parallel} at a time, on {'CUDA' if cuda else 'CPU'};"
        f" results in {out}, logs in {logs}",
        flush=True,
    )
    start = time.monotonic()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    deadline = start + (args.deadline_s or float("inf"))
    lock = threading.Lock()

    slots = {
        "memory": DeviceSlots(args.gpus, MEMORY_PARALLEL),
        "accuracy": DeviceSlots(args.gpus, args.parallel),
    }

    def one(job: Job) -> Job:  # run, then record every run so far: a killed call keeps its record
        kind = "memory" if job.seed is None else "accuracy"
        gpu, job_env = slots[kind].take(env)  # --gpus: each run on one GPU, args.parallel per GPU
        try:
            run_job(job, out, logs, job_env, args.extra, deadline)
        finally:
            slots[kind].release(gpu)
        with lock:
            summary = call_summary(args, jobs, time.monotonic() - start, cuda, gpu) | {"started": started}
            save_summary(summary_path, summary, earlier)
        return job

    # the ViT-L/16 memory runs (up to ~16 GB each) go MEMORY_PARALLEL at a time, beside the others
    memory, accuracy = [j for j in jobs if j.seed is None], [j for j in jobs if j.seed is not None]
    with (
        ThreadPoolExecutor(max_workers=MEMORY_PARALLEL * args.gpus) as memory_pool,
        ThreadPoolExecutor(max_workers=args.parallel * args.gpus) as pool,
    ):
        futures = [memory_pool.submit(one, j) for j in memory] + [pool.submit(one, j) for j in accuracy]
        done = [f.result() for f in futures]
    wall = time.monotonic() - start
    save_summary(summary_path, call_summary(args, done, wall, cuda, gpu) | {"started": started}, earlier)
    failed = [j for j in done if j.returncode not in (0, None)]
    skipped = [j for j in done if j.skipped]
    print(
        f"[convergence] {len(done) - len(failed) - len(skipped)} ok, {len(failed)} failed,"
        f" {len(skipped)} skipped (deadline) in {wall:.0f} s"
    )
    for j in failed:
        print(f"[convergence]   failed: {j.recipe} {j.tag} (exit {j.returncode}, log {j.log})")
    render(out, args.readme)
    return 1 if failed or skipped else 0


# ------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = Parser(
        prog="python -m fabric_memory_recipes.tools.convergence.benchmark",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--out", default="runs/convergence", type=output_folder("--out"), help="results folder")
    p.add_argument("--logs", help="log folder (default: OUT/logs)")
    p.add_argument("--report", metavar="DIR", type=output_folder("--report"), help="only render DIR's report")
    p.add_argument("--readme", metavar="PATH:BLOCK", help="also write the table into a marked README block")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--seed-list", help="comma-separated seeds instead of --seeds")
    p.add_argument(
        "--rungs", help="comma-separated recipe names or prefixes (default: every single-GPU rung)"
    )
    p.add_argument(
        "--model", choices=sorted(PRESETS), help=f"default: {MODEL} on a GPU, {CPU_MODEL} on a CPU"
    )
    p.add_argument("--image-size", type=int, metavar="PX", help="input side (default: the model's preset)")
    p.add_argument("--epochs", type=int, help="epochs of every run (default: the model's preset)")
    p.add_argument("--warmup-epochs", type=float, help="linear warm-up, in epochs (default: the preset)")
    p.add_argument("--adam-lr", type=float, help="learning rate of the Adam rungs (default: the preset)")
    p.add_argument("--sgd-lr", type=float, help="learning rate of the SGD rungs (default: the preset)")
    p.add_argument(
        "--parallel", type=int, default=1, help="digits runs at once per GPU (+3 ViT-L/16 memory runs)"
    )
    p.add_argument(
        "--gpus", type=int, default=1, help="GPUs to spread the runs over (CUDA_VISIBLE_DEVICES per run)"
    )
    p.add_argument("--deadline-s", type=float, help="start no run after this many seconds")
    p.add_argument("--rerun", action="store_true", help="run again what an earlier call finished in --out")
    p.add_argument(
        "--lost-seeds",
        default="0",
        help="seeds on which the LOST_RUNGS measure lost updates, without CUDA graphs (default 0: the"
        " first; the other seeds run in full fast mode); in eager mode every run measures them",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        help="the recipes' --mode (default: theirs, fast on a GPU; the rungs in LOST_RUNGS then run"
        " without CUDA graphs, to measure lost updates)",
    )
    p.add_argument(
        "--variants", default="03,06", help="rungs (prefixes) that run the bf16 fix variants (default 03,06)"
    )
    p.add_argument(
        "--no-variants", dest="variants", action="store_const", const="", help="no bf16 fix variants"
    )
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the ViT-L/16 memory runs")
    p.add_argument(
        "--no-tuned",
        dest="tuned",
        action="store_false",
        help="every rung at the preset or these flags (policy.TUNED left out)",
    )
    args = p.parse_args(argv)
    args.extra = extra
    if args.model is None:
        import torch

        args.model = MODEL if torch.cuda.is_available() and "cpu" not in extra else CPU_MODEL
    for key, value in PRESETS[args.model].items():  # what the flags leave out: the model's preset
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.variants = [
        r for r in VARIANTS if any(r.startswith(w.strip()) for w in args.variants.split(",") if w.strip())
    ]
    args.lost_seeds = [int(s) for s in args.lost_seeds.split(",") if s.strip()]
    if args.seed_list:
        args.seed_list = [int(s) for s in args.seed_list.split(",") if s.strip()]
    else:
        args.seed_list = list(range(args.seeds))
    if args.rungs:
        known = single_gpu_rungs()
        wanted = [w.strip() for w in args.rungs.split(",") if w.strip()]
        args.rungs = [n for n in known if any(n.startswith(w) for w in wanted)]
        if not args.rungs:
            p.error(f"--rungs {','.join(wanted)}: none of {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        return render(Path(args.report), args.readme)
    return run_all(args)


if __name__ == "__main__":
    raise SystemExit(main())

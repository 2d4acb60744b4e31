"""Convergence benchmark: every single-GPU rung trained on the real digits, same start, several seeds.

    python -m fabric_memory_recipes.tools.convergence --seeds 3 --parallel 8 [-- RECIPE FLAGS]   # into runs/convergence
    FMR_PUBLISH=1 python -m fabric_memory_recipes.tools.convergence --report results/published/h100/convergence [--readme README.md:convergence]

Why. The memory ladder's accuracy columns cannot tell rungs apart on the synthetic stand-in (every rung
learns it perfectly). Here each rung (01-07, 10-15; 08/09 need several GPUs) trains on scikit-learn's
digits (fabric_memory_recipes/training/digits.py) for the same number of epochs, i.e. the same samples, from the same seed and
the same initial weights (fabric_memory_recipes.training.models builds the small ViT identically on every rung), and is scored
on the whole held-out test split. The fp32 baseline (rung 01) with its spread over seeds is the yardstick:
a rung whose mean test accuracy falls outside the baseline's mean +- 2 sd is flagged, next to what it
measurably does differently (precision and its lost-update fraction, optimizer, batch and so optimizer
steps, final training loss).

What is fixed here, and why. ViT-L/16 from random init needs more than 1,000 steps on digits, about a
minute per run on an H200: 13 rungs x 3 seeds do not fit in one GPU command. The benchmark uses the
same architecture at toy size instead (``--model vit_tiny``: torchvision's VisionTransformer, 2 blocks
of width 64, 32 px input), the memory and speed ladder stays ViT-L/16. Rungs keep their own precision,
batch, accumulation, optimizer, schedule and memory technique; the benchmark sets what fine-tuning
defaults would get wrong from scratch: the learning rate (``--adam-lr`` for the Adam rungs, ``--sgd-lr``
for the SGD rungs, the same for every rung of a kind) and the length (``--epochs``). No warm-up: the
rungs have none, and the small ViT trains without it at these rates. Runs are eager by default
(``--mode eager`` to every recipe, and TORCHDYNAMO_DISABLE=1 for torchao's optimizers): accuracy does
not depend on compilation or CUDA graphs, compiling in ~70 processes would cost more than the
training, and ``--lost-updates`` needs eager steps. Several runs share the GPU at once (``--parallel``).

The bf16 fixes (``--bf16-update``, fabric_memory_recipes/training/bf16.py) run as variants of rung 03 (Adam) and rung 06 (SGD),
compared with 16-mixed (fp32 master weights; rung 02 for Adam, rung 06 with --precision 16-mixed for
SGD) on final training loss and accuracy, and, on a GPU, on ViT-L/16's peak memory (10 steps each).

Output: ``OUT/runs/<recipe>-<variant>-s<seed>.json`` (the recipes' own results JSON, with the loss curve
and lost-update fractions), ``OUT/benchmark.json`` (this tool's settings and each run's exit code and
wall time), logs under ``--logs``, and the report ``OUT/README.md`` + ``OUT/loss_curves.png``, rendered
from those files alone (``--report`` renders again without running anything).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fabric_memory_recipes.config import declared_rung
from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.measurement.report import load_results
from fabric_memory_recipes.measurement.report_format import DASH, write_into_block
from fabric_memory_recipes.measurement.results_file import write_atomic, write_json_atomic
from fabric_memory_recipes.paths import output_folder
from fabric_memory_recipes.tools.project_env import project_env
from fabric_memory_recipes.training import digits

REPO = Path(__file__).resolve().parents[2]
BASELINE = "01_baseline"
MODEL = "vit_tiny"
EPOCHS = 20
ADAM_LR = 1e-3
SGD_LR = 0.05
CURVE_POINTS = 60  # loss points per run: --log-every is chosen per rung to give about this many
LOST_POINTS = 20  # sampled steps for --lost-updates per run
# The bf16 fixes, as variants of one Adam rung and one SGD rung: (tag, flags, flags on a CPU instead).
VARIANTS: dict[str, list[tuple[str, list[str], list[str] | None]]] = {
    "03_true_half_precision": [
        ("stochastic", ["--bf16-update", "stochastic"], None),
        ("kahan", ["--bf16-update", "kahan"], None),
    ],
    "06_sgd_cosine": [
        ("stochastic", ["--bf16-update", "stochastic"], None),
        ("kahan", ["--bf16-update", "kahan"], None),
        ("mixed", ["--precision", "16-mixed"], ["--precision", "bf16-mixed"]),
    ],
}
# ViT-L/16 memory of the fixes (GPU only): rung, variant, flags. Synthetic data: memory does not depend
# on the values, and 10 steps reach the steady state. Rung 14 shows what each fix costs at the floor.
FIXES = [("stochastic", ["--bf16-update", "stochastic"]), ("kahan", ["--bf16-update", "kahan"])]
MEMORY_RUNS = [
    ("02_mixed_precision", "default", []),
    *[("03_true_half_precision", v, f) for v, f in [("default", []), *FIXES]],
    ("06_sgd_cosine", "mixed", ["--precision", "16-mixed"]),
    *[("06_sgd_cosine", v, f) for v, f in [("default", []), *FIXES]],
    *[("14_memory_floor", v, f) for v, f in [("default", []), *FIXES]],
]
MEMORY_PARALLEL = 3  # ViT-L/16 runs at once (up to ~16 GB each), in addition to --parallel
MEMORY_FLAGS = ["--model", "vit_l_16", "--data", "synthetic", "--weights", "none", "--max-steps", "10"]
MEMORY_FLAGS += ["--eval-batches", "1"]
TAG = re.compile(r"^(?P<variant>.+)-s(?P<seed>\d+)$")
MEMORY_TAG = re.compile(r"^memory-(?P<variant>.+)$")


# ------------------------------------------------------------------------------------------- planning
@dataclass
class Job:
    recipe: str
    variant: str
    seed: int | None  # None: a memory run
    args: list[str]
    micro_batches: int = 0  # planned forward+backward passes: the longest jobs start first
    returncode: int | None = None
    wall_s: float | None = None
    log: str | None = None
    skipped: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        return f"memory-{self.variant}" if self.seed is None else f"{self.variant}-s{self.seed}"


def single_gpu_rungs() -> list[str]:
    """The numbered recipes that train on one device (08/09 default to several GPUs). Rung 16 (weights on
    the CPU) is left out: its update is an ordinary Adam step on fp32 masters (tests/test_weights_offload.py), at
    the pace of a CPU Adam step, too slow for a benchmark of thousands of steps; --rungs can still ask."""
    names = sorted(p.stem for p in (REPO / "recipes").glob("[0-9][0-9]_*.py"))
    return [n for n in names if declared_rung(n)[0].devices == 1 and not declared_rung(n)[0].weights_offload]


def optimizer_kind(recipe: str) -> str:
    """'adam' or 'sgd', from the recipe's declared rung (the optimizer its code builds)."""
    name = declared_rung(recipe)[0].optimizer
    return "sgd" if name.startswith("sgd") else "adam"


def plan(args: argparse.Namespace, cuda: bool) -> list[Job]:
    n_train = len(digits.split_indices(digits.raw()[1])[0])
    rungs = args.rungs or single_gpu_rungs()
    jobs: list[Job] = []
    for seed in args.seed_list:
        for recipe in rungs:
            rung, _ = declared_rung(recipe)
            per_epoch = n_train // rung.micro_batch_size
            steps = math.ceil(per_epoch / rung.accumulation_steps) * args.epochs
            lr = args.adam_lr if optimizer_kind(recipe) == "adam" else args.sgd_lr
            base = [
                "--data", "digits", "--model", args.model, "--weights", "none", "--seed", str(seed),
                "--epochs", str(args.epochs), "--lr", str(lr),
                "--log-every", str(max(1, steps // CURVE_POINTS)), "--mode", args.mode,
            ]  # fmt: skip
            if args.mode == "eager":  # the measurement reads weights between steps: not under CUDA graphs
                base += ["--lost-updates", str(max(1, steps // LOST_POINTS))]
            if not cuda and rung.precision == "16-mixed":
                base += ["--precision", "bf16-mixed"]  # fp16 autocast needs CUDA
            variants = [("default", [], None)]
            if args.variants:
                variants += VARIANTS.get(recipe, [])
            for variant, flags, cpu_flags in variants:
                flags = cpu_flags if (cpu_flags is not None and not cuda) else flags
                jobs.append(Job(recipe, variant, seed, [*base, *flags], per_epoch * args.epochs))
    if cuda and args.memory:
        for recipe, variant, flags in MEMORY_RUNS:
            if args.rungs and recipe not in args.rungs:
                continue
            memory_flags = [*MEMORY_FLAGS, "--mode", args.mode, *flags]
            jobs.append(Job(recipe, variant, None, memory_flags, 10**9))
    return jobs


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


def run_all(args: argparse.Namespace) -> int:
    import torch

    cuda = torch.cuda.is_available() and "cpu" not in args.extra
    out, logs = Path(args.out), Path(args.logs or Path(args.out) / "logs")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (logs / "fabric").mkdir(parents=True, exist_ok=True)
    jobs = plan(args, cuda)
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
    deadline = start + (args.deadline_s or float("inf"))
    # the ViT-L/16 memory runs (up to ~16 GB each) go MEMORY_PARALLEL at a time, beside the others
    memory, accuracy = [j for j in jobs if j.seed is None], [j for j in jobs if j.seed is not None]
    with (
        ThreadPoolExecutor(max_workers=MEMORY_PARALLEL) as memory_pool,
        ThreadPoolExecutor(max_workers=args.parallel) as pool,
    ):
        futures = [memory_pool.submit(run_job, j, out, logs, env, args.extra, deadline) for j in memory]
        futures += [pool.submit(run_job, j, out, logs, env, args.extra, deadline) for j in accuracy]
        done = [f.result() for f in futures]
    wall = time.monotonic() - start
    summary = {
        "tool": "fabric_memory_recipes.tools.convergence",
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "settings": {
            "model": args.model,
            "epochs": args.epochs,
            "adam_lr": args.adam_lr,
            "sgd_lr": args.sgd_lr,
            "seeds": args.seed_list,
            "parallel": args.parallel,
            "mode": args.mode,
            "extra_flags": args.extra,
            "device": "cuda" if cuda else "cpu",
            "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
            "data": digits.splits()[1],
        },
        "wall_s": wall,
        "runs": [
            {k: v for k, v in asdict(j).items() if k not in ("args", "extra")}
            | {"tag": j.tag, "args": j.args}
            for j in done
        ],
    }
    write_json_atomic(str(out / "benchmark.json"), summary)
    failed = [j for j in done if j.returncode not in (0, None)]
    skipped = [j for j in done if j.skipped]
    print(f"[convergence] {len(done) - len(failed) - len(skipped)} ok, {len(failed)} failed,"
          f" {len(skipped)} skipped (deadline) in {wall:.0f} s")  # fmt: skip
    for j in failed:
        print(f"[convergence]   failed: {j.recipe} {j.tag} (exit {j.returncode}, log {j.log})")
    render(out, args.readme)
    return 1 if failed or skipped else 0


# ------------------------------------------------------------------------------------------- the report
def _short(optimizer: str | None) -> str:
    """'torch.optim.adam.Adam' -> 'torch Adam'; 'optimi.sgd.SGD' -> 'optimi SGD'."""
    if not optimizer:
        return DASH
    parts = optimizer.split(".")
    return f"{parts[0]} {parts[-1].lstrip('_')}"


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _pm(values: list[float], decimals: int = 3) -> str:
    mean, sd = _mean_sd(values)
    if mean is None:
        return DASH
    text = f"{mean:.{decimals}f}"
    return text + (f" ± {sd:.{decimals}f}" if sd is not None else "") + f" (n={len(values)})"


def _pct(value: float | None) -> str:
    return DASH if value is None else f"{100 * value:.1f}%"


def groups(results: list[dict]) -> tuple[dict[tuple[str, str], list[dict]], dict[tuple[str, str], dict]]:
    """Accuracy runs by (recipe, variant), and memory runs by (recipe, variant)."""
    acc: dict[tuple[str, str], list[dict]] = {}
    mem: dict[tuple[str, str], dict] = {}
    for r in results:
        tag = str(r.get("tag") or "")
        if m := MEMORY_TAG.match(tag):
            mem[(r["recipe"], m["variant"])] = r
        elif m := TAG.match(tag):
            acc.setdefault((r["recipe"], m["variant"]), []).append(r)
    return acc, mem


def final_loss(result: dict) -> float | None:
    """Mean training loss over the last tenth of the loss curve (at least its last point): one logged
    window alone is too noisy to compare runs by, with Adam at a constant learning rate."""
    curve = (result.get("loss") or {}).get("curve") or []
    if not curve:
        return (result.get("loss") or {}).get("last")
    tail = curve[-max(1, len(curve) // 10) :]
    return statistics.fmean(v for _, v in tail)


def _stats(runs: list[dict]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("status") == "ok"]

    def values(get) -> list[float]:
        out = []
        for r in ok:
            v = get(r)
            if isinstance(v, int | float) and math.isfinite(v):
                out.append(float(v))
        return out

    first = ok[0] if ok else (runs[0] if runs else {})
    cfg = first.get("config") or {}
    return {
        "runs": len(runs),
        "ok": len(ok),
        "test": values(lambda r: (r.get("accuracy") or {}).get("test")),
        "loss": values(final_loss),
        "lost": values(lambda r: ((r.get("updates") or {}).get("lost") or {}).get("mean_lost")),
        "steps": values(lambda r: (r.get("timing") or {}).get("optimizer_steps")),
        "precision": cfg.get("precision"),
        "batch": cfg.get("batch_size"),
        "micro": cfg.get("micro_batch_size"),
        "lr": cfg.get("lr"),
        "optimizer": (first.get("updates") or {}).get("optimizer"),
        "rule": (first.get("updates") or {}).get("rule"),
    }


def differences(s: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """What a group measurably does differently from the baseline: the candidate causes of a gap."""
    out = []
    if s["precision"] != base["precision"]:
        lost, base_lost = _mean_sd(s["lost"])[0], _mean_sd(base["lost"])[0]
        text = f"precision {s['precision']}"
        if lost is not None:
            text += f" (lost updates {_pct(lost)} of parameters per step vs {_pct(base_lost)})"
        out.append(text)
    if s["rule"] not in (None, "plain"):
        out.append(f"--bf16-update {s['rule']}")
    if _short(s["optimizer"]) != _short(base["optimizer"]) or s["lr"] != base["lr"]:
        out.append(
            f"{_short(s['optimizer'])} lr {s['lr']:g} vs {_short(base['optimizer'])} lr {base['lr']:g}"
        )
    steps, base_steps = _mean_sd(s["steps"])[0], _mean_sd(base["steps"])[0]
    if s["batch"] != base["batch"] or steps != base_steps:
        micro = (
            f" ({s['micro']}×{s['batch'] // s['micro']})" if s["micro"] and s["micro"] != s["batch"] else ""
        )
        out.append(
            f"batch {s['batch']}{micro}: {steps:.0f} optimizer steps vs {base_steps:.0f}"
            if steps is not None and base_steps is not None
            else f"batch {s['batch']} vs {base['batch']}"
        )
    loss, base_loss = _mean_sd(s["loss"])[0], _mean_sd(base["loss"])[0]
    if loss is not None and base_loss is not None:
        out.append(f"final training loss {loss:.3f} vs {base_loss:.3f}")
    return out


def render_table(results: list[dict]) -> str:
    """Mean ± sd of held-out test accuracy per rung (and bf16 variant), flagged against the baseline."""
    acc, _ = groups(results)
    base = _stats(acc.get((BASELINE, "default"), []))
    base_mean, base_sd = _mean_sd(base["test"])
    lines = [
        "| rung | variant | precision | optimizer | batch | optimizer steps | test accuracy | final train loss¹"
        " | lost updates / step | vs baseline |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for (recipe, variant), runs in sorted(acc.items()):
        s = _stats(runs)
        mean = _mean_sd(s["test"])[0]
        if (recipe, variant) == (BASELINE, "default"):
            verdict = "baseline"
        elif mean is None or base_mean is None or base_sd is None:
            verdict = DASH
        elif abs(mean - base_mean) > 2 * base_sd:
            verdict = f"**outside ± 2 sd** ({mean - base_mean:+.3f}): " + "; ".join(differences(s, base))
        else:
            verdict = f"within ({mean - base_mean:+.3f})"
        if s["ok"] < s["runs"]:
            verdict += f" — {s['runs'] - s['ok']} run(s) failed"
        steps = _mean_sd(s["steps"])[0]
        row = [
            recipe,
            variant,
            str(s["precision"] or DASH),
            f"{_short(s['optimizer'])} {s['lr']:g}" if s["lr"] is not None else _short(s["optimizer"]),
            str(
                s["batch"]
                if s["micro"] in (None, s["batch"])
                else f"{s['batch']} ({s['micro']}×{s['batch'] // s['micro']})"
            ),
            DASH if steps is None else f"{steps:.0f}",
            _pm(s["test"]),
            _pm(s["loss"]),
            _pct(_mean_sd(s["lost"])[0]),
            verdict,
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


TABLE_NOTE = (
    "¹ Final training loss: the mean of the loss curve's last tenth (about the last 10% of the steps),"
    " averaged over seeds. Lost updates / step: the mean over sampled steps of the fraction of parameters"
    " whose update would move them in fp32 but whose effective weight did not move (fabric_memory_recipes/training/bf16.py)."
)


def render_fixes(results: list[dict]) -> str | None:
    """The bf16 fixes against fp32 master weights: final training loss, accuracy, lost updates, memory."""
    acc, mem = groups(results)
    adam, sgd = ("02_mixed_precision", "default"), ("06_sgd_cosine", "mixed")
    rules = ("default", "stochastic", "kahan")
    pairs = [(*adam, "Adam: 16-mixed (rung 02)", adam)]
    pairs += [("03_true_half_precision", v, f"Adam: bf16-true {v} (rung 03)", adam) for v in rules]
    pairs += [(*sgd, "SGD: 16-mixed (rung 06 --precision 16-mixed)", sgd)]
    pairs += [("06_sgd_cosine", v, f"SGD: bf16-true {v} (rung 06)", sgd) for v in rules]
    pairs += [("14_memory_floor", v, f"SGD in backward: bf16-true {v} (rung 14)", None) for v in rules]
    rows = [row for row in pairs if row[:2] in acc or row[:2] in mem]
    if not rows:
        return None
    lines = [
        "| run | final train loss¹ | vs 16-mixed | test accuracy | lost updates / step | ViT-L/16 peak allocated GB"
        " | ViT-L/16 peak reserved GB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for recipe, variant, label, reference in rows:
        s = _stats(acc.get((recipe, variant), []))
        ref_loss = _mean_sd(_stats(acc.get(reference, []))["loss"])[0] if reference else None
        loss = _mean_sd(s["loss"])[0]
        gap = DASH if loss is None or not ref_loss else f"{100 * (loss - ref_loss) / ref_loss:+.0f}%"
        m = mem.get((recipe, variant)) or {}
        memory = m.get("memory") or {}
        cells = [
            "OOM" if m.get("status") == "oom" else (DASH if memory.get(k) is None else f"{memory[k]:.2f}")
            for k in ("peak_allocated_gb", "peak_reserved_gb")
        ]
        lines.append(
            f"| {label} | {_pm(s['loss'])} | {gap} | {_pm(s['test'])} | {_pct(_mean_sd(s['lost'])[0])} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def _provenance(results: list[dict], settings: dict[str, Any]) -> list[str]:
    acc, _ = groups(results)
    runs = [r for rs in acc.values() for r in rs]
    kinds = sorted(
        {
            f"{(r.get('provenance') or {}).get('gpu_name') or 'CPU'} · torch {(r.get('provenance') or {}).get('torch')}"
            f" · data {(r.get('provenance') or {}).get('data_source')} · model {(r.get('provenance') or {}).get('model')}"
            f" ({(r.get('provenance') or {}).get('weights')} init)"
            for r in runs
        }
    )
    lines = [f"- {k}" for k in kinds]
    if settings:
        lines.append(
            f"- settings: {settings.get('epochs')} epochs for every run, Adam lr {settings.get('adam_lr')},"
            f" SGD lr {settings.get('sgd_lr')}, seeds {settings.get('seeds')}, {settings.get('parallel')} runs"
            f" at a time, extra recipe flags {settings.get('extra_flags') or 'none'}; data: {settings.get('data')}"
        )
    return lines


def _later_call(call: dict[str, Any]) -> str:
    """A provenance line for a call that added runs the first one did not finish (benchmark.json's
    ``later_calls``: each a later call's own summary)."""
    ran = [r for r in call.get("runs") or [] if r.get("returncode") == 0]
    wall = call.get("wall_s")
    took = f" in {wall:.0f} s" if isinstance(wall, int | float) else ""
    return (
        f"- a later call ({call.get('timestamp')}) added {len(ran)} runs{took}:"
        f" `{call.get('command')}`{'; ' + call['note'] if call.get('note') else ''}"
    )


def render_markdown(results: list[dict], summary: dict[str, Any], figure: str | None) -> str:
    settings = summary.get("settings") or {}
    wall = summary.get("wall_s")
    out = [
        "# Convergence: every rung against the fp32 baseline, on real data",
        "",
        "Generated by `python -m fabric_memory_recipes.tools.convergence --report` from the JSON files beside it — do not edit by"
        " hand. Every run trains on scikit-learn's digits (real 8×8 images, fixed stratified splits) from"
        " the same initial weights per seed and for the same number of epochs; accuracy is over the whole"
        f" held-out test split. The model is `{settings.get('model', MODEL)}`, a small torchvision"
        " VisionTransformer (the memory and speed ladder is ViT-L/16: from random init it needs over 1,000"
        " steps on digits, too long for 13 rungs × 3 seeds in one GPU command).",
        "",
        "Produced on:",
        "",
        *_provenance(results, settings),
        *(
            [
                f"- {'the first call' if summary.get('later_calls') else 'the whole benchmark'} took {wall:.0f} s (wall)"
            ]
            if isinstance(wall, int | float)
            else []
        ),
        *[_later_call(call) for call in summary.get("later_calls") or []],
        "",
        "## Test accuracy per rung",
        "",
        "A rung is flagged when its mean is outside the baseline's mean ± 2 sd; the flag lists what the rung"
        " measurably does differently (the candidate causes).",
        "",
        render_table(results),
        "",
        TABLE_NOTE,
    ]
    fixes = render_fixes(results)
    if fixes:
        out += [
            "",
            "## bf16 weights: plain rounding, stochastic rounding, Kahan summation, fp32 master weights",
            "",
            "Lost updates: per sampled step, the fraction of parameters whose update would move them in"
            " fp32 but whose effective weight did not move (fabric_memory_recipes/training/bf16.py; stochastic rounding leaves many"
            " unchanged by design). Memory: ViT-L/16, 10 steps on synthetic data, rung defaults, when measured on a GPU.",
            "",
            fixes,
        ]
    if figure:
        out += ["", "## Loss curves", "", f"![loss curves]({figure})"]
    return "\n".join(out) + "\n"


def render_figure(results: list[dict], path: Path) -> None:
    """One panel per rung/variant: its training-loss curves (one per seed) over the baseline's (grey),
    against epochs (samples seen / training-set size), so rungs with different batches line up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc, _ = groups(results)
    n_train = None

    def curve(r: dict) -> tuple[list[float], list[float]]:
        nonlocal n_train
        points = (r.get("loss") or {}).get("curve") or []
        batch = (r.get("config") or {}).get("batch_size") or 1
        epochs = (r.get("config") or {}).get("epochs") or 1
        seen = (r.get("timing") or {}).get("images_seen") or 0
        per_epoch = seen / epochs if seen else None
        xs = [s * batch / per_epoch if per_epoch else s for s, _ in points]
        return xs, [v for _, v in points]

    keys = sorted(acc)
    cols = 4
    rows = max(1, math.ceil(len(keys) / cols))
    fig, axes = plt.subplots(
        rows, cols, figsize=(4 * cols, 2.8 * rows), sharex=True, sharey=True, squeeze=False
    )
    base = acc.get((BASELINE, "default"), [])
    for ax, key in zip(axes.flat, keys, strict=False):
        for r in base:
            ax.plot(*curve(r), color="#999999", lw=1)
        if key != (BASELINE, "default"):
            for r in acc[key]:
                ax.plot(*curve(r), color="#d62728", lw=1)
        ax.set_title(f"{key[0]}" + ("" if key[1] == "default" else f" [{key[1]}]"), fontsize=8)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(keys) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("epochs (samples seen / training split)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("training loss", fontsize=8)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="#999999", lw=1), Line2D([], [], color="#d62728", lw=1)]
    fig.legend(handles, ["01 fp32 baseline", "the rung / variant"], loc="upper right", fontsize=8)
    fig.suptitle("Training loss per rung (one line per seed) against the fp32 baseline", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
    plt.close(fig)


def render(out: Path, readme: str | None = None) -> int:
    """Render OUT/README.md and OUT/loss_curves.png from OUT/runs/*.json (and OUT/benchmark.json)."""
    out = Path(out)
    results = load_results(out / "runs")
    if not results:
        print(f"[convergence] no results JSON in {out / 'runs'}", file=sys.stderr)
        return 2
    summary_path = out / "benchmark.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    render_figure(results, out / "loss_curves.png")
    write_atomic(out / "README.md", lambda f: f.write(render_markdown(results, summary, "loss_curves.png")))
    print(f"[convergence] report: {out / 'README.md'}, {out / 'loss_curves.png'}")
    if readme:  # the table and the figure, into a marked block of another markdown file
        figure = os.path.relpath(out / "loss_curves.png", Path(readme.rpartition(":")[0]).resolve().parent)
        content = f"{render_table(results)}\n\n{TABLE_NOTE}\n\n![loss curves]({figure})"
        return write_into_block(readme, content, "convergence table and figure")
    return 0


# ------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = Parser(prog="python -m fabric_memory_recipes.tools.convergence", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out",
        default="runs/convergence",
        type=output_folder("--out"),
        help="results folder (runs/, report)",
    )
    p.add_argument("--logs", help="log folder (default: OUT/logs)")
    p.add_argument(
        "--report",
        metavar="DIR",
        type=output_folder("--report"),
        help="only render DIR's report, run nothing",
    )
    p.add_argument("--readme", metavar="PATH:BLOCK", help="also write the table into a marked README block")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--seed-list", help="comma-separated seeds instead of --seeds")
    p.add_argument(
        "--rungs", help="comma-separated recipe names or prefixes (default: every single-GPU rung)"
    )
    p.add_argument("--model", default=MODEL)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--adam-lr", type=float, default=ADAM_LR, help="learning rate of the Adam rungs")
    p.add_argument("--sgd-lr", type=float, default=SGD_LR, help="learning rate of the SGD rungs")
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="digits runs at once (they share the GPU; +3 ViT-L/16 memory runs)",
    )
    p.add_argument("--deadline-s", type=float, help="start no run after this many seconds")
    p.add_argument(
        "--mode",
        choices=("eager", "fast"),
        default="eager",
        help="the recipes' --mode (default eager; fast cannot measure lost updates: the tool then skips them)",
    )
    p.add_argument("--no-variants", dest="variants", action="store_false", help="skip the bf16 fix variants")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the ViT-L/16 memory runs")
    args = p.parse_args(argv)
    args.extra = extra
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

"""The convergence benchmark's runs, planned (see :mod:`fabric_memory_recipes.tools.convergence.benchmark`):
one :class:`Job` per rung, bf16 variant and seed, with the recipe flags of its policy
(``policy.rung_policy``), its lost-update sampling and its bf16 update rule, the ViT-L/16 memory runs on a
GPU, and whether an earlier call already finished a run (``finished``).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.tools.convergence.policy import (
    CURVE_POINTS,
    LOST_POINTS,
    LOST_RUNGS,
    MEMORY_FLAGS,
    MEMORY_RUNS,
    VARIANTS,
    rung_policy,
)
from fabric_memory_recipes.training.data import digits

REPO = Path(__file__).resolve().parents[3]  # the checkout


@dataclass
class Job:
    recipe: str
    variant: str
    seed: int | None  # None: a memory run
    args: list[str]
    micro_batches: int = 0  # planned forward+backward passes (x3 without CUDA graphs): longest start first
    rule: str = "plain"  # the --bf16-update it runs with (a finished run with another rule is run again)
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
    the CPU) is left out: its update is an ordinary Adam step on fp32 masters (tests/training/techniques/test_weights_offload.py), at
    the pace of a CPU Adam step, too slow for a benchmark of thousands of steps; --rungs can still ask."""
    names = sorted(p.stem for p in (REPO / "recipes").glob("[0-9][0-9]_*.py"))
    return [n for n in names if declared_rung(n)[0].devices == 1 and not declared_rung(n)[0].weights_offload]


def optimizer_kind(recipe: str) -> str:
    """'adam' or 'sgd', from the recipe's declared rung (the optimizer its code builds)."""
    name = declared_rung(recipe)[0].optimizer
    return "sgd" if name.startswith("sgd") else "adam"


def plan(args: argparse.Namespace, cuda: bool) -> list[Job]:
    args.mode = args.mode or ("fast" if cuda else "eager")  # the recipes' own default
    n_train = len(digits.split_indices(digits.raw()[1])[0])
    rungs = args.rungs or single_gpu_rungs()
    jobs: list[Job] = []
    for seed in args.seed_list:
        for recipe in rungs:
            rung, _ = declared_rung(recipe)
            per_epoch = n_train // rung.micro_batch_size
            steps_per_epoch = math.ceil(per_epoch / rung.accumulation_steps)
            # the preset (or its flags), or the rung's own policy where one was tuned (policy.TUNED)
            policy = rung_policy(args.model, recipe, optimizer_kind(recipe), vars(args), args.tuned)
            epochs = int(policy["epochs"])
            steps = steps_per_epoch * epochs
            base = [  # flag and value pairs, as a command line reads
                "--data", "digits", "--model", args.model, "--weights", "none", "--seed", str(seed),
                "--epochs", str(epochs), "--lr", str(policy["lr"]),
                "--warmup-steps", str(round(policy["warmup_epochs"] * steps_per_epoch)),
                "--log-every", str(max(1, steps // CURVE_POINTS)), "--mode", args.mode,
            ]  # fmt: skip
            if args.image_size:
                base += ["--image-size", str(args.image_size)]
            measure = args.mode == "eager" or not cuda or (recipe in LOST_RUNGS and seed in args.lost_seeds)
            if measure:  # --lost-updates reads the weights between steps: no CUDA graphs
                base += ["--lost-updates", str(max(1, steps // LOST_POINTS))]
                base += ["--no-cuda-graphs"] if cuda and args.mode == "fast" else []
            if not cuda and rung.precision == "16-mixed":
                base += ["--precision", "bf16-mixed"]  # fp16 autocast needs CUDA
            variants = [("default", [], None)]
            if recipe in args.variants:
                variants += VARIANTS.get(recipe, [])
            for variant, flags, cpu_flags in variants:
                flags = cpu_flags if (cpu_flags is not None and not cuda) else flags
                slower = 3 if "--no-cuda-graphs" in base or "kahan" in flags else 1  # launched from the host
                rule = (
                    flags[flags.index("--bf16-update") + 1] if "--bf16-update" in flags else rung.bf16_update
                )
                rule = rule if "--precision" not in flags else "plain"  # another precision: nothing to round
                jobs.append(Job(recipe, variant, seed, [*base, *flags], per_epoch * epochs * slower, rule))
    if cuda and args.memory:
        for recipe, variant, flags in MEMORY_RUNS:
            if args.rungs and recipe not in args.rungs:
                continue
            memory_flags = [*MEMORY_FLAGS, "--mode", args.mode, *flags]
            rule = flags[-1] if "--bf16-update" in flags else declared_rung(recipe)[0].bf16_update
            jobs.append(
                Job(recipe, variant, None, memory_flags, 10**9, "plain" if "--precision" in flags else rule)
            )
    return jobs


POLICY_FLAGS = {"--lr": "lr", "--warmup-steps": "warmup_steps", "--epochs": "epochs"}


def finished(job: Job, out: Path) -> bool:
    """Whether an earlier call left this run's results JSON with status ok, the job's bf16 update rule and
    its learning rate, warm-up and epochs (it is not run again; a run of the rung from before its default
    or its policy changed is)."""
    path = out / "runs" / f"{job.recipe}-{job.tag}.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    cfg = d.get("config") or {}
    same = all(
        float(job.args[job.args.index(flag) + 1]) == float(cfg[key])
        for flag, key in POLICY_FLAGS.items()
        if flag in job.args and cfg.get(key) is not None
    )
    return same and d.get("status") == "ok" and ((d.get("updates") or {}).get("rule") or "plain") == job.rule

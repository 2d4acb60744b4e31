"""A sweep's grid: its settings of learning rate, warm-up and epochs, and the runs of each.

A ``--grid`` of ``sweep.py`` (``"06,10 lr=0.03,0.06 warmup=2,6 epochs=30"``) names rungs of one optimizer and
lists of values; what it leaves out is the preset's (``policy.PRESETS``). Each setting's runs are the benchmark's
own jobs (``run_plan.plan``: fast mode, no variants, no lost-update measurement), named by the setting; today's
setting may be read from the committed benchmark's runs instead (:func:`reference_runs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from fabric_memory_recipes.tools.convergence import benchmark, run_plan
from fabric_memory_recipes.tools.convergence.policy import PRESETS

VALUES = {"lr": float, "warmup": float, "epochs": int}  # a grid's keys and their types


@dataclass(frozen=True)
class Setting:
    lr: float
    warmup: float  # epochs of linear warm-up
    epochs: int

    @property
    def name(self) -> str:
        """The runs' variant: ``lr0.06-w6-e30`` (a plain name, as --tag needs)."""
        return f"lr{self.lr:g}-w{self.warmup:g}-e{self.epochs}"


@dataclass
class Grid:
    spec: str
    rungs: list[str]
    kind: str  # "sgd" or "adam": the optimizer whose learning rate the grid sets
    settings: list[Setting]
    today: Setting  # the preset's


def parse_grid(spec: str, model: str) -> Grid:
    """``"06,10 lr=0.03,0.06 warmup=2,6 epochs=30"`` -> a Grid (ValueError with the reason)."""
    words = spec.split()
    known = run_plan.single_gpu_rungs()
    wanted = [w for w in (words[0] if words else "").split(",") if w]
    rungs = [n for n in known if any(n.startswith(w) for w in wanted)]
    if not rungs:
        raise ValueError(f"{spec!r}: its first word names no rung of {', '.join(known)}")
    kinds = {run_plan.optimizer_kind(r) for r in rungs}
    if len(kinds) > 1:
        raise ValueError(f"{spec!r}: Adam and SGD rungs in one grid (its learning rates are for one of them)")
    kind, preset = kinds.pop(), PRESETS[model]
    today = Setting(preset[f"{kind}_lr"], preset["warmup_epochs"], preset["epochs"])
    values: dict[str, list] = {"lr": [today.lr], "warmup": [today.warmup], "epochs": [today.epochs]}
    for word in words[1:]:
        key, _, listed = word.partition("=")
        if key not in VALUES:
            raise ValueError(f"{spec!r}: {word!r} is not lr=, warmup= or epochs= with comma-separated values")
        try:
            values[key] = [VALUES[key](v) for v in listed.split(",") if v]
        except ValueError:
            raise ValueError(f"{spec!r}: {word!r} holds a value that is not a number of its kind") from None
        if not values[key] or min(values[key]) < 0 or (key != "warmup" and min(values[key]) == 0):
            raise ValueError(f"{spec!r}: {word!r} needs values above 0 (warm-up: 0 or more)")
    grid = [Setting(lr, w, e) for e in values["epochs"] for w in values["warmup"] for lr in values["lr"]]
    return Grid(spec, rungs, kind, list(dict.fromkeys(grid)), today)


def merged(grids: list[Grid]) -> list[Grid]:
    """Grids of the same rungs as one (one table, one pick): ``--grid "15 lr=1e-4,2e-4" --grid "15 epochs=90"``."""
    out: dict[tuple[str, ...], Grid] = {}
    for g in grids:
        key, m = tuple(g.rungs), out.get(tuple(g.rungs))
        if m is None:
            out[key] = g
        else:
            settings = list(dict.fromkeys([*m.settings, *g.settings]))
            out[key] = dataclasses.replace(m, spec=f"{m.spec} | {g.spec}", settings=settings)
    return list(out.values())


def setting_jobs(grid: Grid, setting: Setting, args: argparse.Namespace, cuda: bool) -> list[run_plan.Job]:
    """The benchmark's own jobs for one setting of a grid, named by the setting (its variant)."""
    argv = [  # flag and value pairs, as a command line reads
        "--model", args.model, "--rungs", ",".join(grid.rungs),
        "--seed-list", ",".join(map(str, args.seed_list)), f"--{grid.kind}-lr", str(setting.lr),
        "--warmup-epochs", str(setting.warmup), "--epochs", str(setting.epochs),
        "--no-variants", "--no-memory", "--lost-seeds", "", "--no-tuned",
        *(["--mode", args.mode] if args.mode else []), "--", *args.extra,
    ]  # fmt: skip
    jobs = run_plan.plan(benchmark.parse_args(argv), cuda)
    return [dataclasses.replace(j, variant=setting.name) for j in jobs]


def reference_runs(job: run_plan.Job, reference: Path | None, model: str) -> list[dict]:
    """The committed benchmark's finished runs of this job's rung at the same policy (every seed)."""
    found = []
    for path in sorted((reference / "runs").glob(f"{job.recipe}-default-s*.json")) if reference else []:
        same = dataclasses.replace(job, variant="default", seed=int(path.stem.rpartition("-s")[2]))
        d = json.loads(path.read_text()) if run_plan.finished(same, reference) else {}
        if (d.get("config") or {}).get("model") == model:
            found.append(d)
    return found

"""What the planners read from the checkout, shipped inside the package so that an installed wheel plans too.

The planners calibrate on committed runs (``results/``), read the rungs the recipes declare (``recipes/``)
and quote the accuracy the convergence benchmark measured for a change of precision or optimizer. A
wheel has none of those folders, so their distilled content is package data (``fabric_memory_recipes/data/``):

* ``planner_runs.json``: every run :func:`~fabric_memory_recipes.planning.planner.calibration.load_runs` reads
  from ``results/``, as the planner reads it;
* ``rungs.json``: the literal ``RUNG = ...`` keywords of every numbered recipe (:func:`declarations.declared_rung`);
* ``accuracy.json``: the convergence benchmark's mean test accuracy per rung and variant
  (``results/published/<gpu>/convergence/runs/``), which :mod:`~fabric_memory_recipes.planning.planner.advice` turns
  into the cost of each change.

In a checkout the folders themselves are read and these files are not used; a test checks that they equal
what the folders give, so they cannot go stale:

    python -m fabric_memory_recipes.planning.planner.snapshot --write     # after new committed runs
    python -m fabric_memory_recipes.planning.planner.snapshot --check     # exit 1 when stale
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
from pathlib import Path
from typing import Any

from fabric_memory_recipes.config import DATA_DIR, RECIPES_DIR
from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.declarations import recipe_literals
from fabric_memory_recipes.measurement.results_file import write_json_atomic
from fabric_memory_recipes.planning.planner import calibration

CONVERGENCE_GLOB = "published/*/convergence/runs/*.json"
TAG = re.compile(r"^(?P<variant>.+)-s(?P<seed>\d+)$")


def runs_payload(results: Path = calibration.RESULTS_DIR) -> list[dict[str, Any]]:
    return [dataclasses.asdict(r) for r in calibration.load_runs((str(results),))]


def rungs_payload(folder: Path = RECIPES_DIR) -> dict[str, Any]:
    return {p.stem: recipe_literals(p) for p in sorted(folder.glob("[0-9][0-9]_*.py"))}


def accuracy_payload(results: Path = calibration.RESULTS_DIR) -> dict[str, Any]:
    """{gpu: {"recipe/variant": {"test": [accuracies of the finished seeds], "precision", "optimizer",
    "batch_size"}}} from the benchmark's run files."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(results.glob(CONVERGENCE_GLOB)):
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        match = TAG.match(str(d.get("tag") or ""))
        test = (d.get("accuracy") or {}).get("test")
        if not match or d.get("status") != "ok" or not isinstance(test, int | float):
            continue
        gpu = path.relative_to(results).parts[1]
        cfg = d.get("config") or {}
        row = out.setdefault(gpu, {}).setdefault(
            f"{d['recipe']}/{match['variant']}",
            {
                "test": [],
                "precision": cfg.get("precision"),
                "batch_size": cfg.get("batch_size"),
                "optimizer": (d.get("updates") or {}).get("optimizer"),
            },
        )
        row["test"].append(round(float(test), 6))
    for rows in out.values():
        for row in rows.values():
            row["mean"] = round(statistics.fmean(row["test"]), 6)
    return out


FILES = {"planner_runs.json": runs_payload, "rungs.json": rungs_payload, "accuracy.json": accuracy_payload}


def load(name: str) -> Any:
    """A shipped file's content (``None`` if the package has none)."""
    try:
        return json.loads((DATA_DIR / name).read_text())
    except (OSError, ValueError):
        return None


def stale() -> list[str]:
    """The shipped files that differ from what the checkout's folders give."""
    return [name for name, make in FILES.items() if load(name) != json.loads(json.dumps(make()))]


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="python -m fabric_memory_recipes.planning.planner.snapshot", description=__doc__.splitlines()[0]
    )
    p.add_argument("--write", action="store_true", help=f"write {', '.join(FILES)} into {DATA_DIR}")
    p.add_argument("--check", action="store_true", help="exit 1 if a shipped file is stale")
    args = p.parse_args(argv)
    if args.write:
        for name, make in FILES.items():
            write_json_atomic(str(DATA_DIR / name), make())
            print(f"-> {DATA_DIR / name}")
        return 0
    old = stale()
    print("stale: " + ", ".join(old) if old else "the shipped planner data match the checkout")
    return 1 if old and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How far measured peak reserved memory sits above the allocator replay's (planning/simulation/allocator.py), on
the committed runs: where :data:`~fabric_memory_recipes.planning.simulation.allocator.RESIDUAL`, the margin that
the planners budget over the replay (planning/overhead.py: ``replayed_card``, for the ladder's ``--fit`` and
``--recipe`` and for your own model), comes from. The replay itself is the prediction that ``--check`` compares.

The replay models the caching allocator's segments, best fit, splitting and merging on the tensors
the simulation creates. What it cannot see are allocations no tensor of the simulation stands for:
library workspaces taken from the allocator per call (cuDNN's convolution and attention workspaces,
visible in the committed allocator trace, results/published/h100/snapshot/), kernels whose CUDA
implementation allocates more than their CPU counterpart, and the order of frees across autograd's
device thread. The margin is the largest measured/replayed ratio of the committed single-GPU eager runs
that :func:`~fabric_memory_recipes.planning.planner.calibration.load_runs` reads (the ViT-L/16 ladder):

    python -m fabric_memory_recipes.planning.reserved      # replays every run, prints the ratios

The replays are kept in the planner's cache of simulated steps (``FMR_PLAN_CACHE``), as ``--check`` keeps its own.

Runs under ``results/published/<gpu>/wip/`` (the first proof of your own model among them) do not set
it: they are what it is checked against.
"""

from __future__ import annotations

import json
from typing import Any

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.planning.check import replayed_of
from fabric_memory_recipes.planning.planner import calibration
from fabric_memory_recipes.planning.simulation.allocator import RESIDUAL
from fabric_memory_recipes.planning.simulation.cache import SimulationCache


def replayed(run: calibration.Measured, cache: SimulationCache) -> float:
    """The replayed peak reserved (GB) of one committed run's configuration (from ``cache`` when it holds it)."""
    got = replayed_of(json.loads((calibration.RESULTS_DIR / run.path).read_text()), cache)
    if got is None:
        raise RuntimeError(f"the simulation of {run.path} failed")
    return got


def residuals(
    runs: tuple[calibration.Measured, ...] | None = None, cache: SimulationCache | None = None
) -> list[dict[str, Any]]:
    """measured / replayed peak reserved of every committed eager run (one simulation per distinct config,
    kept in ``cache``, by default the planner's file)."""
    runs = runs if runs is not None else calibration.load_runs((str(calibration.RESULTS_DIR),))
    cache = cache or SimulationCache()
    seen: dict[tuple, float] = {}
    rows = []
    for run in runs:
        if run.mode != "eager" or run.path in calibration.SUPERSEDED_MEMORY:
            continue
        key = (run.recipe, run.model, run.precision, run.batch_size, run.accumulation_steps)
        if key not in seen:
            seen[key] = replayed(run, cache)
        rows.append(
            {
                "path": run.path,
                "measured_gb": run.reserved_gb,
                "replayed_gb": seen[key],
                "ratio": run.reserved_gb / seen[key],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    Parser(
        prog="python -m fabric_memory_recipes.planning.reserved",
        description="measured / replayed peak reserved of every committed single-GPU eager run, and the"
        " margin in use (RESIDUAL)",
    ).parse_args(argv)  # no flags: --help answers at once (the replays take minutes on a CPU)
    rows = residuals()
    for r in sorted(rows, key=lambda r: r["ratio"]):
        print(
            f"{r['ratio']:.4f}  measured {r['measured_gb']:.3f}  replayed {r['replayed_gb']:.3f}  {r['path']}"
        )
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"largest: {worst['ratio']:.4f} ({worst['path']}); in use: {RESIDUAL}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

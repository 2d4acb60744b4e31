"""Where a ladder's time goes: ``python -m fabric_memory_recipes.measurement.time_breakdown DIR WALLS``.

``./run_all.sh`` writes each recipe's process time (``WALLS``: lines of ``<run name> <seconds>``) and calls
this at the end; each recipe's results JSON in ``DIR`` says how much of it was the recipe's own phases. A
row: the process's seconds; of them waiting for the GPU (``--jobs``: another recipe was training), building
the model (``memory.phases.model_load``), the memory estimate's simulation, the training loop, split into
its warm-up (compilation, CUDA-graph capture, the first steps) and the timed steps (median step x steps
after warm-up), evaluation, and the rest: starting Python, importing torch and Lightning, starting CUDA,
loading the data, writing the results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("process", "gpu wait", "model", "estimate", "warm-up", "steps", "eval", "rest")


def row(payload: dict, process_s: float) -> dict[str, float]:
    """The seconds of one recipe's process, by part (see the module docstring)."""
    phases = (payload.get("memory") or {}).get("phases") or {}
    timing, extra = payload.get("timing") or {}, payload.get("extra") or {}
    wall = {name: float((p or {}).get("wall_s") or 0.0) for name, p in phases.items()}
    model = sum(v for k, v in wall.items() if k not in ("train", "eval"))  # rung 07 builds twice
    timed_steps = max(0, int(timing.get("optimizer_steps") or 0) - int(timing.get("warmup_steps") or 0))
    steps = float(timing.get("median_step_s") or 0.0) * timed_steps
    train = wall.get("train", 0.0)
    parts = {
        "process": process_s,
        "gpu wait": float(extra.get("gpu_lock_wait_s") or 0.0),
        "model": model,
        "estimate": float((payload.get("estimate") or {}).get("seconds") or 0.0),
        "warm-up": max(0.0, train - steps),
        "steps": min(steps, train) if train else steps,
        "eval": wall.get("eval", 0.0),
    }
    parts["rest"] = process_s - sum(v for k, v in parts.items() if k != "process")
    return parts


def table(results_dir: Path, walls: list[tuple[str, float]]) -> list[str]:
    lines = [f"  {'recipe':<30}" + "".join(f"{c:>10}" for c in COLUMNS)]
    totals = dict.fromkeys(COLUMNS, 0.0)
    for name, seconds in walls:
        path = results_dir / f"{name}.json"
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError):
            lines.append(f"  {name:<30}{seconds:>10.0f}   (no results JSON)")
            totals["process"] += seconds
            continue
        parts = row(payload, seconds)
        for k, v in parts.items():
            totals[k] += v
        lines.append(f"  {name:<30}" + "".join(f"{parts[c]:>10.1f}" for c in COLUMNS))
    lines.append(f"  {'sum':<30}" + "".join(f"{totals[c]:>10.1f}" for c in COLUMNS))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m fabric_memory_recipes.measurement.time_breakdown DIR WALLS", file=sys.stderr)
        return 2
    try:
        walls = [
            (n, float(s)) for n, s in (ln.split() for ln in Path(args[1]).read_text().splitlines() if ln)
        ]
    except (OSError, ValueError) as e:
        print(f"time_breakdown: {args[1]}: {e}", file=sys.stderr)
        return 2
    print(
        "Where the time went (seconds per recipe process; the parts: fabric_memory_recipes/measurement/time_breakdown.py):"
    )
    print("\n".join(table(Path(args[0]), walls)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

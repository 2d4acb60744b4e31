"""The step-time ceilings fitted without some committed runs, and those runs predicted: how a change to the
step-time model does on runs its fit has not seen, on the CPU, without new GPU runs.

The stored table (``fabric_memory_recipes/data/step_time.json``) is fitted on every run its kind's globs name
(planning/your_model/step_calibration.py), models once checked out of sample included. This tool leaves the runs
whose path holds ``--without`` out of the fit (every ceiling but B_host, as the calibration fits them), predicts
them with the ceilings the others give, and prints both sides' errors:

    python -m devtools.speed.held_out_fit --gpu h200 --without held-out

Each configuration is simulated once on the CPU (minutes: the calibration's own simulations).
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from fabric_memory_recipes.console import Parser, fail
from fabric_memory_recipes.planning.your_model import step_calibration, step_time


def held_out_fit(pts: list[step_calibration.Point], without: str, gpu: str | None = None) -> dict[str, Any]:
    """Fit on the points whose runs' paths all lack ``without`` (within ``gpu``'s datasheet, as the calibration
    fits); predict the others (offload runs and runs the calibration does not fit left out of both: B_host is
    fitted apart)."""
    core = [p for p in pts if not p.first.offload and not p.first.not_fitted]
    left = [p for p in core if any(without in r.path for r in p.runs)]
    kept = [p for p in core if p not in left]
    if not left or not kept:
        raise ValueError(
            f"--without {without!r} leaves {len(kept)} configurations to fit, {len(left)} to predict"
        )
    fields = [f for f in step_calibration.FIELDS if f not in step_calibration.OFFLOAD_FIELDS]
    c = step_calibration.fit(kept, fields, step_calibration.start_of(gpu), step_calibration.upper_of(gpu))

    def rows(sel: list[step_calibration.Point]) -> list[dict[str, Any]]:
        return [
            {"configuration": p.first.group, "error": round(step_calibration._error(p, c), 4)} for p in sel
        ]

    fitted, predicted = rows(kept), rows(left)
    return {
        "without": without,
        "ceilings": c.to_dict(),
        "fitted": fitted,
        "predicted": predicted,
        "summary": {name: _summary(r) for name, r in (("fitted", fitted), ("predicted", predicted))},
    }


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(r["error"]) for r in rows]
    return {
        "configurations": len(errors),
        "median_abs_error": round(statistics.median(errors), 4),
        "max_abs_error": round(max(errors), 4),
        "within_25_percent": sum(e <= 0.25 for e in errors),
    }


def lines(result: dict[str, Any]) -> list[str]:
    out = [
        f"{'error':>7}  configuration left out of the fit (error: predicted samples/s over measured, less 1)"
    ]
    out += [f"{r['error']:>+7.0%}  {r['configuration']}" for r in result["predicted"]]
    for name, s in result["summary"].items():
        out.append(
            f"{name}: {s['configurations']} configurations, median |error| {s['median_abs_error']:.0%},"
            f" max {s['max_abs_error']:.0%}, within 25 %: {s['within_25_percent']}"
        )
    shown = step_time.Ceilings(**result["ceilings"]).shown()
    out.append("ceilings: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h200", choices=sorted(step_calibration.RUN_GLOBS), help="the kind")
    parser.add_argument(
        "--without", required=True, help="leave out of the fit the runs whose path holds this text"
    )
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    runs = step_calibration.read_runs(args.gpu)
    if not any(args.without in r.path for r in runs):
        fail(f"no committed {args.gpu} run's path holds {args.without!r}")
    try:
        result = held_out_fit(step_calibration.points(runs), args.without, args.gpu)
    except ValueError as e:
        fail(str(e))
    print("\n".join(lines(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

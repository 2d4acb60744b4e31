"""Two versions of the code over the single-GPU ladder, in one call: do the numbers move?

    python -m devtools.ab_ladder --base build/ab-base --new . --out OUT -- --data synthetic --weights none \\
        --max-steps 20 --eval-batches 1

``--base`` and ``--new`` are checkouts (the package and ``recipes/`` of each; an older one may still call its package ``common/``). Every single-GPU rung
(01-07, 10-15) runs in each, one process at a time, with the same flags plus ``--mode MODE``, in the
order base, new for one rung and new, base for the next (so that drift over the call favours neither).
Each run gets its own checkout first on ``PYTHONPATH`` and writes ``OUT/<side>/<mode>/``. Then
``OUT/ab.md`` and ``OUT/ab.json`` compare, per rung and mode, the train-phase peak memory (reserved and
allocated) and the throughput: within ``--memory-tolerance`` (default 3 %) and ``--speed-tolerance``
(default 5 %) is a pass. ``--budget`` seconds: no new pair is started after it (the table says which
rungs were not reached), and each run is killed after ``--timeout`` seconds or when the budget is
spent; the table is written after every pair, so the call ends inside the device's time limit with
what it measured.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.paths import output_folder
from fabric_memory_recipes.processes import Run, execute, project_env
from fabric_memory_recipes.tools.compare.plan import MODES, SINGLE_GPU_RUNGS

Runner = Callable[[Run, dict, float], dict]  # processes.execute, or a test's stand-in


def script(checkout: Path, rung: str) -> Path:
    return sorted((checkout / "recipes").glob(f"{rung}_*.py"), key=lambda p: len(p.name))[0]


def run(
    checkout: Path,
    rung: str,
    mode: str,
    flags: list[str],
    out: Path,
    timeout: float,
    runner: Runner = execute,
) -> dict:
    """One recipe run in its own process group, killed after ``timeout`` seconds (fabric_memory_recipes.processes's
    ``execute``); returns its results JSON, or what is known when it wrote none."""
    path = script(checkout, rung)
    results = out / mode
    # the caller's PYTHONPATH stays after the checkout: a GPU call that replaced it lost torchao (rung 13)
    env = project_env(checkout.resolve(), FMR_OFFLINE="1", FMR_LOG_DIR=str(out / "logs"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    found = results / f"{path.stem}.json"
    cmd = [sys.executable, str(path.resolve()), *flags, "--mode", mode, "--results-dir", str(results)]
    proc = runner(
        Run("project", rung, mode, cmd, found, out / "logs" / f"{path.stem}-{mode}.log"), env, timeout
    )
    payload = json.loads(found.read_text()) if found.exists() else {"status": proc["status"]}
    payload["_seconds"] = proc["wall_s"]
    return payload


def numbers(payload: dict) -> dict:
    memory, timing = payload.get("memory") or {}, payload.get("timing") or {}
    return {
        "status": payload.get("status"),
        "reserved_gb": memory.get("peak_reserved_gb"),
        "allocated_gb": memory.get("peak_allocated_gb"),
        "images_per_s": timing.get("images_per_s"),
        "seconds": round(payload.get("_seconds", 0.0), 1),
    }


def cell(row: dict, key: str, fmt: str) -> str:
    """'base → new (+x.x%)' of one number of a compared row."""
    x, y, q = row["base"][key], row["new"][key], row[f"{key}_ratio"]
    show = lambda v: format(v, fmt) if isinstance(v, int | float) else str(v)  # noqa: E731
    return f"{show(x)} → {show(y)}" + (f" ({100 * (q - 1):+.1f}%)" if q else "")


def ratio(new: float | None, base: float | None) -> float | None:
    return new / base if isinstance(new, int | float) and isinstance(base, int | float) and base else None


def write(out: Path, rows: list[dict]) -> list[str]:
    """OUT/ab.md and OUT/ab.json from the rows so far (after every pair: a killed call keeps them)."""
    lines = [
        "| rung | mode | reserved GB base → new | allocated GB base → new | img/s base → new | pass |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "base" not in r:
            lines.append(f"| {r['rung']} | {r['mode']} | {r['status']} | | | |")
            continue
        lines.append(
            f"| {r['rung']} | {r['mode']} | {cell(r, 'reserved_gb', '.3f')} | {cell(r, 'allocated_gb', '.3f')}"
            f" | {cell(r, 'images_per_s', '.1f')} | {'yes' if r['pass'] else 'NO'} |"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.md").write_text("\n".join(lines) + "\n")
    (out / "ab.json").write_text(json.dumps(rows, indent=2) + "\n")
    return lines


def main(argv: list[str] | None = None, runner: Runner = execute) -> int:
    p = Parser(prog="python -m devtools.ab_ladder", description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, type=Path, help="the earlier checkout")
    p.add_argument("--new", default=".", type=Path, help="the checkout under test (default: this one)")
    p.add_argument("--out", required=True, type=output_folder("--out"), help="output folder (e.g. runs/ab)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--rungs", nargs="+", default=list(SINGLE_GPU_RUNGS))
    p.add_argument("--budget", type=float, default=540.0, help="seconds after which no new pair starts")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per run before it is killed")
    p.add_argument(
        "--memory-tolerance", type=float, default=0.03, help="largest relative change of peak memory"
    )
    p.add_argument("--speed-tolerance", type=float, default=0.05, help="largest relative change of img/s")
    p.add_argument("flags", nargs="*", help="the recipes' flags (after --)")
    args = p.parse_args(argv)
    start, rows, n = time.monotonic(), [], 0
    for mode in args.modes:
        for rung in args.rungs:
            if time.monotonic() - start > args.budget:
                rows.append({"rung": rung, "mode": mode, "status": "not reached (budget)"})
                continue
            sides = [("base", args.base), ("new", args.new)]
            if n % 2:
                sides.reverse()
            n += 1
            timeout = max(1.0, min(args.timeout, args.budget - (time.monotonic() - start)))
            got = {
                side: numbers(run(path, rung, mode, args.flags, args.out / side, timeout, runner))
                for side, path in sides
            }
            b, a = got["base"], got["new"]
            row = {"rung": rung, "mode": mode, "base": b, "new": a}
            for key in ("reserved_gb", "allocated_gb", "images_per_s"):
                row[f"{key}_ratio"] = ratio(a[key], b[key])
            mem = [row["reserved_gb_ratio"], row["allocated_gb_ratio"]]
            speed = row["images_per_s_ratio"]
            row["pass"] = (
                a["status"] == b["status"] == "ok"
                and all(r is not None and abs(r - 1) <= args.memory_tolerance for r in mem)
                and speed is not None
                and abs(speed - 1) <= args.speed_tolerance
            )
            rows.append(row)
            write(args.out, rows)
            print(json.dumps(row), flush=True)
    lines = write(args.out, rows)
    print("\n".join(lines))
    compared = [r for r in rows if "base" in r]
    return 0 if compared and all(r["pass"] for r in compared) else 1


if __name__ == "__main__":
    sys.exit(main())

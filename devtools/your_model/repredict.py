"""Committed runs predicted again with this checkout's estimator, against their measured peak allocated.

``fmr-estimate --check`` compares each run with the prediction it recorded when it ran; a change to the
simulation shows in it only after the runs are made again on a GPU. This tool simulates each committed
run's step again on the CPU, from its recorded configuration (a ladder rung's as ``--check`` does for runs
without an estimate: ``planning/check.py``; your model's as the runner does: ``planning/your_model/``), and
prints the recorded and the new prediction beside the measurement. Results files inside a ``.tgz`` are read
without unpacking it. Runs two checkouts' estimators apart (``--json``) to see what a change moves:

    python -m devtools.your_model.repredict results/published/h100/ladder results/published/h100/your-model/runs \\
        results/published/h100/seq2seq-check results/published/h100/lora-check --json after.json
"""

from __future__ import annotations

import json
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.planning.check import simulate_run
from fabric_memory_recipes.planning.your_model.estimate import estimate, meta_user_model, plan_of
from fabric_memory_recipes.training.your_model import runner


def results_files(paths: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, payload) of every results JSON under ``paths``, those inside ``.tgz`` archives included."""
    for top in map(Path, paths):
        for path in sorted([top] if top.is_file() else top.rglob("*")):
            if path.suffix == ".json":
                yield str(path), json.loads(path.read_text())
            elif path.name.endswith(".tgz"):
                with tarfile.open(path) as tar:
                    for member in sorted(tar.getmembers(), key=lambda m: m.name):
                        if member.isfile() and member.name.endswith(".json"):
                            yield f"{path}:{member.name}", json.load(tar.extractfile(member))


def comparable(result: dict[str, Any]) -> bool:
    """A run of the ladder or of your model, finished, measured on one CUDA GPU, training."""
    config, memory = result.get("config") or {}, result.get("memory") or {}
    return (
        isinstance(result.get("recipe"), str)
        and result.get("status") == "ok"
        and memory.get("kind") == "cuda"
        and memory.get("peak_allocated_gb") is not None
        and (result.get("provenance") or {}).get("world_size", 1) == 1
        and not config.get("infer")
    )


def predicted_again(result: dict[str, Any]) -> float | None:
    """The peak allocated (GB) of the run's step simulated with this checkout."""
    if result["recipe"] != "your_model":
        return simulate_run(result).peak_gb
    rung = runner.default_config()
    flags = {f.name for f in type(rung).flag_fields()}
    config = result["config"]
    cfg = rung.with_flags(**{**{k: v for k, v in config.items() if k in flags}, "accelerator": "cuda"})
    um, model, blocks, _ = meta_user_model(cfg.model, cfg.lora_rank, cfg.lora_targets)
    plan = plan_of(cfg, blocks)
    return estimate(model, um, plan, cfg.seq_len, target_len=runner.target_len(cfg)).peak_gb


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m devtools.your_model.repredict", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="folders or files of committed results (.json, .tgz)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'run':<78} {'measured':>9} {'recorded':>9} {'again':>9} {'error':>7}")
    for name, result in results_files(args.paths):
        if not isinstance(result, dict) or not comparable(result):
            continue
        try:
            again = predicted_again(result)
        except Exception as e:  # a run this checkout cannot simulate: say so and go on
            print(f"{name}: not simulated ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            continue
        measured = result["memory"]["peak_allocated_gb"]
        recorded = (result.get("estimate") or {}).get("peak_allocated_gb")
        error = None if again is None else 100.0 * (again - measured) / measured
        rows.append({"run": name, "measured_gb": measured, "recorded_gb": recorded, "again_gb": again})
        cells = [f"{v:9.3f}" if v is not None else f"{'-':>9}" for v in (measured, recorded, again)]
        print(f"{name[-78:]:<78} {' '.join(cells)} {'' if error is None else f'{error:+6.1f}%'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

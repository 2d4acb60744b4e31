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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.measurement.results_file import archived, gpu_slug
from fabric_memory_recipes.planning.check import simulate_run
from fabric_memory_recipes.planning.plan import expandable_in
from fabric_memory_recipes.planning.your_model.estimate import (
    estimate,
    meta_user_model,
    plan_of,
    run_card,
)
from fabric_memory_recipes.training.your_model import runner

PEAKS = ("allocated", "reserved", "device")  # what is compared: peak allocated, peak reserved, whole device


def results_files(paths: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, payload) of every results JSON under ``paths``, those inside ``.tgz`` archives included."""
    for top in map(Path, paths):
        for path in sorted([top] if top.is_file() else top.rglob("*")):
            if path.suffix == ".json":
                yield str(path), json.loads(path.read_text())
            elif path.name.endswith(".tgz"):
                for member, payload in archived(path):
                    yield f"{path}:{member}", payload


def comparable(result: dict[str, Any]) -> bool:
    """A run of the ladder on one CUDA GPU, or of your model on one or (``--fsdp``) several, finished,
    training."""
    config, memory = result.get("config") or {}, result.get("memory") or {}
    return (
        isinstance(result.get("recipe"), str)
        and result.get("status") == "ok"
        and memory.get("kind") == "cuda"
        and memory.get("peak_allocated_gb") is not None
        and ((result.get("provenance") or {}).get("world_size", 1) == 1 or result["recipe"] == "your_model")
        and not config.get("infer")
    )


def measured(result: dict[str, Any]) -> dict[str, float | None]:
    memory = result["memory"]
    return dict(
        zip(
            PEAKS,
            (memory.get(k) for k in ("peak_allocated_gb", "peak_reserved_gb", "device_peak_gb")),
            strict=True,
        )
    )


def recorded(result: dict[str, Any]) -> dict[str, float | None]:
    """The prediction the run recorded: its estimate's peak allocated, your model's card."""
    card = (result.get("extra") or {}).get("predicted_card") or {}
    allocated = (result.get("estimate") or {}).get("peak_allocated_gb")
    return {
        "allocated": allocated,
        "reserved": card.get("peak_reserved_gb"),
        "device": card.get("device_peak_gb"),
    }


def predicted_again(result: dict[str, Any]) -> dict[str, float | None]:
    """The peaks (GB) of the run's step simulated with this checkout: allocated; your model's card too, for the
    GPU kind the run names and its processes, under the allocator setting its provenance recorded."""
    if result["recipe"] != "your_model":
        return {"allocated": simulate_run(result).peak_gb, "reserved": None, "device": None}
    rung = runner.default_config()
    flags = {f.name for f in type(rung).flag_fields()}
    config, provenance = result["config"], result.get("provenance") or {}
    cfg = rung.with_flags(**{**{k: v for k, v in config.items() if k in flags}, "accelerator": "cuda"})
    um, model, blocks, _ = meta_user_model(cfg.model, cfg.lora_rank, cfg.lora_targets)
    conf = provenance.get("cuda_alloc_conf")
    expandable = expandable_in(conf) if "cuda_alloc_conf" in provenance else None
    plan = plan_of(cfg, blocks, expandable, um)
    est = estimate(model, um, plan, cfg.seq_len, target_len=runner.target_len(cfg))
    card = run_card(est, cfg, gpu_slug(provenance.get("gpu_name") or "h100"))
    return {"allocated": est.peak_gb, "reserved": card["peak_reserved_gb"], "device": card["device_peak_gb"]}


def _cell(measured_gb: float | None, recorded_gb: float | None, again_gb: float | None) -> str:
    """'measured / recorded -> again (error recorded -> error again)'."""
    if measured_gb is None or again_gb is None:
        return "-"
    error = lambda v: "" if v is None else f"{100.0 * (v - measured_gb) / measured_gb:+.1f}%"  # noqa: E731
    was = "-" if recorded_gb is None else f"{recorded_gb:.2f}"
    return f"{measured_gb:.2f} / {was} -> {again_gb:.2f} ({error(recorded_gb) or '-'} -> {error(again_gb)})"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m devtools.your_model.repredict", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="folders or files of committed results (.json, .tgz)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = []
    print("run: GB measured / recorded -> again (error of the recorded -> of the new prediction), per GPU")
    for name, result in results_files(args.paths):
        if not isinstance(result, dict) or not comparable(result):
            continue
        try:
            again = predicted_again(result)
        except Exception as e:  # a run this checkout cannot simulate: say so and go on
            print(f"{name}: not simulated ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            continue
        row = {
            "run": name,
            "measured_gb": measured(result),
            "recorded_gb": recorded(result),
            "again_gb": again,
        }
        rows.append(row)
        cells = [
            f"{k} {_cell(*(row[c][k] for c in ('measured_gb', 'recorded_gb', 'again_gb')))}" for k in PEAKS
        ]
        print(f"{name}: {' | '.join(cells)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

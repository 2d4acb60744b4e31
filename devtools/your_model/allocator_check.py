"""Your model's committed runs against the allocator replay, under the default allocator and under the
setting each run had. Every one-GPU training run of ``recipes/your_model.py`` found (results JSONs in the
folders and ``.tgz`` archives given) is simulated again from the configuration it recorded
(planning/your_model/estimate.py) and its step replayed under each caching-allocator setting
(planning/simulation/expandable.py: ``peaks_reserved``). Printed per run: the measured peak reserved (the
whole run's), the replay under the default allocator (what the estimate predicted before it modelled
expandable segments), and the replay under the run's own setting (its ``provenance.cuda_alloc_conf`` and
whether its steps were CUDA graphs: planning/plan.py ``allocator_of``), each with its error.

    python -m devtools.your_model.allocator_check results/published/h100/your-model-speed \\
        results/published/h100/ranking-check results/published/h100/reserved-snapshots
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.planning.check import recorded_allocator
from fabric_memory_recipes.planning.your_model.estimate import (
    estimate,
    meta_user_model,
    plan_of,
)
from fabric_memory_recipes.techniques import flagged
from fabric_memory_recipes.training.your_model import runner


def results_files(paths: list[str], scratch: Path) -> list[Path]:
    """The JSON files under ``paths`` (folders, files, ``.tgz`` archives unpacked into ``scratch``)."""
    found: list[Path] = []
    for i, name in enumerate(paths):
        path = Path(name)
        if path.is_dir():
            found += sorted(path.rglob("*.json"))
            archives = sorted(path.rglob("*.tgz"))
        else:
            archives = [path] if path.suffix == ".tgz" else []
            found += [path] if path.suffix == ".json" else []
        for j, archive in enumerate(archives):
            into = scratch / f"{i}-{j}-{archive.stem}"
            with tarfile.open(archive) as tar:
                tar.extractall(into, filter="data")
            found += sorted(into.rglob("*.json"))
    return found


def training_run(result: Any) -> bool:
    """A one-GPU training run of the runner, measured on CUDA, that ended well."""
    if not isinstance(result, dict) or result.get("recipe") != "your_model" or result.get("status") != "ok":
        return False
    config, memory = result.get("config") or {}, result.get("memory") or {}
    return (
        memory.get("kind") == "cuda"
        and memory.get("run_peak_reserved_gb") is not None
        and not config.get("infer")
        and not config.get("fsdp")
        and (result.get("provenance") or {}).get("world_size", 1) == 1
    )


def config_of(result: dict[str, Any]) -> runner.YourModelConfig:
    """The runner's configuration the run recorded (its flags; the mode as it resolved it)."""
    flags = {f.name for f in dataclasses.fields(runner.YourModelConfig)} | {t.field for t in flagged()}
    recorded = {k: v for k, v in (result.get("config") or {}).items() if k in flags}
    return runner.default_config().with_flags(**recorded)


def replays(cfg: runner.YourModelConfig, memo: dict[str, Any]) -> dict[str, float]:
    """Peak reserved (GB) of the configuration's simulated step under each allocator setting; raises what
    the simulation could not do (a failed step: RuntimeError with its error)."""
    um, model, blocks, _ = meta_user_model(cfg.model, cfg.lora_rank, cfg.lora_targets)
    plan = plan_of(cfg, blocks, um=um)
    key = json.dumps([cfg.model, dataclasses.asdict(plan) | {"allocator": None}, cfg.seq_len, cfg.target_len])
    if key not in memo:
        est = estimate(model, um, plan, cfg.seq_len or 0, target_len=cfg.target_len)
        memo[key] = est.error or est.reserved_by_allocator
    if isinstance(memo[key], str):
        raise RuntimeError(memo[key])
    return memo[key]


def rows(paths: list[str]) -> list[dict[str, Any]]:
    memo: dict[str, Any] = {}
    out = []
    with tempfile.TemporaryDirectory() as scratch:
        for path in results_files(paths, Path(scratch)):
            try:
                result = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not training_run(result):
                continue
            name = str(path).split(scratch)[-1].lstrip("/")
            cfg = config_of(result)
            allocator = recorded_allocator(result, cfg)
            try:
                got = replays(cfg, memo)
            except Exception as e:  # a run this checkout cannot simulate: say so and go on (as repredict)
                why = str(e).splitlines()[0] if str(e) else ""
                print(f"{name}: not simulated ({type(e).__name__}: {why})", file=sys.stderr)
                continue
            measured = result["memory"]["run_peak_reserved_gb"]
            out.append(
                {
                    "run": name,
                    "model": cfg.model.split("/")[-1],
                    "mode": cfg.mode,
                    "allocator": allocator,
                    "measured_gb": measured,
                    "default_gb": got.get("default"),
                    "own_gb": got.get(allocator),
                    "recorded_gb": (result.get("estimate") or {}).get("peak_reserved_simulated_gb"),
                }
            )
    return out


def pct(predicted: float | None, measured: float) -> str:
    return "—" if predicted is None else f"{100 * (predicted / measured - 1):+.1f}%"


def table(found: list[dict[str, Any]]) -> str:
    lines = [
        "| run | model | mode | allocator | measured reserved GB | default replay GB | error | own replay GB | error |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in found:
        lines.append(
            f"| `{r['run']}` | {r['model']} | {r['mode']} | {r['allocator']} | {r['measured_gb']:.3f} |"
            f" {r['default_gb']:.3f} | {pct(r['default_gb'], r['measured_gb'])} | {r['own_gb']:.3f} |"
            f" {pct(r['own_gb'], r['measured_gb'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m devtools.your_model.allocator_check", description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="folders, results JSONs or .tgz archives of runs")
    p.add_argument("--json", action="store_true", help="the rows as JSON instead of a table")
    args = p.parse_args(argv)
    found = rows(args.paths)
    print(json.dumps(found, indent=1) if args.json else table(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Publish what scripts/gpu/sharded_four_gpus.sh brought back: the tar's folders under results/published/<gpu>x<N>/,
the rows into the sharded rungs' pages, the overhead table rewritten, and a summary against the targets.

    python3 scripts/gpu/publish_sharded_runs.py OUT/sharded.tgz [--dest results/published] [--docs docs]
    python3 scripts/gpu/publish_sharded_runs.py --equivalence FOLDER     # the GPU script's last part

From the tar (its folder ``sharded/``): ``x4/compare`` and ``x2/compare`` (fmr-compare's folders) go to
``<dest>/<gpu>x4/compare`` and ``<dest>/<gpu>x2/compare``, ``x<N>/your-model`` beside them, ``nodes`` and
the logs (progress.log, gpus.csv, env.txt, *.log) to ``<dest>/<gpu>x4/sharded/``. ``<gpu>`` is the
kind the runs recorded (h100, h200). Each sharded rung's page (docs/<recipe>.md) gets its row in its
``sharded-<N>gpu`` block. The card overhead table is rewritten from ``results/`` (planning/overhead.py).
Exit code: 0 done, 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from fabric_memory_recipes.console import fail
from fabric_memory_recipes.measurement.report.cells import write_into_block
from fabric_memory_recipes.measurement.report.comparison import load_comparison, render_rung_block
from fabric_memory_recipes.measurement.results_file import gpu_slug
from fabric_memory_recipes.planning import overhead
from fabric_memory_recipes.planning.check import check_results

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-3  # relative: the same steps on the same samples, reduced over another NCCL topology
TARGET_SPEED = 3.5  # the target: img/s at least 3.5x the article's, at no more peak reserved per GPU


def equivalence(folder: Path) -> dict:
    """The loss curves of one torchrun node of 4 and two of 2 (the same steps and samples), compared."""
    runs = {}
    for name in ("one-node", "two-nodes"):
        try:
            runs[name] = json.loads((folder / name / "08_fsdp2.json").read_text())
        except (OSError, ValueError) as e:
            return {"status": "missing", "error": f"{name}: {e}"}
    one, two = (dict(map(tuple, runs[n]["loss"]["curve"])) for n in ("one-node", "two-nodes"))
    steps = sorted(set(one) & set(two))
    diffs = [abs(one[s] - two[s]) / max(abs(one[s]), 1e-12) for s in steps]
    equal = bool(steps) and max(diffs) <= TOLERANCE
    return {
        "status": "equal" if equal else "different",
        "steps_compared": steps,
        "max_relative_difference": max(diffs) if diffs else None,
        "tolerance": TOLERANCE,
        "one_node": {"world_size": runs["one-node"]["provenance"]["world_size"], "loss": one},
        "two_nodes": {"num_nodes": runs["two-nodes"]["provenance"].get("num_nodes"), "loss": two},
        "images_per_s": {n: runs[n]["timing"]["images_per_s"] for n in runs},
    }


def publish(tar: Path, dest: Path, docs: Path, table_file: Path = overhead.TABLE_FILE) -> list[str]:
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(tar) as archive:
            archive.extractall(tmp, filter="data")
        root = Path(tmp) / "sharded"
        comparisons = sorted(root.glob("x*/compare/comparison.json"))
        if not comparisons:
            fail(f"{tar}: no sharded/x*/compare/comparison.json inside (not the GPU script's tar?)")
        gpu = gpu_slug(
            next((r["call"].get("gpu_name") for p in comparisons for r in load_comparison(p)), None)
        )
        for sub in sorted(p for p in root.glob("x*") if p.is_dir()):
            target = dest / f"{gpu}{sub.name}"
            for part in sub.iterdir():
                shutil.rmtree(target / part.name, ignore_errors=True)
                shutil.copytree(part, target / part.name)
        notes = dest / f"{gpu}x4" / "sharded"
        notes.mkdir(parents=True, exist_ok=True)
        for item in root.iterdir():
            if item.is_file():
                shutil.copy2(item, notes / item.name)
            elif item.name == "nodes":
                shutil.rmtree(notes / "nodes", ignore_errors=True)
                shutil.copytree(item, notes / "nodes")
    for path in sorted(dest.glob(f"{gpu}x*/compare/comparison.json")):
        n = path.parent.parent.name.rsplit("x", 1)[1]
        source = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
        for row in load_comparison(path):
            page = docs / f"{row['recipe']}.md"
            write_into_block(
                f"{page}:sharded-{n}gpu", render_rung_block(row, source), f"{row['recipe']} x{n}"
            )
            summary.append(_target_line(row, n))
    table = overhead.measure([dest.parent])
    overhead.write_json_atomic(str(table_file), table)
    for n, modes in (table.get("sharded") or {}).get(gpu, {}).items():
        for mode, e in modes.items():
            summary.append(
                f"overhead per GPU, {gpu} x{n} {mode}: {e['overhead_gb']:.2f} GB ({e['runs']} runs)"
            )
    folders = sorted(
        {
            str(p.parent)
            for p in dest.glob(f"{gpu}x*/**/*.json")
            if "runs" in p.parts or "your-model" in p.parts
        }
    )
    for row in check_results(folders):
        if row.get("world_size", 1) > 1 and row.get("device_error_pct") is not None:
            summary.append(
                f"whole device per GPU {row['file']}: predicted {row['predicted_device_gb']:.2f},"
                f" measured {row['measured_device_gb']:.2f} GB ({row['device_error_pct']:+.1f} %)"
            )
    return summary


def _target_line(row: dict, n: str) -> str:
    r = row.get("ratios") or {}
    speed, memory = r.get("speed_fast_vs_reference"), r.get("reserved_fast_vs_reference")
    if speed is None or memory is None:
        return f"{row['recipe']} x{n}: no ratio (reference {row['reference'] and row['reference'].get('status')})"
    met = speed >= TARGET_SPEED and memory <= 1.0
    return (
        f"{row['recipe']} x{n}: {speed:.2f}x the article's img/s at {memory:.2f}x its peak reserved per GPU"
        + (" (target met)" if met else f" (target: >= {TARGET_SPEED}x at <= 1.00x)")
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tar", nargs="?", help="OUT/sharded.tgz from scripts/gpu/sharded_four_gpus.sh")
    p.add_argument("--dest", default=str(REPO / "results" / "published"), help="where the folders go")
    p.add_argument("--docs", default=str(REPO / "docs"), help="the rung pages")
    p.add_argument("--table", default=str(overhead.TABLE_FILE), help="the card overhead table to rewrite")
    p.add_argument("--equivalence", metavar="FOLDER", help="compare FOLDER/one-node and FOLDER/two-nodes")
    args = p.parse_args(argv)
    if args.equivalence:
        result = equivalence(Path(args.equivalence))
        (Path(args.equivalence) / "equivalence.json").write_text(json.dumps(result, indent=2) + "\n")
        print(
            f"nodes: {result['status']}, max relative loss difference {result.get('max_relative_difference')}"
        )
        return 0
    if not args.tar or not Path(args.tar).is_file():
        fail(f"{args.tar}: no such file (the GPU script's OUT/sharded.tgz)")
    for line in publish(Path(args.tar), Path(args.dest), Path(args.docs), Path(args.table)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

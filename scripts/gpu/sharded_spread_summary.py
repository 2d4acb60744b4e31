"""Summarise what scripts/gpu/sharded_spread.sh ran, per call and pooled over calls: each sharded rung's img/s over
its runs against the article's script of the same call (median and range, per GPU count and variant), its peak
reserved per GPU against the article's, rung 09's step-time p90/p10 per run, the targets; and your model sharded,
predicted against measured per GPU (allocated, reserved, whole device).

    python3 scripts/gpu/sharded_spread_summary.py CALL                   # writes CALL/summary.md and summary.json
    python3 scripts/gpu/sharded_spread_summary.py CALL [CALL ...] --out DIR
    python3 scripts/gpu/sharded_spread_summary.py FOLDER                 # FOLDER/call*/ are the calls

A CALL folder is what one GPU call brought back: rung results JSON anywhere below it (``x4/r1/*.json``,
``compare/**/runs/*-fast.json``, ``repeats/r*/*.json``; not under ``nodes/``, ``profile/`` or ``fit/``), the
article's runs (``reference-*.json`` with their ``.rankN.json``), ``your-model/*/your_model.json`` and
``gpus.csv`` (nvidia-smi's list, which names the host's GPUs). A run's variant is its tag after the round
(``r2-compile``: compile). Exit code: 0, 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

RUNGS = {
    "08_fsdp": "reference-11_delay-allocation-no-offload",
    "08_fsdp2": "reference-11_delay-allocation-no-offload",
    "09_cpu_offload": "reference-11_delay-allocation",
}
TARGET_SPEED = {4: 3.5, 2: 3.0}  # x the article's img/s, on the median of >= 3 runs in >= 2 calls
TARGET_RESERVED = 1.00  # x the article's peak reserved per GPU
TARGET_SPREAD = 1.3  # rung 09's step time p90/p10, every run
SKIPPED = {"nodes", "profile", "fit", "your-model"}  # runs that are not speed runs of the rungs
ESTIMATE_BAND = 0.10  # your model: predicted within +-10 % of measured


def _load(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def variant_of(d: dict) -> str:
    """'' for the rung as it is (fmr-compare's 'fast' runs, round tags 'r2'); else the tag after the round."""
    tag = re.sub(r"^r\d+-?", "", d.get("tag") or "")
    tag = "" if tag == "fast" else tag
    return tag or ("eager" if (d.get("config") or {}).get("mode") == "eager" else "")


def gpus_of(folder: Path, runs: list[dict]) -> str:
    """'4 x NVIDIA H200' from the call's gpus.csv, else from its runs."""
    try:
        names = [
            line.split(",")[1].strip()
            for line in (folder / "gpus.csv").read_text().splitlines()[1:]
            if "," in line
        ]
    except OSError:
        names = []
    if names:
        return ", ".join(f"{n} x {name}" for name, n in Counter(names).items())
    seen = {(r["gpu"], r["world_size"]) for r in runs if r.get("gpu")}
    return ", ".join(f"{n} x {g}" for g, n in sorted(seen, key=str)) or "unknown"


def rung_runs(folder: Path) -> list[dict]:
    """Every ok run of a sharded rung below ``folder`` (rank 0's results JSON), sorted by path."""
    runs = []
    for path in sorted(folder.rglob("*.json")):
        rel = path.relative_to(folder)
        if SKIPPED & set(rel.parts[:-1]):
            continue
        d = _load(path)
        if not d or d.get("recipe") not in RUNGS or d.get("status") != "ok" or "timing" not in d:
            continue
        t, m, prov = d["timing"], d.get("memory") or {}, d.get("provenance") or {}
        steady = (t.get("intervals_s") or [])[t.get("warmup_steps", 0) :]
        step_s = t.get("step_s") or {}
        p10 = quantile(steady, 0.1) if steady else step_s.get("p10")
        p90 = quantile(steady, 0.9) if steady else step_s.get("p90")
        runs.append(
            {
                "file": str(rel),
                "recipe": d["recipe"],
                "variant": variant_of(d),
                "world_size": prov.get("world_size"),
                "gpu": prov.get("gpu_name"),
                "images_per_s": t["images_per_s"],
                "median_step_s": t.get("median_step_s"),
                "p90_over_p10": p90 / p10 if p10 and p90 else None,
                "peak_reserved_gb": m.get("peak_reserved_gb"),
                "device_overhead_gb": m.get("device_overhead_gb"),
                "steps": t.get("optimizer_steps"),
            }
        )
    return runs


def references(folder: Path) -> dict[tuple[str, int], dict]:
    """The article's runs by (name, processes): img/s (median over the call's runs of it) and peak reserved per
    GPU (the largest rank of any of them)."""
    found: dict[tuple[str, int], list[dict]] = {}
    for path in sorted(folder.rglob("reference-*.json")):
        if re.search(r"\.rank\d+$", path.stem) or SKIPPED & set(path.relative_to(folder).parts[:-1]):
            continue
        d = _load(path)
        if not d or d.get("status") != "ok" or not d.get("images_per_s"):
            continue
        ranks = [d] + [r for r in map(_load, sorted(path.parent.glob(f"{path.stem}.rank*.json"))) if r]
        reserved = max(
            (r["peak_reserved_gb"] for r in ranks if isinstance(r.get("peak_reserved_gb"), int | float)),
            default=None,
        )
        key = (path.stem, int(d.get("world_size") or 1))
        found.setdefault(key, []).append({"images_per_s": d["images_per_s"], "peak_reserved_gb": reserved})
    return {
        key: {
            "runs": len(v),
            "images_per_s": statistics.median(r["images_per_s"] for r in v),
            "peak_reserved_gb": max(
                (r["peak_reserved_gb"] for r in v if r["peak_reserved_gb"]), default=None
            ),
        }
        for key, v in found.items()
    }


def your_model_rows(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("your-model/*/your_model.json")):
        d = _load(path)
        if not d:
            continue
        m, est, card = (
            d.get("memory") or {},
            d.get("estimate") or {},
            (d.get("extra") or {}).get("predicted_card") or {},
        )
        prov = d.get("provenance") or {}
        row = {
            "run": path.parent.name,
            "status": d.get("status"),
            "model": (d.get("config") or {}).get("model"),
            "gpus": prov.get("world_size"),
            "gpu": prov.get("gpu_name"),
        }
        for key, measured, predicted in (
            ("allocated", m.get("peak_allocated_gb"), est.get("peak_allocated_gb")),
            ("reserved", m.get("peak_reserved_gb"), card.get("peak_reserved_gb")),
            ("device", m.get("device_peak_gb"), card.get("device_peak_gb")),
        ):
            row[key] = {
                "measured": measured,
                "predicted": predicted,
                "error": predicted / measured - 1 if measured and predicted else None,
            }
        row["within"] = row["status"] == "ok" and all(
            row[k]["error"] is not None and abs(row[k]["error"]) <= ESTIMATE_BAND
            for k in ("allocated", "reserved", "device")
        )
        rows.append(row)
    return rows


def group_rows(runs: list[dict]) -> list[dict]:
    """One row per (rung, variant, processes): the runs' img/s, each run's ratio to its call's article run (so
    calls on other GPU kinds pool: the row names the kinds) and the largest ratio of reserved per GPU."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["recipe"], r["variant"], r["world_size"]), []).append(r)
    rows = []
    for (recipe, variant, n), rs in sorted(
        groups.items(), key=lambda kv: (-(kv[0][2] or 0), kv[0][0], kv[0][1])
    ):
        speeds = [r["images_per_s"] for r in rs]
        x = [r["x_article"] for r in rs if r.get("x_article") is not None]
        reserved = max((r["peak_reserved_gb"] for r in rs if r["peak_reserved_gb"] is not None), default=None)
        x_reserved = [
            r["peak_reserved_gb"] / r["article_reserved_gb"]
            for r in rs
            if r["peak_reserved_gb"] is not None and r.get("article_reserved_gb")
        ]
        over = [r["device_overhead_gb"] for r in rs if r.get("device_overhead_gb") is not None]
        rows.append(
            {
                "rung": recipe + (f"+{variant}" if variant else ""),
                "recipe": recipe,
                "variant": variant,
                "world_size": n,
                "gpu": ", ".join(sorted({r["gpu"] for r in rs if r["gpu"]})) or None,
                "runs": len(rs),
                "calls": len({r.get("call") for r in rs}),
                "calls_with_article": len({r.get("call") for r in rs if r.get("x_article") is not None}),
                "median_images_per_s": statistics.median(speeds),
                "min_images_per_s": min(speeds),
                "max_images_per_s": max(speeds),
                "x_article": x,
                "median_x_article": statistics.median(x) if x else None,
                "peak_reserved_gb": reserved,
                "x_article_reserved": max(x_reserved) if x_reserved else None,
                "p90_over_p10": [r["p90_over_p10"] for r in rs],
                "device_overhead_gb": max(over) if over else None,
            }
        )
    return rows


def target(row: dict) -> str:
    """Whether a pooled row of a rung as it is meets its targets; else what it lacks."""
    goal = TARGET_SPEED.get(row["world_size"])
    if goal is None or row["variant"]:
        return ""
    lacks = []
    if row["runs"] < 3 or row["calls_with_article"] < 2:
        lacks.append(
            f"{row['runs']} run(s) in {row['calls_with_article']} call(s) with the article's (>= 3 in >= 2)"
        )
    if row["median_x_article"] is None or row["median_x_article"] < goal:
        lacks.append(f"speed < {goal:g}x")
    if row["x_article_reserved"] is None or row["x_article_reserved"] > TARGET_RESERVED:
        lacks.append(f"reserved > {TARGET_RESERVED:.2f}x")
    spreads = [s for s in row["p90_over_p10"] if s]
    if row["recipe"] == "09_cpu_offload" and (not spreads or max(spreads) > TARGET_SPREAD):
        lacks.append(f"p90/p10 > {TARGET_SPREAD}")
    return "met" if not lacks else "not met: " + ", ".join(lacks)


def _range(values: list[float], fmt: str, suffix: str = "") -> str:
    if not values:
        return "no article run"
    med = statistics.median(values)
    return f"{med:{fmt}}{suffix} ({min(values):{fmt}}-{max(values):{fmt}})"


def speed_table(rows: list[dict], label: str) -> list[str]:
    lines = [
        f"| rung | GPUs | {label} | runs | img/s median (min-max) | x article median (min-max) | reserved GB max"
        " (x article) | device - reserved GB | step p90/p10 per run |"
        + (" target |" if label == "calls" else ""),
        "|---|---:|---|---:|---|---|---|---:|---|" + ("---|" if label == "calls" else ""),
    ]
    for r in rows:
        speeds = [r["min_images_per_s"], r["median_images_per_s"], r["max_images_per_s"]]
        res = "" if r["peak_reserved_gb"] is None else f"{r['peak_reserved_gb']:.2f}"
        res += f" ({r['x_article_reserved']:.2f}x)" if r["x_article_reserved"] else ""
        over = "" if r["device_overhead_gb"] is None else f"{r['device_overhead_gb']:.2f}"
        spread = ", ".join(f"{s:.2f}" for s in r["p90_over_p10"] if s)
        lines.append(
            f"| {r['rung']} | {r['world_size']} | {r['where']} | {r['runs']} | {speeds[1]:.1f} ({speeds[0]:.1f}-"
            f"{speeds[2]:.1f}) | {_range(r['x_article'], '.2f', 'x')} | {res} | {over} | {spread} |"
            + (f" {target(r)} |" if label == "calls" else "")
        )
    return lines


def summarise(calls: list[Path]) -> tuple[dict, str]:
    out: dict = {"calls": [], "pooled": [], "your_model": []}
    every_run, lines = [], []
    for folder in calls:
        runs, refs = rung_runs(folder), references(folder)
        for r in runs:
            ref = refs.get((RUNGS[r["recipe"]], r["world_size"]))
            r["call"], r["x_article"] = folder.name, r["images_per_s"] / ref["images_per_s"] if ref else None
            r["article_reserved_gb"] = ref["peak_reserved_gb"] if ref else None
        rows = group_rows(runs)
        for row in rows:
            row["where"] = folder.name
        ym = your_model_rows(folder)
        gpus = gpus_of(folder, runs)
        out["calls"].append(
            {
                "call": folder.name,
                "folder": str(folder),
                "gpus": gpus,
                "rows": rows,
                "runs": runs,
                "references": {f"{k[0]} x{k[1]}": v for k, v in refs.items()},
            }
        )
        out["your_model"] += [{**row, "call": folder.name} for row in ym]
        every_run += runs
        lines += [f"## {folder.name}: {gpus}", ""] + speed_table(rows, "call")
        lines += (
            [""]
            + [
                f"- article's {k[0].removeprefix('reference-')} on {k[1]} GPUs: {v['images_per_s']:.1f} img/s"
                f" ({v['runs']} run{'s' * (v['runs'] > 1)}), {v['peak_reserved_gb'] or 0:.2f} GB reserved per GPU"
                for k, v in sorted(refs.items())
            ]
            + [""]
        )
    pooled = group_rows(every_run)
    for row in pooled:
        row["where"] = f"{row['calls']} call{'s' * (row['calls'] > 1)}, {row['gpu'] or 'GPU unknown'}"
        row["target"] = target(row)
    out["pooled"] = pooled
    head = [
        f"# Sharded rungs against the article's script: {len(calls)} call{'s' * (len(calls) > 1)}",
        "",
        "Each run's img/s over the article's img/s in the same call; reserved is the largest rank's peak, over the"
        " article's. Targets: >= 3.5x at 4 GPUs (>= 3x at 2) on the median of >= 3 runs in >= 2 calls, at <= 1.00x"
        " its reserved; rung 09's p90/p10 <= 1.3 in every run.",
        "",
        "## Pooled over calls",
        "",
    ]
    head += speed_table(pooled, "calls") + [""]
    ym = out["your_model"]
    lines += [
        "## Your model sharded, predicted against measured per GPU",
        "",
        f"Within +-{100 * ESTIMATE_BAND:.0f} % on allocated, reserved and whole device: {sum(r['within'] for r in ym)}"
        f" of {len(ym)} runs.",
        "",
        "| call | your model | GPUs | status | allocated meas / pred (err) | reserved"
        " | whole device | within |",
        "|---|---|---:|---|---|---|---|---|",
    ]
    for r in ym:
        cells = [
            f"{r[k]['measured'] or 0:.2f} / {r[k]['predicted'] or 0:.2f}"
            + (f" ({100 * r[k]['error']:+.1f} %)" if r[k]["error"] is not None else "")
            for k in ("allocated", "reserved", "device")
        ]
        lines.append(
            f"| {r['call']} | {r['run']} | {r['gpus']} | {r['status']} | "
            + " | ".join(cells)
            + f" | {'yes' if r['within'] else 'no'} |"
        )
    return out, "\n".join(head + lines) + "\n"


def call_folders(folders: list[Path]) -> list[Path]:
    """The calls: each folder, or its call*/ subfolders when it has them."""
    calls = []
    for f in folders:
        subs = sorted(p for p in f.iterdir() if p.is_dir() and p.name.startswith("call"))
        calls += subs or [f]
    return calls


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="sharded_spread_summary.py", description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path, help="call folders, or a folder of call*/ folders")
    p.add_argument("--out", type=Path, help="where summary.md/json go (default: the one folder given)")
    args = p.parse_args(argv)
    bad = [str(f) for f in args.folders if not f.is_dir()]
    if bad or (args.out is None and len(args.folders) > 1):
        why = f"not a folder: {', '.join(bad)}" if bad else "several folders: give --out DIR"
        print(f"sharded_spread_summary.py: error: {why}", file=sys.stderr)
        return 2
    out_dir = args.out or args.folders[0]
    data, text = summarise(call_folders(args.folders))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(data, indent=1))
    (out_dir / "summary.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Summarise what scripts/gpu/sharded_spread.sh ran: the sharded rungs' speed over repeats against the
article's script (median and range, rung 09's step-time p90/p10 per run), and your model sharded, predicted
against measured per GPU (allocated, reserved, whole device).

    python3 scripts/gpu/sharded_spread_summary.py FOLDER      # writes FOLDER/summary.md and summary.json

FOLDER holds ``compare/**/runs/*.json`` (fmr-compare's runs: the article's and the first repeat),
``repeats/r*/*.json`` (the later repeats) and ``your-model/*/your_model.json``. Exit code: 0, 2 bad input.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

RUNGS = {
    "08_fsdp": "reference-11_delay-allocation-no-offload",
    "08_fsdp2": "reference-11_delay-allocation-no-offload",
    "09_cpu_offload": "reference-11_delay-allocation",
}


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def rung_runs(folder: Path) -> dict[str, list[dict]]:
    """Every ok run of each sharded rung (rank 0's results JSON), in the order they ran."""
    runs: dict[str, list[dict]] = {r: [] for r in RUNGS}
    for path in sorted(folder.glob("compare/**/runs/*.json")) + sorted(folder.glob("repeats/r*/*.json")):
        d = _load(path)
        if not d or d.get("recipe") not in RUNGS or d.get("status") != "ok":
            continue
        t = d["timing"]
        steady = (t.get("intervals_s") or [])[t.get("warmup_steps", 0) :]
        step_s = t.get("step_s") or {}
        p10 = quantile(steady, 0.1) if steady else step_s.get("p10")
        p90 = quantile(steady, 0.9) if steady else step_s.get("p90")
        runs[d["recipe"]].append(
            {
                "file": str(path.relative_to(folder)),
                "images_per_s": t["images_per_s"],
                "median_step_s": t["median_step_s"],
                "p90_over_p10": p90 / p10 if p10 and p90 else None,
                "peak_reserved_gb": d["memory"]["peak_reserved_gb"],
                "device_peak_gb": d["memory"].get("device_peak_gb"),
                "host_cores": len(d["extra"].get("host_cores") or []) or None,
                "gpu": d["provenance"].get("gpu_name"),
                "world_size": d["provenance"].get("world_size"),
            }
        )
    return runs


def references(folder: Path) -> dict[str, dict]:
    refs = {}
    for path in sorted(folder.glob("compare/**/runs/reference-*.json")):
        d = _load(path)
        if d and d.get("status") == "ok" and d.get("rank", 0) == 0 and ".rank" not in path.name:
            refs[path.stem] = {"images_per_s": d["images_per_s"], "peak_reserved_gb": d["peak_reserved_gb"]}
    return refs


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
        row = {
            "run": path.parent.name,
            "status": d.get("status"),
            "model": d["config"].get("model"),
            "gpus": d["provenance"].get("world_size"),
            "gpu": d["provenance"].get("gpu_name"),
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
        rows.append(row)
    return rows


def summarise(folder: Path) -> tuple[dict, str]:
    runs, refs, ym = rung_runs(folder), references(folder), your_model_rows(folder)
    lines = [
        "| rung | runs | img/s median (min-max) | x article median (min-max) | reserved GB max | x article"
        " | step p90/p10 per run |",
        "|---|---:|---|---|---:|---:|---|",
    ]
    out: dict = {"rungs": {}, "references": refs, "your_model": ym}
    for rung, ref_name in RUNGS.items():
        rs, ref = runs[rung], refs.get(ref_name)
        if not rs:
            lines.append(f"| {rung} | 0 | | | | | |")
            continue
        speeds = [r["images_per_s"] for r in rs]
        x = [s / ref["images_per_s"] for s in speeds] if ref else []
        reserved = max(r["peak_reserved_gb"] for r in rs)
        spreads = [r["p90_over_p10"] for r in rs if r["p90_over_p10"]]
        out["rungs"][rung] = {
            "runs": rs,
            "median_images_per_s": statistics.median(speeds),
            "x_article": x,
            "median_x_article": statistics.median(x) if x else None,
        }
        lines.append(
            f"| {rung} | {len(rs)} | {statistics.median(speeds):.1f} ({min(speeds):.1f}-{max(speeds):.1f})"
            + (f" | {statistics.median(x):.2f}x ({min(x):.2f}-{max(x):.2f})" if x else " | no article run")
            + f" | {reserved:.2f} | "
            + (f"{reserved / ref['peak_reserved_gb']:.2f}x" if ref else "")
            + " | "
            + ", ".join(f"{s:.2f}" for s in spreads)
            + " |"
        )
    lines += [
        "",
        "| your model | GPUs | status | allocated meas / pred (err) | reserved | whole device |",
        "|---|---:|---|---|---|---|",
    ]
    for r in ym:
        cells = []
        for key in ("allocated", "reserved", "device"):
            c = r[key]
            cells.append(
                f"{c['measured'] or 0:.2f} / {c['predicted'] or 0:.2f}"
                + (f" ({100 * c['error']:+.1f} %)" if c["error"] is not None else "")
            )
        lines.append(f"| {r['run']} | {r['gpus']} | {r['status']} | " + " | ".join(cells) + " |")
    gpus = {r["gpu"] for rs in runs.values() for r in rs} | {r["gpu"] for r in ym}
    lines.insert(0, f"GPUs: {', '.join(sorted(g for g in gpus if g)) or 'unknown'}\n")
    return out, "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(
            "usage: sharded_spread_summary.py FOLDER (a folder of sharded_spread.sh's runs)", file=sys.stderr
        )
        return 2
    folder = Path(argv[0])
    data, text = summarise(folder)
    (folder / "summary.json").write_text(json.dumps(data, indent=1))
    (folder / "summary.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

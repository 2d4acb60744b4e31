"""Predicted against measured for inference runs: ``python -m fabric_memory_recipes.planning.inference.check DIR``
reads every results JSON of ``recipes/your_model.py --infer`` under DIR (each holds its measurement and the
prediction made in the same process) and writes DIR/inference_check.json and DIR/inference_check.md: peak
allocated, peak reserved and the whole-device peak, predicted and measured, with the error of each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fabric_memory_recipes.console import Parser

TARGET = 0.05  # the whole-device peak within +-5 %
FIELDS = (
    ("allocated", "peak_allocated_gb", "run_peak_allocated_gb"),
    ("reserved", "peak_reserved_gb", "run_peak_reserved_gb"),
    ("device", "device_peak_gb", "device_peak_gb"),
)


def row(path: Path, payload: dict[str, Any]) -> dict[str, Any] | None:
    extra = payload.get("extra") or {}
    if not extra.get("inference"):
        return None
    pred, memory, cfg = (
        extra.get("predicted_inference") or {},
        payload.get("memory") or {},
        payload.get("config") or {},
    )
    out = {
        "run": payload.get("tag") or path.stem,
        "file": str(path),
        "status": payload.get("status"),
        "model": extra.get("model"),
        "task": extra.get("task"),
        "precision": cfg.get("precision"),
        "batch_size": cfg.get("batch_size"),
        "seq_len": cfg.get("seq_len") if extra.get("task") != "image_classification" else None,
        "new_tokens": cfg.get("new_tokens") if extra.get("task") in ("causal_lm", "seq2seq_lm") else None,
        "kv_cache_dtype": cfg.get("kv_cache_dtype") if extra.get("task") == "causal_lm" else None,
        "weights_quant": cfg.get("weights_quant") or "none",
        "peak_phase": pred.get("peak_phase"),
        "prediction_error": pred.get("error"),
        "components_gb": pred.get("components_gb"),
        "gpu": (payload.get("provenance") or {}).get("gpu_name"),
        "infer_s": extra.get("inference_s"),
        "predict_s": extra.get("predicted_inference_s"),
    }
    for name, predicted, measured in FIELDS:
        p, m = pred.get(predicted), memory.get(measured)
        out[f"predicted_{name}_gb"], out[f"measured_{name}_gb"] = p, m
        out[f"{name}_error"] = (p - m) / m if p is not None and m else None
    return out


def collect(folder: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(folder.rglob("*.json")):
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(payload, dict) and (r := row(path, payload)):
            rows.append(r)
    return rows


def _gb(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:+.1f} %"


def render(rows: list[dict[str, Any]]) -> str:
    within = [r for r in rows if r["device_error"] is not None and abs(r["device_error"]) <= TARGET]
    lines = [
        "| run | model | shape | phase | allocated GB pred / meas | reserved GB pred / meas | whole device GB pred / meas | device error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = (
            f"{r['batch_size']}"
            + (f" x {r['seq_len']}" if r["seq_len"] else "")
            + (f" + {r['new_tokens']} new, KV {r['kv_cache_dtype']}" if r["new_tokens"] else "")
        )
        status = "" if r["status"] == "ok" else f" ({r['status']})"
        quant = "" if r.get("weights_quant", "none") == "none" else f", {r['weights_quant']} weights"
        lines.append(
            f"| {r['run']}{status} | {r['model']} ({r['precision']}{quant}) | {shape} | {r['peak_phase'] or '—'} | "
            f"{_gb(r['predicted_allocated_gb'])} / {_gb(r['measured_allocated_gb'])} | "
            f"{_gb(r['predicted_reserved_gb'])} / {_gb(r['measured_reserved_gb'])} | "
            f"{_gb(r['predicted_device_gb'])} / {_gb(r['measured_device_gb'])} | {_pct(r['device_error'])} |"
        )
    lines += ["", f"Whole-device peak within ±{100 * TARGET:.0f} %: {len(within)} of {len(rows)} rows."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="python -m fabric_memory_recipes.planning.inference.check", description=__doc__.splitlines()[0]
    )
    p.add_argument("folder", type=Path)
    args = p.parse_args(argv)
    rows = collect(args.folder)
    if not rows:
        p.exit(2, f"{p.prog}: no inference results JSON under {args.folder}\n")
    (args.folder / "inference_check.json").write_text(json.dumps({"target": TARGET, "rows": rows}, indent=2))
    text = render(rows)
    (args.folder / "inference_check.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

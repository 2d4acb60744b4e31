"""The rows of ``comparison.json`` (fabric_memory_recipes.tools.compare.reference): each run's JSON read back
(:func:`summarize_reference`, :func:`summarize_project`), with how its process ended, into one row per rung
(:func:`build_row`), and the files written from the rows (:func:`write_outputs`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fabric_memory_recipes.measurement.report.comparison import comparison_ratios, write_comparison
from fabric_memory_recipes.measurement.results_file import write_json_atomic
from fabric_memory_recipes.processes import Run
from fabric_memory_recipes.tools.compare.plan import MODES, RUNGS, SUBSTITUTION_NOTE, Reference


def _read_json(path: Path) -> dict | None:
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return payload if isinstance(payload, dict) else None


def summarize_reference(path: Path) -> dict[str, Any] | None:
    """The reference side of a row from the runner's JSON (rank files merged: memory is the maximum
    over ranks, i.e. per GPU; img/s counts all ranks). None when the runner wrote nothing."""
    main = _read_json(path)
    if main is None:
        return None
    ranks = [main] + [p for p in map(_read_json, sorted(path.parent.glob(f"{path.stem}.rank*.json"))) if p]

    def peak(key: str) -> float | None:
        values = [r.get(key) for r in ranks if isinstance(r.get(key), int | float)]
        return max(values) if values else None

    return {
        "status": main.get("status", "error"),
        "peak_reserved_gb": peak("peak_reserved_gb"),
        "images_per_s": main.get("images_per_s"),
        "peak_allocated_gb": peak("peak_allocated_gb"),
        "steps": main.get("steps"),
        "median_step_s": main.get("median_step_s"),
        "effective_batch": main.get("effective_batch"),
        "world_size": main.get("world_size"),
        "script_constants": main.get("script_constants"),
        "warmup": (main.get("memory") or {}).get("warmup"),
        "steady": (main.get("memory") or {}).get("steady"),
        "error": main.get("error"),
        "substitutions": main.get("substitutions"),
        "provenance": main.get("provenance"),
    }


def summarize_project(path: Path) -> dict[str, Any] | None:
    """One mode's side of a row from a recipe's results JSON: img/s = timing.images_per_s, memory = the
    maximum over memory.phases.* (model load, train, eval: the whole run), warm-up/steady peaks when the
    results carry them. None when the recipe wrote nothing."""
    result = _read_json(path)
    if result is None:
        return None
    memory = result.get("memory") or {}
    phases = [p for p in (memory.get("phases") or {}).values() if isinstance(p, dict)]

    def peak(key: str) -> float | None:
        values = [p.get(key) for p in phases if isinstance(p.get(key), int | float)]
        return max(values) if values else memory.get(key)

    timing, config = result.get("timing") or {}, result.get("config") or {}
    return {
        "status": result.get("status", "error"),
        "peak_reserved_gb": peak("peak_reserved_gb"),
        "images_per_s": timing.get("images_per_s"),
        "peak_allocated_gb": peak("peak_allocated_gb"),
        "train_peak_reserved_gb": memory.get("peak_reserved_gb"),
        "device_peak_gb": memory.get(
            "device_peak_gb"
        ),  # the whole device (fabric_memory_recipes.measurement.device_memory)
        "steps": timing.get("optimizer_steps"),
        "median_step_s": timing.get("median_step_s"),
        "warmup": memory.get("warmup"),
        "steady": memory.get("steady"),
        "mode": config.get("mode"),
        "compile": config.get("compile"),
        "error": result.get("error"),
        "provenance": result.get("provenance"),
    }


def side_of(run: Run | None, summary: dict[str, Any] | None, out_dir: Path) -> dict[str, Any] | None:
    """A row's side: the JSON's numbers with how the process ended (exit code, wall time, log)."""
    if run is None and summary is None:
        return None
    side: dict[str, Any] = dict(
        summary or {"status": "error", "peak_reserved_gb": None, "images_per_s": None}
    )
    side.pop("provenance", None)  # in the row's "call" instead
    outcome = (run.result if run else None) or {}
    if outcome.get("status") in ("timeout", "not run"):
        side["status"] = outcome["status"]
    elif outcome and outcome.get("exit_code") not in (0, None) and side.get("status") == "ok":
        side["status"] = "error"  # a JSON saying ok from a process that failed afterwards
    if outcome:
        side["exit_code"] = outcome.get("exit_code")
        side["wall_s"] = outcome.get("wall_s")
        if side.get("status") != "ok" and not side.get("error"):
            side["error"] = outcome.get("error")
    if run is not None:
        side["json"] = os.path.relpath(run.json, out_dir)
        side["log"] = os.path.relpath(run.log, out_dir)
        if run.kind == "reference":
            side["script"] = run.name
    if not side.get("status"):
        side["status"] = "error"
    return side


def build_row(
    rung: str,
    runs: list[Run],
    out_dir: Path,
    modes: list[str],
    call: dict[str, Any],
    mapping: dict[str, Reference] | None = None,
) -> dict[str, Any]:
    """The comparison row of one rung from the files its runs wrote (and how the processes ended)."""
    spec = RUNGS[rung]
    ref = (mapping or {}).get(rung, spec.reference)
    ref_run = next((r for r in runs if r.kind == "reference" and rung in r.rows), None)
    row: dict[str, Any] = {"rung": rung, "recipe": spec.recipe}
    row["reference"] = side_of(ref_run, summarize_reference(ref_run.json) if ref_run else None, out_dir)
    for mode in MODES:
        run = next((r for r in runs if r.kind == "project" and r.name == rung and r.mode == mode), None)
        row[mode] = (
            side_of(run, summarize_project(run.json) if run else None, out_dir) if mode in modes else None
        )
    row["like_for_like"] = ref.like_for_like if ref else None
    row["reference_note"] = ref.note if ref else "the article has no script for this rung"
    row["ratios"] = comparison_ratios(row)
    row["call"] = call
    return row


def call_info(runs: list[Run], started: str, steps: int, command: str) -> dict[str, Any]:
    """What produced the rows: GPU and versions (from the first run that recorded them), steps, command."""
    provenance: dict[str, Any] = {}
    for run in runs:
        payload = _read_json(run.json) or {}
        provenance = payload.get("provenance") or {}
        if provenance.get("gpu_name"):
            break
    return {
        "started": started,
        "gpu_name": provenance.get("gpu_name"),
        "torch": provenance.get("torch"),
        "lightning": provenance.get("lightning"),
        "steps": steps,
        "command": command,
        "substitution_note": SUBSTITUTION_NOTE,
    }


def write_outputs(out_dir: Path, rows: list[dict], figure: bool = True) -> None:
    """comparison.json (rows sorted by rung), comparison.md and, with ``figure``, comparison.png."""
    rows = sorted(rows, key=lambda r: r["rung"])
    write_json_atomic(str(out_dir / "comparison.json"), rows)  # type: ignore[arg-type]
    write_comparison(rows, out_dir, figure=figure)

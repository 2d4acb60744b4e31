"""What a step-time calibration (planning/your_model/step_calibration.py) says of its runs: the errors' summary,
the table it prints, and the short lines step_time.py's docstring shows."""

from __future__ import annotations

import statistics
from typing import Any

from fabric_memory_recipes import techniques


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Max and median |error| and how many within 25 %: of the configurations every ceiling but B_host is
    fitted on, of those held out one model at a time (when computed), and of the offload runs."""
    out: dict[str, Any] = {}
    core = [r for r in rows if r["fitted"] and r["fitted_for"] != "host_bandwidth"]
    for key, sel in (
        ("fitted", [r["error"] for r in core]),
        (
            "leave_one_model_out",
            [r["leave_one_model_out_error"] for r in core if r["leave_one_model_out_error"] is not None],
        ),
        ("activation_offload", [r["error"] for r in rows if r["fitted_for"] == "host_bandwidth"]),
    ):
        if sel:
            errors = [abs(e) for e in sel]
            out[key] = {
                "configurations": len(errors),
                "max_abs_error": round(max(errors), 4),
                "median_abs_error": round(statistics.median(errors), 4),
                "within_25_percent": sum(e <= 0.25 for e in errors),
            }
    return out


def table_lines(entry: dict[str, Any]) -> list[str]:
    lines = [f"{'configuration':<100} {'measured s':>10} {'predicted s':>11} {'error':>7} {'held out':>8}"]
    for r in entry["runs"]:
        lomo = r["leave_one_model_out_error"]
        mark = (
            "  (not fitted)"
            if not r["fitted"]
            else ("  (B_host)" if r["fitted_for"] == "host_bandwidth" else "")
        )
        lines.append(
            f"{r['configuration'][:100]:<100} {r['measured_s']:>10.4f} {r['predicted_s']:>11.4f}"
            f" {r['error']:>+7.0%} {'' if lomo is None else format(lomo, '+.0%'):>8}{mark}"
        )
    for key, s in entry["summary"].items():
        lines.append(
            f"{key}: {s['configurations']} configurations, max |error| {s['max_abs_error']:.0%},"
            f" median {s['median_abs_error']:.0%}, within 25 %: {s['within_25_percent']}"
        )
    return lines


# How a configuration is shortened; a flagged technique not named here, to its flag (fused_loss=True: fused-loss).
SHORT = (
    ("hf:examples/configs/", ""), ("your_model ", ""), ("precision=", ""), ("batch_size=", "b"),
    (" accumulation_steps=", "/k"), ("seq_len=", "s"), ("optimizer=", ""), ("checkpoint_blocks=True", "ckpt"),
    (" checkpoint_mode=full", ""), ("checkpoint_mode=", "ckpt-"), ("activation_offload=True", "offload"),
    ("optimizer_in_backward=True", "step-in-backward"),
)  # fmt: skip


def notes_lines(entry: dict[str, Any]) -> list[str]:
    """The stored table as step_time.py's docstring shows it: one short line per configuration."""
    lines = ["measured predicted  error held out  configuration (step s; error: samples/s)"]
    for r in entry["runs"]:
        name = r["configuration"]
        for old, new in (*SHORT, *((f"{t.field}=True", t.flag[2:]) for t in techniques.flagged())):
            name = name.replace(old, new)
        lomo = r["leave_one_model_out_error"]
        tag = (
            " [not fitted]"
            if not r["fitted"]
            else (" [B_host]" if r["fitted_for"] == "host_bandwidth" else "")
        )
        lines.append(
            f"{r['measured_s']:8.4f} {r['predicted_s']:9.4f} {r['error']:+6.0%}"
            f"  {'' if lomo is None else format(lomo, '+.0%'):>8}  {name}{tag}"
        )
    return lines

"""The table of runs on an emulated card (``--memory-budget-gb``): predicted against measured, per budget.

``devtools.planner_proof`` and ``devtools.model_proof`` (its ``--fit`` rows) write it: one row per (budget,
role) with the predicted and measured peaks (reserved, and the whole device where measured) and speeds, then
one line per budget with the targets checked (:func:`check_targets`).
"""

from __future__ import annotations

from typing import Any

from devtools.capped_card.markdown import markdown_table

COLUMNS = [
    ("card GB", ">"), ("role", "<"), ("command", "<"), ("predicted reserved GB", ">"),
    ("measured reserved GB", ">"), ("predicted device GB", ">"), ("measured device GB", ">"),
    ("predicted img/s", ">"), ("measured img/s", ">"), ("status", "<"), ("measured at", ">"),
]  # fmt: skip
# What a row takes from the run that measured it (planner_proof's and model_proof's rows alike)
MEASURED = (
    "status",
    "error",
    "measured_peak_reserved_gb",
    "measured_peak_allocated_gb",
    "measured_device_peak_gb",
    "measured_images_per_s",
    "result_json",
)


def with_outcome(
    row: dict[str, Any], run: dict[str, Any], keys: tuple[str, ...] = MEASURED
) -> dict[str, Any]:
    """``row`` with the outcome of the run that measured it: each of ``keys`` the run's where it has it."""
    return {**row, **{k: run.get(k, row.get(k)) for k in keys}}


def fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "—"


def render(rows: list[dict[str, Any]]) -> str:
    """fit.md: the rows, then each budget against its targets (check_targets)."""
    cells = (
        [f"{r['budget_gb']:g}", r["role"], f"`{r['command']}`", fmt(r["predicted_peak_gb"], ".2f"),
         fmt(r["measured_peak_reserved_gb"], ".2f"), fmt(r.get("predicted_device_gb"), ".2f"),
         fmt(r.get("measured_device_peak_gb"), ".2f"), fmt(r["predicted_images_per_s"], ".0f"),
         fmt(r["measured_images_per_s"], ".0f"), r["status"], f"{r['measured_at_budget_gb']:g} GB"]
        for r in rows
    )  # fmt: skip
    lines = [*markdown_table(COLUMNS, cells), "", *check_targets(rows)]
    return "\n".join(lines) + "\n"


def check_targets(rows: list[dict[str, Any]]) -> list[str]:
    """One line per budget (a card of that size): the pick ran to the end, predicted peaks (reserved;
    whole device where measured) against measured, the pick within 20 % of the fastest measured fitting
    configuration, the rejected ran out of memory (or by how much it fitted), and any run whose
    allocator went over its cap or whose whole-device peak went over the card."""
    out = []
    for budget in sorted({r["budget_gb"] for r in rows}):
        mine = [r for r in rows if r["budget_gb"] == budget]
        pick = next((r for r in mine if r["role"] == "pick"), None)
        ok = [r for r in mine if r["role"] != "rejected" and r["status"] == "ok"]
        errors = [
            100 * (r["predicted_peak_gb"] / r["measured_peak_reserved_gb"] - 1)
            for r in ok
            if r["measured_peak_reserved_gb"]
        ]
        parts = [f"{budget:g} GB: pick {pick['status'] if pick else 'none'}"]
        if errors:
            parts.append(
                f"predicted peaks {min(errors):+.1f}% to {max(errors):+.1f}% of measured ({len(errors)} runs)"
            )
        device = [
            100 * (r["predicted_device_gb"] / r["measured_device_peak_gb"] - 1)
            for r in ok
            if r.get("measured_device_peak_gb") and r.get("predicted_device_gb")
        ]
        if device:
            parts.append(
                f"whole device {min(device):+.1f}% to {max(device):+.1f}% of measured ({len(device)} runs)"
            )
        speeds = [r["measured_images_per_s"] for r in ok if r["measured_images_per_s"]]
        if pick and pick.get("measured_images_per_s") and speeds:
            parts.append(
                f"pick at {100 * pick['measured_images_per_s'] / max(speeds):.0f}% of the fastest of"
                f" {len(speeds)} measured fitting configurations"
            )
        for r in mine:
            cap = r["measured_at_budget_gb"] - (r.get("overhead_gb") or 0.0)  # the allocator's share
            if (r["measured_peak_reserved_gb"] or 0) > cap * 1.001:  # the cap did not hold
                parts.append(f"{r['command']} reserved {r['measured_peak_reserved_gb']:.2f} GB over its cap")
            if (r.get("measured_device_peak_gb") or 0) > r["measured_at_budget_gb"]:  # over the card
                parts.append(
                    f"{r['command']} used {r['measured_device_peak_gb']:.2f} GB of the device: over the card"
                )
            if r["role"] == "rejected" and r["status"] == "ok":
                parts.append(
                    f"rejected one fitted: predicted {r['predicted_peak_gb']:.2f} GB, measured"
                    f" {fmt(r['measured_peak_reserved_gb'], '.2f')} GB (too cautious)"
                )
            elif r["role"] == "rejected":
                parts.append(f"rejected: {r['status']}")
        out.append("- " + "; ".join(parts))
    return out

"""What a change of precision or optimizer costs in accuracy, as the project's convergence benchmark measured it.

``--fit`` keeps the user's precision and optimizer unless ``--may-change`` names them
(planning/your_model/sets.py): a memory technique changes how memory is used, a change of precision or optimizer
changes what is trained. Where one is allowed, each row that makes it says what it cost in the benchmark
(ViT-L/16 from random weights on scikit-learn's digits, 30 epochs, several seeds: results/published/<gpu>/
convergence/) and what fixed it there, or that nothing was measured. The comparison isolates the change:
two rungs that differ in it alone.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from fabric_memory_recipes.planning.planner import calibration, snapshot

# (what, value) -> (the rung/variant that made the change, the one it is compared with, {fix: rung/variant})
KAHAN, STOCHASTIC = "Kahan summation", "stochastic rounding"
CHANGES: dict[tuple[str, str], tuple[str, str, dict[str, str]]] = {
    ("precision", "bf16-true"): (
        "03_true_half_precision/default",
        "01_baseline/default",
        {KAHAN: "03_true_half_precision/kahan", STOCHASTIC: "03_true_half_precision/stochastic"},
    ),
    ("precision", "16-mixed"): ("02_mixed_precision/default", "01_baseline/default", {}),
    ("optimizer", "sgd"): ("06_sgd_cosine/default", "05_gradient_accumulation/default", {}),
    ("optimizer", "adamw8bit"): ("13_lowbit_optimizer/default", "05_gradient_accumulation/default", {}),
}
# Changes whose measurement stands for another's, and why.
SAME_AS = {
    ("precision", "bf16-mixed"): (("precision", "16-mixed"), "measured for 16-mixed: the same fp32 weights")
}
BENCHMARK = "ViT-L/16 on digits, results/published/{gpu}/convergence/"


@dataclasses.dataclass(frozen=True)
class Cost:
    """The measured accuracy cost of one change."""

    change: str  # "precision bf16-true"
    delta: float | None  # test accuracy, changed minus compared (None: not measured)
    n: int
    compared: str
    fixes: tuple[tuple[str, float, int], ...] = ()  # (fix, its test accuracy minus the compared, n)
    note: str = ""

    def line(self) -> str:
        if self.delta is None:
            return f"{self.change}: no accuracy cost measured ({self.note or 'no benchmark run of it'})"
        fix = "; ".join(f"with {name} {d:+.3f} (n={n})" for name, d, n in self.fixes)
        return (
            f"{self.change}: {self.delta:+.3f} test accuracy against {self.compared} (n={self.n}"
            f"{', ' + self.note if self.note else ''})"
            + (f"; fixed there {fix}" if fix else "; no fix measured")
        )


def _accuracy(gpu: str) -> dict[str, Any]:
    data = (
        snapshot.accuracy_payload()
        if calibration.RESULTS_DIR.is_dir()
        else (snapshot.load("accuracy.json") or {})
    )
    return data.get(gpu) or data.get(calibration.REFERENCE_GPU) or {}


def cost(what: str, value: str, gpu: str = calibration.REFERENCE_GPU) -> Cost:
    """The measured cost of changing ``what`` (precision | optimizer) to ``value``."""
    key, note = (what, value), ""
    if key in SAME_AS:
        key, note = SAME_AS[key]
    change = f"{what} {value}"
    if key not in CHANGES:
        return Cost(change, None, 0, "", note="the benchmark has no rung that changes this alone")
    changed, compared, fixes = CHANGES[key]
    rows = _accuracy(gpu)
    if changed not in rows or compared not in rows:
        return Cost(change, None, 0, compared, note=f"no finished run of {changed} or {compared}")
    base = statistics.fmean(rows[compared]["test"])
    found = tuple(
        (name, statistics.fmean(rows[v]["test"]) - base, len(rows[v]["test"]))
        for name, v in fixes.items()
        if v in rows
    )
    label = f"{compared.split('/')[0]} ({BENCHMARK.format(gpu=gpu)})"
    return Cost(
        change, statistics.fmean(rows[changed]["test"]) - base, len(rows[changed]["test"]), label, found, note
    )

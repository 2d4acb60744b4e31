"""What share of its best rate a GPU kind's bf16 matrix products reach, by shape: the measured table the step-time
model reads a matrix product's rate from (planning/your_model/micro_batch_time.py, ``Ceilings.gemm_table``).

``fabric_memory_recipes/data/gemm_rates.json`` holds, per GPU kind, the TFLOP/s ``torch.mm`` reached there for each
M, N, K of a grid and each layout of the operands (devtools/speed/gemm_rates.py measures and stores them). A product
of another shape takes the rate interpolated between the grid's neighbours (linear in the logs of M, N, K and of
the rate; a dimension beyond the grid takes its edge's), and its share is that rate over the table's best, the
products' fixed time taken out (:func:`_grid`). Why: one FLOP/s for every matrix product could not fit both a small
model's products (GPT-2 small's [8192, 768] by [768, 768]: 578 TFLOP/s on an H200) and a large one's ([8192, 2048]
by [2048, 8192]: 803).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from fabric_memory_recipes.config import DATA_DIR
from fabric_memory_recipes.measurement.results_file import gpu_slug, kinds_table

TABLE_FILE = Path(DATA_DIR) / "gemm_rates.json"
LAYOUTS = ("nt", "nn", "tn")  # as measured; a product of both operands transposed takes their mean


def load() -> dict[str, Any]:
    """The stored tables ({"kinds": {gpu: table}}), empty if missing or unreadable."""
    return kinds_table(str(TABLE_FILE))


def kinds() -> list[str]:
    """The GPU kinds with a measured table."""
    return sorted(load()["kinds"])


@functools.cache
def _grid(kind: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(log2 of the grid's dims, {layout: log of each product's share of the best rate}) of ``kind``'s table.

    Each measured time (2 M N K / rate) less the smallest one, the fixed time any product takes (about 2.6 us on
    an H200, the smallest product's whole time), which the step-time model counts apart as each kernel's g: what is
    left is the product's work, at most at the best measured rate (a product of little more than the fixed time
    would otherwise seem to run above it)."""
    table = load()["kinds"][kind]
    dims = np.asarray(table["dims"], dtype=float)
    flops = 2.0 * dims[:, None, None] * dims[None, :, None] * dims[None, None, :]
    measured = {layout: np.asarray(table["rates"][layout], dtype=float) * 1e12 for layout in LAYOUTS}
    best = max(float(r.max()) for r in measured.values())
    fixed = min(float((flops / r).min()) for r in measured.values())
    shares = {
        layout: np.log(np.minimum(flops / np.maximum(flops / r - fixed, 1e-12), best) / best)
        for layout, r in measured.items()
    }
    shares["tt"] = np.log(np.mean([np.exp(s) for s in shares.values()], axis=0))
    return np.log2(dims), shares


def shares(kind: str, shapes: list[tuple[int, int, int, str] | None]) -> np.ndarray:
    """Each product's rate over ``kind``'s best (1.0 for a ``None``: not a matrix product)."""
    out = np.ones(len(shapes))
    index = [i for i, s in enumerate(shapes) if s is not None]
    if not index:
        return out
    dims, tables = _grid(kind)
    mnk = np.log2(np.maximum(np.array([shapes[i][:3] for i in index], dtype=float), 1.0))
    mnk = np.clip(mnk, dims[0], dims[-1])
    lo = np.clip(np.searchsorted(dims, mnk, side="right") - 1, 0, len(dims) - 2)
    w = (mnk - dims[lo]) / (dims[lo + 1] - dims[lo])  # each dimension's weight on its upper neighbour
    layouts = np.array([shapes[i][3] for i in index])
    logs = np.zeros(len(index))
    for layout in np.unique(layouts):
        sel = layouts == layout
        table, a, f = tables[layout], lo[sel], w[sel]
        for corner in range(8):
            up = [(corner >> d) & 1 for d in range(3)]
            weight = np.prod([f[:, d] if up[d] else 1 - f[:, d] for d in range(3)], axis=0)
            logs[sel] += weight * table[a[:, 0] + up[0], a[:, 1] + up[1], a[:, 2] + up[2]]
    out[index] = np.exp(logs)
    return out


def store(measured: dict[str, Any], path: Path | None = None) -> str:
    """Keep a table devtools/speed/gemm_rates.py measured under its GPU's kind, in ``path`` (None: :data:`TABLE_FILE`),
    its rates to 4 significant digits (a small product's 0.17 TFLOP/s rounded to 0.1 would move the fixed time
    :func:`_grid` takes out); returns the kind."""
    path = TABLE_FILE if path is None else path
    kind = gpu_slug(measured["gpu_name"])
    missing = [layout for layout in LAYOUTS if layout not in measured["rates"]]
    if missing:
        raise ValueError(f"the table holds no {', '.join(missing)} layout(s): measure all of {LAYOUTS}")
    stored = kinds_table(str(path))
    entry = {
        **{k: measured[k] for k in ("gpu_name", "torch", "dtype", "unit", "dims", "index")},
        "rates": {
            layout: [
                [[float(f"{v:.4g}") for v in row] for row in plane] for plane in measured["rates"][layout]
            ]
            for layout in LAYOUTS
        },
    }
    table = {
        "what": "the TFLOP/s bf16 torch.mm products reached on each GPU kind, by shape and operand layout"
        " (measurement/gemm_rates.py)",
        "how": "python -m devtools.speed.gemm_rates --out FILE (on the GPU), then --store FILES (their median)",
        "kinds": {**stored.get("kinds", {}), kind: entry},
    }
    path.write_text(json.dumps(table, separators=(",", ":")) + "\n")
    kinds_table.cache_clear()
    _grid.cache_clear()
    return kind

"""Measure the FLOP/s a GPU's bf16 matrix products reach over a grid of shapes.

The step-time model reads a matrix product's rate from this table (measurement/gemm_rates.py,
``fabric_memory_recipes/data/gemm_rates.json``).

    python -m devtools.speed.gemm_rates --out gemm-h200.json            # on the GPU (minutes)
    python -m devtools.speed.gemm_rates --store gemm-h200*.json         # anywhere: their median, into the package

Each shape (M, N, K: an [M, K] by [K, N] product) of :data:`DIMS` cubed, for each layout of the operands a linear
layer's step uses (``nt``: the forward, the weight transposed; ``nn``: the input's gradient; ``tn``: the weight's
gradient), in bf16, runs ``torch.mm`` into a preallocated output inside a CUDA graph of several products: the
kernels back to back, no launch between them. The rate is the median over replays of the graph; the shapes run in
a shuffled order (:func:`measure`), and several tables, measured apart, are stored as their median.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

from fabric_memory_recipes.console import Parser, fail
from fabric_memory_recipes.measurement import gemm_rates

# Powers of two, and the widths of common transformers' layers between them.
DIMS = (
    64, 128, 256, 384, 512, 768, 896, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 5632, 6144, 8192, 11008,
    16384, 32768,
)  # fmt: skip
LAYOUTS = ("nt", "nn", "tn")
TARGET_S = 1e-3  # each graph replay runs products for about this long


def operands(torch, m: int, n: int, k: int, layout: str, dtype):
    """An [m, k] and a [k, n] operand, stored as ``layout`` says (t: transposed view of a contiguous tensor)."""
    a = torch.randn(k, m, device="cuda", dtype=dtype).t() if layout[0] == "t" else None
    a = a if a is not None else torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype).t() if layout[1] == "t" else None
    b = b if b is not None else torch.randn(k, n, device="cuda", dtype=dtype)
    return a, b


def rate(torch, m: int, n: int, k: int, layout: str, dtype, replays: int = 3) -> float:
    """The FLOP/s of ``m x k`` by ``k x n`` products in ``layout`` (module docstring)."""
    a, b = operands(torch, m, n, k, layout, dtype)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    torch.mm(a, b, out=out)  # cuBLAS picks its kernel (and its workspace) outside the capture
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.mm(a, b, out=out)
    end.record()
    end.synchronize()
    reps = max(1, min(200, round(TARGET_S / max(start.elapsed_time(end) * 1e-3, 1e-6))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            torch.mm(a, b, out=out)
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / reps)
    del graph
    return 2.0 * m * n * k / statistics.median(times)


def measure(dims=DIMS, layouts=LAYOUTS, log=print, out: Path | None = None, seed: int = 0) -> dict:
    """The table (:func:`main`'s ``--out``). The shapes of every layout run in one shuffled order (``seed``), so
    that the GPU's warming over the run spreads over the grid instead of following it; the table is written to
    ``out`` at each tenth, so a stopped run keeps what it measured (0.0: not measured)."""
    import torch

    if not torch.cuda.is_available():
        fail("no CUDA device: the rates are measured on the GPU")
    name = torch.cuda.get_device_name()
    rates = {layout: [[[0.0] * len(dims) for _ in dims] for _ in dims] for layout in layouts}
    order = [
        (layout, i, j, q)
        for layout in layouts
        for i in range(len(dims))
        for j in range(len(dims))
        for q in range(len(dims))
    ]
    random.Random(seed).shuffle(order)
    began, tenth = time.perf_counter(), max(1, len(order) // 10)
    for done, (layout, i, j, q) in enumerate(order, 1):
        rates[layout][i][j][q] = round(
            rate(torch, dims[i], dims[j], dims[q], layout, torch.bfloat16) / 1e12, 2
        )
        if done % tenth == 0 or done == len(order):
            torch.cuda.empty_cache()
            log(f"{done} of {len(order)} shapes ({time.perf_counter() - began:.0f} s)", flush=True)
            if out is not None:
                out.write_text(json.dumps(_table(name, torch.__version__, dims, rates)))
    return _table(name, torch.__version__, dims, rates)


def median_of(tables: list[dict]) -> dict:
    """One table of several measured ones (the same GPU kind and grid): each rate the median of theirs."""
    first = tables[0]
    if any(t["dims"] != first["dims"] or t["gpu_name"] != first["gpu_name"] for t in tables):
        fail(
            "the tables differ in their GPU or their grid: give tables of one GPU kind, measured on one grid"
        )
    rates = {
        layout: [
            [[statistics.median(t["rates"][layout][i][j][q] for t in tables) for q in range(len(plane[0]))]
             for j, _ in enumerate(plane)]
            for i, plane in enumerate(first["rates"][layout])
        ]
        for layout in first["rates"]
    }  # fmt: skip
    return {**first, "rates": rates, "measurements": len(tables)}


def _table(name: str, version: str, dims, rates: dict) -> dict:
    return {
        "gpu_name": name,
        "torch": version,
        "dtype": "bfloat16",
        "unit": "TFLOP/s",
        "dims": list(dims),
        "index": "rates[layout][i][j][q]: M = dims[i], N = dims[j], K = dims[q]",
        "rates": rates,
    }


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="measure on this machine's GPU and write the table here")
    parser.add_argument(
        "--store",
        nargs="+",
        help="put measured tables (--out's files; several: each rate their median) into the package's",
    )
    parser.add_argument(
        "--layouts", default=",".join(LAYOUTS), help="the layouts to measure (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the shuffled order's seed (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if bool(args.out) == bool(args.store):
        fail("give one of --out (measure) or --store (keep a measured table)")
    if args.out:
        measure(layouts=tuple(args.layouts.split(",")), out=Path(args.out), seed=args.seed)
        print(f"wrote {args.out}")
        return 0
    tables = [json.loads(Path(f).read_text()) for f in args.store]
    print(f"stored {gemm_rates.store(median_of(tables))} (the median of {len(tables)} table(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A matrix product's rate by its shape (measurement/gemm_rates.py): the collector records each product's
M, N, K and layout (planning/simulation/costs.py), the measured table gives its share of the GPU kind's best rate,
and the step time model prices it at F times that share (micro_batch_time.py)."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest
import torch
from torch import nn

from devtools.speed import gemm_rates as measure_tool
from fabric_memory_recipes.measurement import gemm_rates
from fabric_memory_recipes.planning.simulation.costs import product_shape
from fabric_memory_recipes.planning.your_model import set_speed, step_time
from fabric_memory_recipes.planning.your_model.micro_batch_time import MicroBatch
from tests.planning.simulation.test_op_costs_kernels import collected

DIMS = [64, 256, 1024]


def synthetic(rate) -> dict:
    """A measured table of DIMS whose rate (TFLOP/s) is ``rate(m, n, k)`` in every layout."""
    rates = [[[rate(m, n, k) for k in DIMS] for n in DIMS] for m in DIMS]
    return {
        "gpu_name": "NVIDIA H200", "torch": torch.__version__, "dtype": "bfloat16", "unit": "TFLOP/s",
        "dims": DIMS, "index": "rates[layout][i][j][q]", "rates": {layout: rates for layout in gemm_rates.LAYOUTS},
    }  # fmt: skip


@pytest.fixture
def table(tmp_path, monkeypatch):
    """The package's table in a file of its own: ``use(measured)`` stores a table there, as ``--store`` does."""
    monkeypatch.setattr(gemm_rates, "TABLE_FILE", tmp_path / "gemm_rates.json")
    yield gemm_rates.store
    gemm_rates._grid.cache_clear()


def test_a_linear_layers_products_are_recorded_with_their_shapes_and_layouts():
    ops = collected(nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16)), torch.empty(4, 32)).of(0)
    shapes = [o.shape for o in ops if o.matmul]
    # the second layer's: forward x @ W.T (the weight a transposed view); input's gradient gy @ W; weight's
    # gradient gy.T @ x (the first layer's input needs no gradient)
    assert sorted(shapes) == sorted([(4, 48, 32, "nt"), (4, 16, 48, "nt"), (4, 48, 16, "nn"), (16, 48, 4, "tn"),
                                     (48, 32, 4, "tn")])  # fmt: skip
    assert all(o.shape is None for o in ops if not o.matmul)


def test_a_batched_products_batch_is_folded_into_m():
    a, b = torch.empty(6, 5, 7), torch.empty(6, 7, 3)
    assert product_shape("bmm", (a, b)) == (30, 3, 7, "nn")
    assert product_shape(
        "baddbmm", (torch.empty(6, 5, 3), a, b.transpose(1, 2).contiguous().transpose(1, 2))
    ) == (
        30,
        3,
        7,
        "nt",
    )
    assert product_shape("mm", (torch.empty(5), b)) is None  # not a matrix: no shape


def test_shares_are_measured_rates_less_the_fixed_time_over_the_best(table):
    """A product's time on the table is 2 M N K / rate; the smallest time is every product's fixed time (the
    model's g), so a share is the rate of what is left over the best measured rate (at most 1)."""
    kind = table(synthetic(lambda m, n, k: 100.0 * (m * n * k / 1024**3) ** 0.3))
    assert kind == "h200"
    flops = {d: 2.0 * d**3 for d in DIMS}
    time = {d: flops[d] / (100e12 * (d**3 / 1024**3) ** 0.3) for d in DIMS}
    got = gemm_rates.shares(kind, [(1024, 1024, 1024, "nt"), (256, 256, 256, "tn"), None, (64, 64, 64, "nn")])
    assert got[2] == 1.0  # not a matrix product
    assert got[0] == pytest.approx(
        min(1.0, flops[1024] / (time[1024] - time[64]) / 100e12), rel=1e-3
    )  # 0.1 TFLOP/s
    assert got[1] == pytest.approx(flops[256] / (time[256] - time[64]) / 100e12, rel=1e-3)
    assert 0 < got[1] < got[0] <= 1.0
    assert got[3] == 1.0  # all fixed time: the kernel's g, not a rate


def test_shapes_between_and_beyond_the_grid_interpolate_and_clamp(table):
    kind = table(synthetic(lambda m, n, k: 50.0 + 100.0 * DIMS.index(n)))
    low, mid, high, beyond, below = gemm_rates.shares(
        kind, [(256, 256, 256, "nt"), (256, 512, 256, "nt"), (256, 1024, 256, "nt"), (256, 9999, 256, "nt"),
               (256, 8, 256, "tt")]
    )  # fmt: skip
    assert low < mid < high and beyond == pytest.approx(high)  # 512: halfway in log2 between 256 and 1024
    assert np.log(mid) == pytest.approx((np.log(low) + np.log(high)) / 2, rel=1e-9)
    assert below == pytest.approx(gemm_rates.shares(kind, [(256, 64, 256, "nt")])[0])  # tt: the layouts' mean


def test_a_table_needs_every_layout(tmp_path):
    measured = synthetic(lambda m, n, k: 1.0)
    del measured["rates"]["tn"]
    with pytest.raises(ValueError, match="no tn layout"):
        gemm_rates.store(measured, tmp_path / "t.json")


def test_the_step_model_prices_a_small_product_slower_per_flop_with_a_table(table):
    kind = table(synthetic(lambda m, n, k: 100.0 + 100.0 * DIMS.index(k)))
    c, _ = step_time.ceilings("h100")
    mb = MicroBatch(
        flops=np.array([2e12, 2e12]), bytes=np.zeros(2), kernels=np.ones(2), matmul=np.array([True, True]),
        python=np.zeros(2, dtype=bool), recompute_starts=np.zeros(2, dtype=bool), module_calls=0,
        shapes=[(1024, 1024, 1024, "nt"), (1024, 1024, 256, "nt")],
    )  # fmt: skip
    plain = c.__class__(**{**c.to_dict(), "gemm_table": ""})
    shaped = c.__class__(**{**c.to_dict(), "gemm_table": kind})
    rates = mb.flop_rate(shaped)
    assert rates[0] == pytest.approx(c.matmul_flops) and rates[1] < rates[0]
    assert np.all(mb.flop_rate(plain) == c.matmul_flops)  # no table: one F
    assert mb.seconds(shaped, "fast", True) > mb.seconds(plain, "fast", True)
    assert mb.floor_seconds(shaped, "fast", True) <= mb.seconds(shaped, "fast", True)


def test_the_measuring_tool_says_in_one_line_what_it_needs(capsys):
    with pytest.raises(SystemExit) as e:
        measure_tool.main([])
    assert e.value.code == 2 and "give one of --out (measure) or --store" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            measure_tool.main(["--out", "/dev/null"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "no CUDA device" in err and len(err.strip().splitlines()) == 1


def test_tables_measured_apart_are_stored_as_their_median(tmp_path, capsys):
    tables = [synthetic(lambda m, n, k, v=v: v) for v in (100.0, 300.0, 200.0)]
    assert measure_tool.median_of(tables)["rates"]["nt"][1][2][0] == 200.0
    other = {**tables[0], "dims": [64, 128, 256]}
    with pytest.raises(SystemExit) as e:
        measure_tool.median_of([tables[0], other])
    assert e.value.code == 2 and "differ in their GPU or their grid" in capsys.readouterr().err


def test_verbose_plans_list_the_ceilings_with_the_table_they_read():
    """``--verbose`` lists every ceiling: the rates as numbers, the measured products' kind by name."""
    c, _ = step_time.ceilings("h100")
    planner = types.SimpleNamespace(
        gpu="h200",
        devices=1,
        ceilings_source="h200: test",
        ceilings=dataclasses.replace(c, gemm_table="h200"),
    )
    shown = set_speed.lines(planner, verbose=True)
    assert "  gemm_table: h200" in shown and f"  matmul_flops: {c.matmul_flops:.4g}" in shown
    plain = set_speed.lines(types.SimpleNamespace(**{**vars(planner), "ceilings": c}), verbose=True)
    assert "  gemm_table: none" in plain


def test_the_store_command_keeps_the_median_of_the_measured_tables(tmp_path, table, capsys):
    """``python -m devtools.speed.gemm_rates --store FILES`` (docs/your_model.md): their median, under the GPU's
    kind, in the package's table; the shares then read it."""
    files = []
    for v in (100.0, 400.0, 200.0):
        files.append(tmp_path / f"t{v:.0f}.json")
        files[-1].write_text(json.dumps(synthetic(lambda m, n, k, v=v: v * DIMS.index(k) + v)))
    assert measure_tool.main(["--store", *map(str, files)]) == 0
    assert "stored h200 (the median of 3 table(s))" in capsys.readouterr().out
    stored = json.loads(gemm_rates.TABLE_FILE.read_text())["kinds"]["h200"]
    assert stored["rates"]["nn"][0][0] == [200.0, 400.0, 600.0]
    assert gemm_rates.kinds() == ["h200"] and 0 < gemm_rates.shares("h200", [(64, 64, 256, "nn")])[0] <= 1

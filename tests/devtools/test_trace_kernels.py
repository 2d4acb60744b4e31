"""devtools/speed/trace_kernels.py: a profiled step's kernels, gaps and BatchNorm pass rates from its trace."""

import gzip
import json

import pytest

from devtools.speed import trace_kernels


def _kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


TRACE = {
    "traceEvents": [
        {"cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 5},  # not the GPU's
        _kernel("void at::native::batch_norm_collect_statistics_channels_last_kernel<>", 10, 20),
        _kernel("void at::native::batch_norm_transform_input_channels_last_kernel<>", 31, 8),
        _kernel("nvjet_sm90_tst_192x128", 40, 30),
        {"cat": "gpu_memset", "name": "Memset", "ts": 1000, "dur": 2},  # after a host gap: not a short one
    ]
}


def test_summary_counts_busy_time_short_gaps_and_classes():
    events = trace_kernels.kernels(TRACE)
    assert [e["ts"] for e in events] == [10, 31, 40, 1000]
    s = trace_kernels.summary(events, steps=2)
    assert s["kernels"] == 2.0
    assert s["busy_ms"] == pytest.approx(60 / 1e3 / 2)
    assert s["short_gaps"] == 1.0  # two gaps of 1 us in two steps; the 930 us one is the host's
    assert s["mean_short_gap_us"] == pytest.approx(1.0)
    assert s["short_gap_ms"] == pytest.approx(2 / 1e3 / 2)
    assert s["by_class"]["matmul"] == {"kernels": 0.5, "ms": pytest.approx(0.015)}
    assert s["by_class"]["BatchNorm statistics"]["ms"] == pytest.approx(0.01)
    assert s["by_class"]["other"]["kernels"] == 0.5  # the fill
    assert list(s["by_class"])[0] == "matmul"  # longest first


def test_batch_norm_rates_pair_layers_with_their_kernels():
    rows = trace_kernels.batch_norm_rates(trace_kernels.kernels(TRACE), [40e6])
    assert rows == [
        {
            "input_mb": 40.0,
            "statistics_us": 20,
            "statistics_gb_s": pytest.approx(2000.0),  # 40 MB in 20 us
            "elementwise_us": 8,
            "elementwise_gb_s": pytest.approx(10000.0),  # read and written: 80 MB in 8 us
        }
    ]


def test_main_prints_each_trace(tmp_path, capsys):
    path = tmp_path / "trace-x.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(TRACE, f)
    assert trace_kernels.main([str(path), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 kernels/step" not in out and "4 kernels/step" in out
    assert "BatchNorm statistics" in out and "mean 1.00 us" in out

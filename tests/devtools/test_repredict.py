"""devtools/your_model/repredict.py: a committed sharded run of your model predicted again per GPU, its card
(peak reserved, whole device) beside its allocated peak, as the sharded summary compares them."""

from __future__ import annotations

import json

import pytest

from devtools.your_model import repredict
from tests.tiny import causal_lm_config


@pytest.fixture
def sharded_run(tmp_path):
    """A results file of a fast-mode run of a tiny causal LM over 2 H200s (the numbers made up)."""
    folder = tmp_path / "lm"
    folder.mkdir()
    config = causal_lm_config(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=300
    )
    (folder / "config.json").write_text(json.dumps(config))
    flags = {"model": f"hf:{folder}", "fsdp": True, "devices": 2, "precision": "bf16-mixed", "batch_size": 2}
    flags.update(seq_len=16, checkpoint_blocks=True, compile=True, cuda_graphs=False, mode="fast")
    run = {
        "recipe": "your_model",
        "status": "ok",
        "config": flags,
        "provenance": {"gpu_name": "NVIDIA H200", "world_size": 2, "cuda_alloc_conf": None},
        "memory": {
            "kind": "cuda",
            "peak_allocated_gb": 0.01,
            "peak_reserved_gb": 0.02,
            "device_peak_gb": 2.0,
        },
        "estimate": {"peak_allocated_gb": 0.011},
        "extra": {"predicted_card": {"peak_reserved_gb": 0.015, "device_peak_gb": 1.7}},
    }
    path = tmp_path / "runs" / "your_model.json"
    path.parent.mkdir()
    path.write_text(json.dumps(run))
    return path


def test_a_sharded_run_is_predicted_again_with_its_card(sharded_run, tmp_path, capsys):
    assert repredict.main([str(sharded_run.parent), "--json", str(tmp_path / "rows.json")]) == 0
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    assert row["measured_gb"] == {"allocated": 0.01, "reserved": 0.02, "device": 2.0}
    assert row["recorded_gb"] == {"allocated": 0.011, "reserved": 0.015, "device": 1.7}
    again = row["again_gb"]
    assert 0 < again["allocated"] <= again["reserved"] < again["device"]
    # fast mode: the compiled runs' overhead of 2 H200 processes (device_overhead.json), per GPU
    assert again["device"] - again["reserved"] == pytest.approx(2.0867, abs=1e-3)
    out = capsys.readouterr().out
    assert "reserved 0.02 / 0.01 ->" in out and "device 2.00 / 1.70 ->" in out

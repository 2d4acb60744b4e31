"""devtools.check_equivalence's comparison, on CPU tensors (the GPU runs it compares cannot run here)."""

from __future__ import annotations

import pytest
import torch

from devtools import check_equivalence as eq


def _run(before: dict, step: float, prefix: str = "") -> dict:
    return {
        "before": {prefix + k: v.clone() for k, v in before.items()},
        "after": {prefix + k: v + step * torch.ones_like(v) for k, v in before.items()},
    }


def test_parameter_names_drop_the_fabric_and_compile_wrappers():
    assert eq.parameter_name("_forward_module._orig_mod.class_token") == "class_token"
    assert (
        eq.parameter_name("_forward_module.encoder.layers.0.mlp.0.weight") == "encoder.layers.0.mlp.0.weight"
    )
    model = torch.compile(torch.nn.Linear(2, 2))  # wrapping only: nothing is compiled until called
    assert set(eq.parameters_by_name(model)) == {"weight", "bias"}


def test_equal_runs_pass_and_a_frozen_or_doubled_step_fails():
    torch.manual_seed(0)
    start = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    eager = _run(start, 0.01)
    same = eq.compare(eager, _run(start, 0.01))
    assert same["ok"] and same["max_abs_diff"] == 0.0 and same["rel_l2"] == 0.0
    assert same["max_change"] == pytest.approx(0.01)
    for wrong in (0.0, 0.02):  # a step lost, a micro-batch counted twice
        row = eq.compare(eager, _run(start, wrong))
        assert not row["ok"] and row["rel_l2"] == pytest.approx(1.0)


def test_different_parameter_sets_are_an_error_not_a_pass():
    start = {"w": torch.zeros(2)}
    fast = _run(start, 0.01)
    fast["after"]["extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="different parameters"):
        eq.compare(_run(start, 0.01), fast)


def test_the_file_holds_every_finished_rung_in_order_and_a_failed_child_is_a_row(tmp_path, monkeypatch):
    """Each rung's child writes its rows; equivalence.json is rewritten (atomically) after each one
    finishes, so a call killed at its time limit keeps the rungs it checked, in the order asked for."""
    import json
    import subprocess

    written = []

    def fake_run(cmd, **kwargs):
        rung, out = cmd[cmd.index("--child") + 1], cmd[cmd.index("--child-out") + 1]
        if rung == "13":
            return subprocess.CompletedProcess(cmd, 1)  # the child crashed: no rows of its own
        row = {
            "rung": rung,
            "check": "compile+graphs, fp32",
            "steps": 10,
            "max_abs_diff": 0.0,
            "tolerance": 1e-3,
            "ok": True,
            "max_change": 2e-3,
            "rel_l2": 0.0,
            "expected_ok": True,
        }
        with open(out, "w") as f:
            json.dump([row], f)
        written.append(rung)
        return subprocess.CompletedProcess(cmd, 0)

    writes = []
    original_write = eq.write_json_atomic

    def recording_write(path, rows):
        writes.append([r["rung"] for r in rows])
        original_write(path, rows)

    monkeypatch.setattr(eq.subprocess, "run", fake_run)
    monkeypatch.setattr(eq, "write_json_atomic", recording_write)
    code = eq.main(["--rungs", "14,13,05", "--steps", "10", "--out", str(tmp_path), "--parallel", "1"])
    rows = json.loads((tmp_path / "equivalence.json").read_text())
    assert code == 1 and written == ["14", "05"]
    assert writes == [["14"], ["14", "13"], ["14", "13", "05"]]  # the file after every finished rung
    assert [(r["rung"], r["ok"]) for r in rows] == [("14", True), ("13", False), ("05", True)]
    assert rows[1]["check"] == "failed to run" and not list(tmp_path.glob(".equivalence-*.json"))


def test_every_rung_with_a_compensated_default_is_checked_with_it_and_rung_03_with_both_rules():
    """The stochastic-rounding default (rungs 04-07, 10-15) is compared in bf16 with CUDA graphs and no
    compilation (replays run the eager kernels and draw from the same generator state: equal, or the
    capture is wrong), beside each rung's fp32 row; a control with other random bits must fail."""
    from fabric_memory_recipes.tools.compare.plan import SINGLE_GPU_RUNGS

    names = {rung: [c[0] for c in eq.checks_for(rung)] for rung in SINGLE_GPU_RUNGS}
    for rung in ("04", "05", "06", "07", "10", "11", "12", "13", "14", "15"):
        assert names[rung] == ["compile+graphs, fp32", "graphs, own precision, stochastic"], rung
    assert names["01"] == ["compile+graphs, fp32"]
    assert names["02"] == ["graphs, own precision"]
    assert names["03"] == ["graphs, own precision", "graphs, own precision, stochastic"]
    stochastic_03 = eq.checks_for("03")[1]
    assert stochastic_03[1] == ["--bf16-update", "stochastic"] and stochastic_03[2][-1] == "--no-compile"
    assert [patch for patch, _ in eq.CONTROLS["06"]] == ["lr", "rounding"]

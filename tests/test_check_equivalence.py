"""tools.check_equivalence's comparison, on CPU tensors (the GPU runs it compares cannot run here)."""

from __future__ import annotations

import pytest
import torch

from tools import check_equivalence as eq


def _run(before: dict, step: float, prefix: str = "") -> dict:
    return {
        "before": {prefix + k: v.clone() for k, v in before.items()},
        "after": {prefix + k: v + step * torch.ones_like(v) for k, v in before.items()},
    }


def test_parameter_names_drop_the_fabric_and_compile_wrappers():
    assert eq.parameter_name("_forward_module._orig_mod.class_token") == "class_token"
    assert eq.parameter_name("_forward_module.encoder.layers.0.mlp.0.weight") == "encoder.layers.0.mlp.0.weight"
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

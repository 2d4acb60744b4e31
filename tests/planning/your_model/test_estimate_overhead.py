"""The card overhead the estimate for your own model adds is the one of the mode it estimates: the one ``--fit``
adds to each set of that mode (planning/your_model/sets.py) and ``--memory-budget-gb`` takes off the card
(training/lifecycle.py), a run's own prediction too (planning/your_model/estimate.py ``for_user_run``)."""

from __future__ import annotations

import json

import pytest

from fabric_memory_recipes.config import Hardware
from fabric_memory_recipes.measurement.card_overhead import card_overhead
from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.planning.your_model.estimate import for_user_run, meta_user_model
from fabric_memory_recipes.planning.your_model.sets import UserPlanner
from fabric_memory_recipes.training.your_model import runner
from tests.tiny import causal_lm_config


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> str:
    """A tiny causal LM: fast mode compiles its blocks and captures its steps in CUDA graphs."""
    folder = tmp_path_factory.mktemp("overhead_lm")
    (folder / "config.json").write_text(json.dumps(causal_lm_config()))
    return f"hf:{folder}"


def test_the_estimate_adds_the_overhead_of_the_mode_it_estimates(lm, capsys):
    compiled, eager = card_overhead("h100", "fast").gb, card_overhead("h100", "eager").gb
    assert compiled != eager  # the committed table measured the two apart: else this test tells nothing
    planned = {c.mode: c.overhead_gb for c in UserPlanner(lm, 2, 32, "h100").choices}
    assert planned == {"fast": compiled, "eager": eager}  # what --fit adds to each set
    argv = ["--model", lm, "--seq-len", "32", "--batch-size", "2", "--gpu", "h100", "--json"]
    for extra, want in (([], compiled), (["--mode", "eager"], eager)):  # fast: the runner's default on a GPU
        assert estimate_main([*argv, *extra]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["overhead_gb"] == want, extra
        assert got["device_peak_gb"] == pytest.approx(got["peak_reserved_gb"] + want)

    flags = dict(model=lm, seq_len=32, batch_size=2, accelerator="cuda")
    cfg = runner.default_config().with_flags(**flags).checked(Hardware.planned())
    assert cfg.mode == "fast" and cfg.compile and cfg.cuda_graphs  # compiled blocks, captured steps
    um, model, blocks, _ = meta_user_model(lm)
    assert for_user_run(model, um, cfg, blocks)[1]["overhead_gb"] == compiled  # the run's own prediction

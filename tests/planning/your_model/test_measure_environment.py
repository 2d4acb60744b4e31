"""``fmr-estimate --model ... --fit SIZE --measure``: each set's run trains under the caching-allocator setting
its prediction assumed (planning/your_model/measure.py), whatever the user's own configuration's mode set in
the planner's process. In-process: the planner's search and the runs are stand-ins; each stand-in run
resolves its command line as the runner does, in the environment it was given."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch

from fabric_memory_recipes.config import FAST_ALLOCATOR, Hardware
from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.planning.your_model import measure
from fabric_memory_recipes.planning.your_model.estimate import meta_user_model
from fabric_memory_recipes.planning.your_model.sets import UserPlanner, allocator_of_set
from fabric_memory_recipes.training import cli as training_cli
from fabric_memory_recipes.training.your_model import models, runner
from tests.tiny import causal_lm_config

ALLOC = "PYTORCH_CUDA_ALLOC_CONF"


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> str:
    """A tiny causal LM: fast mode sets expandable segments (its steps captured), eager mode nothing."""
    folder = tmp_path_factory.mktemp("measured_lm")
    (folder / "config.json").write_text(json.dumps(causal_lm_config()))
    meta_user_model(f"hf:{folder}")  # its class imported here: transformers probes a GPU the test fakes
    return f"hf:{folder}"


@pytest.mark.parametrize("users", [None, "garbage_collection_threshold:0.8"])
def test_each_measured_set_runs_under_the_allocator_its_prediction_assumed(
    lm, tmp_path, monkeypatch, capsys, users
):
    if users is None:
        monkeypatch.delenv(ALLOC, raising=False)
    else:
        monkeypatch.setenv(ALLOC, users)
    picked, ran = [], []

    def fast_then_eager(planner, budget_gb, top):  # the search itself: test_fit_search.py
        picked.extend(next(c for c in planner.choices if c.mode == m) for m in ("fast", "eager"))
        for c in picked:
            c.images_per_s, c.predicted_gb = 100.0, 1.0
        return picked, None

    def run_as_the_runner(run, env, timeout):
        """The run's own start: its flags resolved (config.py sets fast mode's allocator) in its env."""
        with mock.patch.dict(os.environ):  # restored after
            os.environ.pop(ALLOC, None)
            os.environ.update({ALLOC: env[ALLOC]} if ALLOC in env else {})
            cfg = training_cli.parse(runner.default_config(), run.cmd[2:], hardware=Hardware.planned())
            setting = os.environ.get(ALLOC)
        ran.append((cfg.mode, setting))
        run.json.parent.mkdir(parents=True, exist_ok=True)
        run.json.write_text(
            json.dumps(
                {
                    "status": "ok",
                    "memory": {"device_peak_gb": 2.0, "peak_reserved_gb": 1.1},
                    "timing": {"images_per_s": 90.0},
                    "provenance": {"cuda_alloc_conf": setting},
                }
            )
        )
        return {"status": "ok", "wall_s": 0.1}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(UserPlanner, "fit", fast_then_eager)
    monkeypatch.setattr(measure, "execute", run_as_the_runner)
    argv = ["--model", lm, "--seq-len", "32", "--batch-size", "2", "--fit", "4GB", "--measure"]
    assert estimate_main([*argv, "--measure-dir", str(tmp_path)]) == 0  # the user's mode: fast, the default

    assumed = [allocator_of_set(c, models.resolve(lm)) for c in picked]
    assert assumed == [
        "graphs",
        "default",
    ]  # fast mode's graphs, expandable segments; eager: PyTorch's default
    expected = [FAST_ALLOCATOR, None] if users is None else [users, users]  # a user's setting is kept
    assert ran == list(zip(("fast", "eager"), expected, strict=True))
    assert os.environ.get(ALLOC) == users  # the planner's process is left as the user started it
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [r["cuda_alloc_conf"] for r in plan["sets"]] == expected  # what each run had, in plan.json
    said = capsys.readouterr().out
    assert ("(yours) is kept for every set" in said) == (users is not None)

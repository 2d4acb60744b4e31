"""Adding a technique touches its module, its record and the recipe that teaches it, nothing else
(docs/architecture.md, "Adding a technique"): a record registered here, with a module of its own and no
other edit, is a flag of the your-model runner, a field of its configuration, a switch your model's planner
tries and labels, a feature of the speed model's runs, a flag of ``fmr-estimate --model`` (in its --help) and a
change the estimate applies to the model."""

from __future__ import annotations

import json
import sys
import types

import pytest

from fabric_memory_recipes import techniques
from fabric_memory_recipes.config import Hardware, UsageError
from fabric_memory_recipes.planning import arguments
from fabric_memory_recipes.planning.your_model import estimate, step_calibration
from fabric_memory_recipes.planning.your_model.sets import UserPlanner
from fabric_memory_recipes.training import cli
from fabric_memory_recipes.training.your_model import runner
from tests.tiny import causal_lm_config

HALVED = techniques.Technique(
    "halved_loss",
    "halved loss",
    "halved_loss",
    "your_model",
    flag="--halved-loss",
    help="causal LMs: half the loss (a technique that exists only in this test)",
    tasks=("causal_lm",),
)


@pytest.fixture
def halved(monkeypatch):
    """The record registered and its module importable: ``apply`` halves the loss and counts its calls."""
    module = types.ModuleType(f"fabric_memory_recipes.training.techniques.{HALVED.module}")
    module.applied = []

    def apply(model, batch_fn):
        module.applied.append(type(model).__name__)
        return lambda model, batch: (lambda loss, *rest: (loss / 2, *rest))(*batch_fn(model, batch))

    module.apply = apply
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(techniques, "TECHNIQUES", (*techniques.TECHNIQUES, HALVED))
    return module


@pytest.fixture
def causal_lm(tmp_path) -> str:
    config = causal_lm_config(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=512
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    return f"hf:{tmp_path / 'config.json'}"


def test_a_new_record_is_a_flag_and_a_field_of_the_runner(halved, causal_lm, capsys):
    rung = runner.default_config()
    with pytest.raises(SystemExit):
        cli.build_parser(rung).parse_args(["--help"])
    assert "--halved-loss" in capsys.readouterr().out
    cpu = Hardware(cuda_devices=0, cpu_cores=2)
    cfg = cli.parse(rung, ["--accelerator", "cpu", "--model", causal_lm, "--halved-loss"], hardware=cpu)
    assert cfg.uses(HALVED) and cfg.halved_loss and cfg.flags()["halved_loss"] is True
    assert "--halved-loss" in cfg.technique_flags() and not rung.halved_loss
    assert runner.resolve(cfg).task == "causal_lm"
    image = cli.parse(rung, ["--accelerator", "cpu", "--halved-loss"], hardware=cpu)
    with pytest.raises(UsageError, match="--halved-loss: causal LMs"):  # its tasks: not an image model
        runner.resolve(image)


def test_a_new_record_reaches_the_estimate_the_planner_and_the_speed_model(halved, causal_lm):
    cfg = runner.default_config().with_flags(model=causal_lm, seq_len=16, batch_size=2, halved_loss=True)
    um, model, blocks, _ = estimate.meta_user_model(causal_lm)
    plan = estimate.plan_of(cfg, blocks)
    est = estimate.estimate(model, um, plan, cfg.seq_len)
    assert plan.switched == ("halved_loss",) and halved.applied == ["Qwen2ForCausalLM"]
    assert est.error is None and est.to_dict()["assumptions"]["halved_loss"] is True

    planner = UserPlanner(causal_lm, 2, 16, precision="bf16-mixed")
    both = next(c for c in planner.choices if c.switched == ("fused_loss", "halved_loss"))
    assert " + fused loss + halved loss, " in both.label() and both.to_dict()["halved_loss"] is True
    assert cli.build_parser(runner.default_config()).parse_args(both.argv()).halved_loss
    run = step_calibration.Run("runs/x.json", "your_model", causal_lm, "eager", cfg.flags(), 0.1, 5)
    assert "halved_loss=True" in run.group

    alone = runner.default_config().with_flags(model="torchvision:resnet18", halved_loss=False)
    assert not estimate.plan_of(alone, ()).switched  # off: the estimate applies nothing


def test_a_new_record_is_a_flag_of_the_estimate_and_in_its_help(halved, causal_lm, capsys):
    with pytest.raises(SystemExit):
        arguments.build().parse_args(["--help"])
    assert "your model: causal LMs: half the loss" in " ".join(capsys.readouterr().out.split())
    _, args, mode = arguments.parse(["--model", causal_lm, "--halved-loss"])  # not refused as a rung's flag
    assert mode == arguments.YOURS and args.halved_loss is True

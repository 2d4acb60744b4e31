"""The checkpoint mode is an option of the checkpointing record (techniques.CHECKPOINT_MODE): the your-model
runner's flag and field, its check, its technique flags and the estimate's plan read it from there."""

from __future__ import annotations

import pytest
import torch

from fabric_memory_recipes import techniques
from fabric_memory_recipes.config import Hardware
from fabric_memory_recipes.planning.plan import Plan
from fabric_memory_recipes.planning.your_model.estimate import plan_of
from fabric_memory_recipes.training import cli
from fabric_memory_recipes.training.techniques import checkpointing
from fabric_memory_recipes.training.your_model import runner
from tests.tiny import tiny_swin_v2

CPU = Hardware(cuda_devices=0, cpu_cores=2)


def test_the_checkpoint_mode_is_the_checkpointing_records_option():
    option = techniques.CHECKPOINT_MODE
    assert techniques.ACTIVATION_CHECKPOINTING.options == (option,)
    assert (option.field, option.default, option.choices) == ("checkpoint_mode", "full", checkpointing.MODES)
    field = next(f for f in runner.YourModelConfig.flag_fields() if f.name == option.field)
    assert (field.default, field.metadata["choices"], field.metadata["help"]) == (
        option.default,
        option.choices,
        option.help,
    )
    assert Plan().checkpoint_mode == option.default
    assert option.label("selective", techniques.ACTIVATION_CHECKPOINTING) == "selective checkpointing"
    assert option.label("full", techniques.ACTIVATION_CHECKPOINTING) == "checkpointing"


def test_the_runner_and_the_estimate_read_the_option(capsys):
    rung = runner.default_config()
    cfg = cli.parse(
        rung, ["--accelerator", "cpu", "--checkpoint-blocks", "--checkpoint-mode", "selective"], hardware=CPU
    )
    assert cfg.technique_flags()[:3] == ["--checkpoint-blocks", "--checkpoint-mode", "selective"]
    assert plan_of(cfg, ("Bottleneck",)).checkpoint_mode == "selective"
    assert plan_of(rung, ("Bottleneck",)).checkpoint_mode == "full"
    with pytest.raises(SystemExit, match="2"):  # one line on stderr, exit 2
        cli.parse(rung, ["--accelerator", "cpu", "--checkpoint-mode", "selective"], hardware=CPU)
    assert (
        capsys.readouterr().err.split("error: ")[1]
        == "--checkpoint-mode selective goes with --checkpoint-blocks\n"
    )


def _gradients(model: torch.nn.Module, images: torch.Tensor) -> dict[str, torch.Tensor]:
    model(images).square().sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", checkpointing.MODES)
def test_a_swin_v2_step_under_checkpointing_gives_the_plain_gradients(mode):
    """A kept matmul output that the block then changes in place (Swin-V2's position-bias MLP) is recomputed
    from as it was made: the step runs under selective checkpointing, with the gradients of no checkpointing."""
    images = torch.randn(2, 3, 16, 16)
    plain = _gradients(tiny_swin_v2(), images)
    model = tiny_swin_v2()
    assert checkpointing.checkpoint_blocks(model, ("SwinTransformerBlockV2",), mode=mode) == 2
    checkpointed = _gradients(model, images)
    for (name, want), (wrapped, got) in zip(plain.items(), checkpointed.items(), strict=True):
        assert wrapped.replace(".block.", ".") == name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)

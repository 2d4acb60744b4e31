"""LoRA on your model (training/techniques/lora.py): the layers adapted per architecture, what trains, the
estimate of a LoRA step against a real CPU step, the flags, and a run of the runner (no network)."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from fabric_memory_recipes.config import Hardware, UsageError
from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.planning.plan import CUDA_WORKSPACE_BYTES, GB, Plan
from fabric_memory_recipes.planning.your_model import estimate
from fabric_memory_recipes.planning.your_model.sets import UserPlanner
from fabric_memory_recipes.training import cli, data
from fabric_memory_recipes.training.techniques import lora
from fabric_memory_recipes.training.your_model import models, runner
from tests.planning.test_your_model import real_step_peak, write_config
from tests.tiny import HF_BERT, HF_LLAMA


@pytest.fixture
def llama(tmp_path) -> str:
    """A 2-layer Llama causal LM of width 64, its embeddings tied."""
    return "hf:" + write_config(tmp_path / "llama", **HF_LLAMA)


@pytest.fixture
def bert(tmp_path) -> str:
    """A 2-layer BERT sequence classifier without dropout."""
    return "hf:" + write_config(tmp_path / "bert", **HF_BERT)


def adapted(ref: str, targets: str | None = None) -> tuple[torch.nn.Module, dict]:
    """The model of ``ref`` on the meta device with rank-4 adapters, and what add_adapters reported."""
    um = models.resolve(ref)
    with torch.device("meta"):
        model = models.build(um)
        blocks, _ = models.repeated_blocks(model)
        return model, lora.add_adapters(model, um.source, um.task, blocks, 4, targets)


def trainable(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_the_layers_adapted_and_trained_per_architecture(llama, bert):
    model, got = adapted(llama)  # a causal LM: attention and MLP, every layer; its output embedding frozen
    assert got["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert got["adapted_layers"] == 14 and got["heads"] == []
    assert trainable(model) and all(".lora_A." in n or ".lora_B." in n for n in trainable(model))
    assert got["trainable_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    model, got = adapted(bert)  # an encoder: its blocks' linears, not the pooler's; the classifier trains
    assert got["targets"] == ["query", "key", "value", "dense"] and got["adapted_layers"] == 12
    assert got["heads"] == ["classifier"] and "classifier.weight" in trainable(model)
    assert not model.bert.pooler.dense.weight.requires_grad and not hasattr(model.bert.pooler.dense, "lora_A")
    model, got = adapted("timm:test_vit")  # timm: the attention's qkv and proj
    assert got["targets"] == ["qkv", "proj"] and got["heads"] == ["head"]
    model, got = adapted("torchvision:vit_b_16")  # MultiheadAttention's out_proj is never called: its MLP
    assert got["targets"] == ["0", "3"] and got["adapted_layers"] == 24 and got["heads"] == ["heads.head"]
    assert not any("out_proj.lora" in n for n in trainable(model))
    with pytest.raises(UsageError, match="no Linear layer to adapt inside the repeated blocks"):
        adapted("torchvision:resnet18")
    model, got = adapted("torchvision:resnet18", "conv1,conv2")  # named: peft's Conv2d adapters
    assert got["adapted_layers"] == 17 and got["heads"] == ["fc"]
    with pytest.raises(UsageError, match="no module of this model has that name"):
        adapted(llama, "nope")


def test_the_flags_are_checked_in_one_line(bert):
    base = runner.default_config().with_flags(model=bert, accelerator="cpu")
    with pytest.raises(UsageError, match="--lora-targets goes with --lora-rank"):
        base.with_flags(lora_targets="query").checked(Hardware.planned())
    assert base.with_flags(lora_rank=8, lora_targets="query").technique_flags() == [
        "--lora-rank",
        "8",
        "--lora-targets",
        "query",
    ]


@pytest.mark.parametrize("ref", ["bert", "timm:test_vit"])
def test_a_simulated_lora_step_is_a_real_cpu_steps(ref, request):
    """Frozen weights get no gradient and no optimizer state, and the backward saves what the adapters'
    gradients and the inputs' need: the simulated peak of a LoRA step is the real CPU step's to a few KB."""
    ref = request.getfixturevalue(ref) if ref == "bert" else ref
    um = models.resolve(ref)
    torch.manual_seed(0)
    model = models.build(um)
    blocks, _ = models.repeated_blocks(model)
    lora.add_adapters(model, um.source, um.task, blocks, 4)
    plan = Plan(device="cpu", micro_batch_size=4, optimizer="adamw")
    if um.is_text:
        make, fn = estimate.text_batch(um, 4, 32)
        batch = make()
        batch = (torch.randint(3, 1000, batch[0].shape), batch[1], torch.randint(0, 2, (4,)))
    else:
        model.image_size = 96  # small images keep the CPU step quick
        batch = (torch.randint(0, 256, (4, 32, 32, 3), dtype=torch.uint8), torch.randint(0, 10, (4,)))
        fn = data.image_classification(96)
    est = estimate.simulate(model, plan, make_batch=lambda: batch, batch_fn=fn)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert est.parameters["trainable"] == n_train < est.parameters["total"] / 5
    assert est.static_gb["gradients"] == pytest.approx(n_train * 4 / GB)
    assert est.static_gb["optimizer_state"] == pytest.approx(2 * n_train * 4 / GB, rel=1e-3)
    params = [p for p in model.parameters() if p.requires_grad]
    measured = real_step_peak(model, torch.optim.AdamW(params, lr=1e-3, fused=True), batch, fn)
    assert est.peak_gb * 1e9 == pytest.approx(measured, abs=16 * 1024)


def test_the_estimate_and_fit_see_lora(llama, capsys):
    base = ["--model", llama, "--seq-len", "64", "--batch-size", "4", "--precision", "bf16-mixed"]

    def run(*extra):
        assert estimate_main([*base, *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    full, adapters = run(), run("--lora-rank", "4")
    assert adapters["parameters"]["trainable"] < full["parameters"]["trainable"] / 5
    assert adapters["static_gb"]["weights"] > full["static_gb"]["weights"]  # the adapters add weights
    assert adapters["static_gb"]["optimizer_state"] < full["static_gb"]["optimizer_state"] / 5
    assert adapters["peak_allocated_gb"] < full["peak_allocated_gb"]
    planner = UserPlanner(llama, 2, 64, lora_rank=4, lora_targets="q_proj,v_proj")
    assert planner.trainable == 2 * 4 * ((64 + 64) + (64 + 32))  # 2 layers: q_proj 64->64, v_proj 64->32
    for c in planner.choices[:3]:  # --fit's commands keep LoRA, which the runner parses back
        words = shlex.split(c.command)
        parsed = cli.build_parser(runner.default_config()).parse_args(words[2:])
        assert parsed.lora_rank == 4 and parsed.lora_targets == "q_proj,v_proj" and "+ LoRA" in c.label()
    c = planner.predict(planner.choices[0])  # its lower bound: every weight, the adapters' state only
    bound = (c.lower_bound_gb - c.overhead_gb) * GB - CUDA_WORKSPACE_BYTES
    assert c.techniques.optimizer == "adamw" and c.rung.precision == "bf16-mixed"  # fp32 weights, 2 moments
    assert (
        4 * planner.parameters + 8 * planner.trainable
        <= bound
        < 4 * planner.parameters + 8 * planner.parameters
    )
    assert c.lower_bound_gb <= c.card_gb

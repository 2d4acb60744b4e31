"""Rung 15's fused-qkv attention computes what torchvision's nn.MultiheadAttention computes.

- forward outputs and every parameter's gradient match the stock module: tightly in fp32, within bf16
  rounding in bf16 (the same weights, so any difference is the order of the arithmetic);
- the fused module holds the stock module's own parameter tensors, and a stock state dict loads into it;
- the estimator simulates the fused model (what rung 15 runs) and counts what a real forward saves;
- --float8 picks every linear layer but the head, and refuses a machine without float8 tensor cores.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from fabric_memory_recipes import planning
from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.training import data
from fabric_memory_recipes.training.techniques import attention, float8

STOCK_TO_FUSED = {
    "in_proj_weight": "qkv.weight",
    "in_proj_bias": "qkv.bias",
    "out_proj.weight": "proj.weight",
    "out_proj.bias": "proj.bias",
}


def small_vit(dtype=torch.float32) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=10
    )
    nn.init.normal_(model.heads.head.weight)  # torchvision zeroes the head: nothing would reach the blocks
    return model.to(dtype)


def stock_and_fused(dtype=torch.float32) -> tuple[nn.Module, nn.Module]:
    stock = small_vit(dtype)
    fused = copy.deepcopy(stock)
    assert attention.fuse_attention(fused) == 2
    return stock, fused


def fused_name(name: str) -> str:
    for old, new in STOCK_TO_FUSED.items():
        if name.endswith("self_attention." + old):
            return name[: -len(old)] + new
    return name


def forward_backward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(x)
    (out.float() ** 2).mean().backward()
    return out.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_attention_gives_the_stock_outputs_and_gradients(dtype, rtol):
    stock, fused = stock_and_fused(dtype)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    out_s, grads_s = forward_backward(stock, x)
    out_f, grads_f = forward_backward(fused, x)
    assert not any(isinstance(m, nn.MultiheadAttention) for m in fused.modules())
    scale = out_s.abs().max()
    assert (out_f - out_s).abs().max() <= rtol * scale
    assert {fused_name(n) for n in grads_s} == set(grads_f)
    for name, g in grads_s.items():
        assert g.norm() > 0, name
        diff = (grads_f[fused_name(name)] - g).norm()
        assert diff <= rtol * g.norm() + 1e-12, (name, float(diff), float(g.norm()))


def test_fused_attention_keeps_the_stock_parameters_and_loads_a_stock_state_dict():
    stock = small_vit()
    mha = stock.encoder.layers[0].self_attention
    weights = (mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight, mha.out_proj.bias)
    attention.fuse_attention(stock)
    new = stock.encoder.layers[0].self_attention
    assert all(
        a is b
        for a, b in zip((new.qkv.weight, new.qkv.bias, new.proj.weight, new.proj.bias), weights, strict=True)
    )

    other, fused = stock_and_fused()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)  # a checkpoint of a trained stock model
    fused.load_state_dict(other.state_dict())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fused(x), other(x), rtol=1e-5, atol=1e-6)


def test_fused_attention_refuses_what_it_does_not_compute():
    fused = attention.FusedQKVAttention.from_multihead(nn.MultiheadAttention(16, 2, batch_first=True))
    x, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="self-attention"):
        fused(x, y, y)
    with pytest.raises(ValueError, match="need_weights"):
        fused(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match="batch-first"):
        attention.FusedQKVAttention.from_multihead(nn.MultiheadAttention(16, 2))


def test_the_estimator_simulates_the_fused_model_as_a_real_forward_saves():
    _, fused = stock_and_fused()
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 256, (8, 32, 32, 3), dtype=torch.uint8, generator=g), torch.arange(8) % 10)
    fn = data.image_classification(fused.image_size)
    with planning.SavedTensorCounter([*fused.parameters(), *fused.buffers()]) as saved:
        out = fn(fused, batch)  # noqa: F841 - keeps what the forward saved alive until counted
    est = planning.simulate(fused, planning.Plan(device="cpu"), make_batch=lambda: batch, batch_fn=fn)
    assert est.activations_saved_bytes == saved.nbytes > 0


def test_rung_15_is_estimated_with_its_fused_attention(capsys):
    rung, _ = declared_rung("15_speed")
    assert rung.fused_attention
    model = planning.meta_ladder_model("vit_tiny", fused_attention=True)
    assert any(isinstance(m, attention.FusedQKVAttention) for m in model.modules())
    assert not any(
        isinstance(m, attention.FusedQKVAttention) for m in planning.meta_ladder_model("vit_tiny").modules()
    )
    assert estimate_main(["--recipe", "15_speed", "--model", "vit_tiny", "--batch-size", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_allocated_gb"] > 0


def test_float8_converts_every_linear_but_the_head_and_needs_a_gpu():
    _, fused = stock_and_fused()
    # per block: qkv, proj and the MLP's two layers; the head (10 outputs) stays
    assert float8.convert_modules(fused) == 2 * 4
    assert type(fused.heads.head) is nn.Linear
    assert type(fused.encoder.layers[0].self_attention.qkv).__name__ == "Float8Linear"
    with pytest.raises(UsageError, match="CUDA"):
        float8.convert(small_vit(), torch.device("cpu"))

"""The estimate of FSDP under mixed precision: what Lightning's FSDPStrategy gives FSDP (low-precision
unsharded parameters, fp32 shards) against FSDP2 without a MixedPrecisionPolicy (fp32 gathered, autocast's
copies), on fake tensors (CPU only)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric_memory_recipes import planning

GB = 1e9


class TwoLinear(nn.Module):
    """Every tensor a multiple of 512 bytes in fp32 and bf16, so allocator rounding cannot blur sums."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 512)
        self.b = nn.Linear(512, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _make():
    return (torch.empty(16, 256),)


def _loss(model, batch):
    return (model(batch[0]).float().pow(2).mean(),)


def sharded(sharding: str, precision: str = "bf16-mixed", **fields) -> planning.Estimate:
    plan = planning.Plan(
        device="cuda",
        precision=precision,
        micro_batch_size=16,
        optimizer="adam",
        optimizer_impl="foreach",
        sharding=sharding,
        shard_units=("Linear",),
        world_size=4,
        **fields,
    )
    return planning.simulate(TwoLinear(), plan, make_batch=_make, batch_fn=_loss)


def test_fsdp_mixed_precision_gathers_bf16_views_and_keeps_fp32_shards():
    """Lightning's FSDPStrategy with bf16-mixed: MixedPrecision(param_dtype=bf16): the gathered units are
    bf16 and autocast finds no fp32 weight to copy; the shards, their gradients and Adam's state stay fp32."""
    model = TwoLinear()
    n, largest = sum(p.numel() for p in model.parameters()), max(p.numel() for p in model.parameters()) + 512
    est = sharded("fsdp")
    c = est.components_gb
    assert est.static_gb == pytest.approx(
        {"weights": 4 * n / 4 / GB, "gradients": 4 * n / 4 / GB, "optimizer_state": 8 * n / 4 / GB}
    )
    assert (c["parameters"], c["optimizer_state"]) == pytest.approx(
        (4 * n / 4 / GB, 8 * n / 4 / GB), abs=1e-9
    )
    # the unit in use and the prefetched one, each in bf16 (its unsharded gradients are the step's own:
    # planning/simulation/sharded.py)
    assert c["gathered_parameters"] == pytest.approx(2 * 2 * largest / GB, abs=1e-9)
    assert c["weight_copies"] == 0


def test_fsdp2_without_a_mixed_precision_policy_gathers_fp32():
    """FSDP2 here has no MixedPrecisionPolicy: fp32 units are gathered (and autocast copies them). The unit in
    use and the prefetched one: its unsharded gradients are the step's own (planning/simulation/sharded.py)."""
    model = TwoLinear()
    largest = max(p.numel() for p in model.parameters()) + 512
    fsdp, fsdp2 = sharded("fsdp"), sharded("fsdp2")
    assert fsdp2.components_gb["gathered_parameters"] == pytest.approx(2 * 4 * largest / GB, abs=1e-9)
    assert fsdp2.static_gb == fsdp.static_gb  # the same fp32 shards either way
    assert fsdp.peak_gb < fsdp2.peak_gb


def test_fsdp2_with_its_mixed_precision_policy_gathers_bf16_as_fsdp_does():
    """Your model's fast mode: fully_shard with MixedPrecisionPolicy(param_dtype=bf16) gathers bf16 units, so
    autocast has no weight to copy; the shards stay fp32."""
    model = TwoLinear()
    largest = max(p.numel() for p in model.parameters()) + 512
    fsdp, fsdp2 = sharded("fsdp"), sharded("fsdp2", mixed_precision_policy=True)
    assert fsdp2.components_gb["gathered_parameters"] == pytest.approx(2 * 2 * largest / GB, abs=1e-9)
    assert fsdp2.components_gb["weight_copies"] == 0
    assert fsdp2.static_gb == fsdp.static_gb
    with pytest.raises(ValueError, match="mixed_precision_policy"):
        planning.Plan(sharding="fsdp", mixed_precision_policy=True)


def test_true_half_precision_under_fsdp_is_unchanged():
    """bf16-true: the parameters are bf16 from the start, shards included."""
    model = TwoLinear()
    n = sum(p.numel() for p in model.parameters())
    est = sharded("fsdp", "bf16-true")
    assert est.static_gb["weights"] == pytest.approx(2 * n / 4 / GB)
    assert est.components_gb["weight_copies"] == 0

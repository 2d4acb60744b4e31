"""Rung 16's weights on the CPU (fabric_memory_recipes/training/techniques/weights_offload.py), on the CPU: the
streamed model gives the parameters of an ordinary optimizer step, frees each block's weights when it is
done with them, and evaluates like the model it came from."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torchvision.models.vision_transformer import VisionTransformer

from fabric_memory_recipes.training import models
from fabric_memory_recipes.training.techniques.checkpointing import CheckpointedBlock
from fabric_memory_recipes.training.techniques.weights_offload import WeightsOnCPU

LR = 1e-3
STEPS = 4


def _model(checkpointing: bool = False, layers: int = 2) -> torch.nn.Module:
    """vit_tiny's shape (``layers`` blocks), the same start every time."""
    torch.manual_seed(0)
    model = VisionTransformer(
        32, 8, num_layers=layers, num_heads=2, hidden_dim=64, mlp_dim=128, num_classes=10
    )
    if checkpointing:
        for i, block in enumerate(models.blocks(model)):
            model.encoder.layers[i] = CheckpointedBlock(block)
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
        for _ in range(STEPS)
    ]


def _streamed(model: torch.nn.Module, dtype: torch.dtype) -> WeightsOnCPU:
    adam = lambda params: torch.optim.Adam(params, lr=LR, fused=True)  # noqa: E731
    return WeightsOnCPU(model, models.blocks(model), "cpu", adam, dtype=dtype)


def _train_streamed(model, dtype) -> tuple[dict[str, torch.Tensor], WeightsOnCPU]:
    streamed = _streamed(model, dtype)
    for x, y in _batches():
        F.cross_entropy(model(x.to(dtype)), y).backward()
    return {n: t.clone() for n, t in streamed.master_parameters().items()}, streamed


def _train_reference(model, dtype) -> dict[str, torch.Tensor]:
    """The ordinary step: fp32 masters, forward and backward on a copy in ``dtype``, one fused Adam over all of them."""
    master = dict(model.named_parameters())
    optimizer = torch.optim.Adam(master.values(), lr=LR, fused=True)
    low = copy.deepcopy(model).to(dtype)
    for x, y in _batches():
        with torch.no_grad():
            for n, p in low.named_parameters():
                p.copy_(master[n])
        F.cross_entropy(low(x.to(dtype)), y).backward()
        for n, p in low.named_parameters():
            master[n].grad = p.grad.float()
            p.grad = None
        optimizer.step()
    return {n: p.detach().clone() for n, p in master.items()}


@pytest.mark.parametrize(
    ("dtype", "checkpointing", "atol"),
    [(torch.float32, False, 1e-6), (torch.bfloat16, True, 1e-5)],
    ids=["fp32-transfers", "bf16-transfers-checkpointed"],
)
def test_streamed_weights_equal_the_ordinary_adam_step(dtype, checkpointing, atol):
    start = {n: p.detach().clone() for n, p in _model(checkpointing).named_parameters()}
    reference = _train_reference(_model(checkpointing), dtype)
    streamed, offloader = _train_streamed(_model(checkpointing), dtype)
    offloader.close()
    assert streamed.keys() == reference.keys() == start.keys()
    moved = max((reference[n] - start[n]).abs().max().item() for n in start)
    assert moved > 100 * atol, "the steps changed the weights by more than the tolerance"
    for n in reference:
        assert torch.allclose(streamed[n], reference[n], rtol=0, atol=atol), (
            n,
            (streamed[n] - reference[n]).abs().max().item(),
        )


def test_blocks_are_freed_after_use_and_the_root_stays():
    model = _model(checkpointing=True)
    streamed = _streamed(model, torch.bfloat16)
    x, y = _batches()[0]
    blocks = [u.device_flat.untyped_storage() for u in streamed.units[1:]]
    assert all(s.nbytes() == 0 for s in blocks), "nothing streamed before the first forward"
    loss = F.cross_entropy(model(x.bfloat16()), y)
    assert blocks[-1].nbytes() > 0, "the last block is prefetched for backward"
    assert all(s.nbytes() == 0 for s in blocks[:-1])
    loss.backward()
    assert all(s.nbytes() == 0 for s in blocks), "every block's weights are freed after its backward"
    assert streamed.units[0].device_flat.untyped_storage().nbytes() > 0
    assert all(p.grad is None for p in model.parameters()), "each gradient leaves at once"
    streamed.close()


def test_evaluation_uses_the_updated_weights():
    model = _model()
    streamed = _streamed(model, torch.float32)
    x, y = _batches()[0]
    F.cross_entropy(model(x), y).backward()
    updated = _model()
    updated.load_state_dict(streamed.master_parameters())
    with torch.no_grad():
        assert torch.allclose(model(x), updated(x), atol=1e-6)
    streamed.close()


def test_at_most_two_blocks_are_on_the_device_at_once_as_the_estimate_assumes(monkeypatch):
    """The streamed model never holds more than the block in use and the prefetched one (the estimator's
    simulated step holds what it holds: tests/planning/simulation/test_streamed_weights.py)."""
    from fabric_memory_recipes import planning

    model = _model(checkpointing=True, layers=5)
    streamed = _streamed(model, torch.bfloat16)
    blocks = [u.device_flat.untyped_storage() for u in streamed.units[1:]]
    most = []
    fetch = WeightsOnCPU._fetch

    def counting_fetch(self, unit):
        fetch(self, unit)
        most.append(sum(s.nbytes() > 0 for s in blocks))

    monkeypatch.setattr(WeightsOnCPU, "_fetch", counting_fetch)
    for x, y in _batches()[:2]:
        F.cross_entropy(model(x.bfloat16()), y).backward()
    streamed.close()
    assert max(most) == planning.Plan().prefetch_units

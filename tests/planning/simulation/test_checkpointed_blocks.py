"""The simulation checkpoints blocks with the run's own policy (training/techniques/checkpointing.py): a model
whose blocks change a kept matmul output in place simulates under selective checkpointing as it runs."""

from __future__ import annotations

import torch

from fabric_memory_recipes import planning
from tests.tiny import tiny_swin_v2


def _activations(checkpoint_mode: str | None) -> float:
    blocks = ("SwinTransformerBlockV2",) if checkpoint_mode else ()
    plan = planning.Plan(activation_checkpointing=blocks, checkpoint_mode=checkpoint_mode or "full")
    est = planning.simulate(
        tiny_swin_v2(),
        plan,
        make_batch=lambda: (torch.empty(2, 3, 16, 16),),
        batch_fn=lambda m, b: (m(b[0]).square().sum(),),
    )
    assert est.error is None
    return est.components_gb["activations"]


def test_a_swin_v2_step_simulates_under_selective_checkpointing():
    """Swin-V2's position-bias MLP rewrites a kept linear output (``ReLU(inplace=True)``): the selective step
    is simulated, and keeps more than full checkpointing and less than no checkpointing."""
    assert _activations("full") < _activations("selective") < _activations(None)

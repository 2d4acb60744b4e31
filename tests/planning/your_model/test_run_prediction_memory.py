"""The runner's own prediction (planning/your_model/estimate.py ``for_user_run``) holds no copy of the run's
model: the copy with the fused loss switched on is made on the meta device. A real copy, kept for the
simulation's reuse, held a 0.36 B Llama's 1.47 GB of weights on the GPU for the whole run beside the model,
and the --fit pick it predicted ran out of memory on its card."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

from fabric_memory_recipes.config import Hardware
from fabric_memory_recipes.planning.your_model.estimate import for_user_run, meta_user_model
from fabric_memory_recipes.training.techniques import lora
from fabric_memory_recipes.training.your_model import models, runner
from tests.tiny import causal_lm_config


def _cpu_bytes() -> int:
    """Bytes of the CPU storages that live tensors hold (each storage once)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not is_fake(obj):
            storage = obj.untyped_storage()
            if storage.data_ptr():
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_runs_own_prediction_copies_none_of_its_weights(tmp_path, lora_rank):
    pytest.importorskip("peft")
    (tmp_path / "config.json").write_text(
        json.dumps(causal_lm_config(hidden_size=256, intermediate_size=1024, vocab_size=4000))
    )
    ref = f"hf:{tmp_path}"
    flags = dict(
        model=ref, seq_len=32, batch_size=2, accelerator="cuda", fused_loss=True, lora_rank=lora_rank
    )
    cfg = runner.default_config().with_flags(**flags).checked(Hardware.planned())
    assert cfg.fused_loss
    um, _, blocks, _ = meta_user_model(ref, lora_rank)
    model = models.build(um)  # the run's model, with real weights (here on the CPU)
    if lora_rank:
        lora.add_adapters(model, um.source, um.task, blocks, lora_rank)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    before = _cpu_bytes()
    est, _ = for_user_run(model, um, cfg, blocks)
    gc.collect()
    assert est.error is None and est.peak_gb > 0
    assert _cpu_bytes() - before < weights / 4, "the prediction keeps a copy of the model's weights"

"""BigBird's random attention blocks drawn once (training/hf_models.py ``fix_random_blocks``, fast mode of
recipes/bonus_bigbird_after.py): the same blocks, so the same loss and gradients, as Hugging Face's own
redrawing at every forward pass, with the numpy draw run once per layer, and a layer compiled afterwards
traced in one piece."""

from __future__ import annotations

import copy

import torch
from transformers.models.big_bird.modeling_big_bird import BigBirdBlockSparseAttention

from fabric_memory_recipes.training import hf_models

SEQ = 128  # block-sparse attention for bigbird-tiny (blocks of 8 tokens)


def _bigbird():
    torch.manual_seed(0)
    model = hf_models.build_model(hf_models.SPECS["bigbird-tiny"], False).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0  # the two models must see the same computation
    ids = torch.randint(8, 1000, (2, SEQ))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 90:] = 0
    return model, dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1]))


def _loss_and_gradients(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_blocks_drawn_once_give_the_redrawing_models_loss_and_gradients(monkeypatch):
    model, batch = _bigbird()
    fixed = copy.deepcopy(model)
    draws = []
    original = BigBirdBlockSparseAttention._bigbird_block_rand_mask_with_head

    def counted(self, *args, **kwargs):
        draws.append(id(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BigBirdBlockSparseAttention, "_bigbird_block_rand_mask_with_head", counted)
    assert hf_models.fix_random_blocks(fixed, SEQ) == 2  # one attention module per layer
    assert len(draws) == 2  # drawn now, for SEQ, in training mode
    for _ in range(2):
        want, got = _loss_and_gradients(model, batch), _loss_and_gradients(fixed, batch)
        assert torch.equal(want[0], got[0])
        assert all(torch.equal(a, b) for a, b in zip(want[1], got[1], strict=True))
    assert len(draws) == 2 + 2 * 2  # the redrawing model drew at each of its two passes; the fixed one never


def test_a_layer_compiled_after_the_draws_is_one_graph(dynamo_on):
    """Without the draws made first, numpy's draw breaks a compiled layer's graph (and recompiles it)."""
    from torch._dynamo.utils import counters

    model, batch = _bigbird()
    hf_models.fix_random_blocks(model, SEQ)
    model.bert.encoder.layer[0].compile(backend="eager")  # what compile_repeated does, without the compiler
    counters.clear()
    with torch.no_grad():
        model(**batch)
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["graph_break"]) == {}

"""Fast mode's CUDA graph for a causal LM (``recipes/your_model.py --cuda-graphs``), on a CPU.

A CUDA graph cannot wait for the host. A causal LM's step would, at the 2-D padding mask that Hugging Face
checks on the host (``attention_masks.capturable``: no mask under SDPA, the samples being padded at their end;
the 4-D mask with the causal triangle for eager attention) and at the token accuracy's selection of
completion tokens (``text.causal_lm(..., train_accuracy=False)``). Here: each path gives the 2-D path's loss
and gradients with nothing read on the host, for the model's own loss and the fused loss; the captured step,
replayed by fast mode's bookkeeping (the graph stood in for, as in tests/training/test_graphs.py), trains as
the eager step does; and the runner's fast mode captures a causal LM's step by default, other text models'
never.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

from fabric_memory_recipes.config import Hardware, UsageError
from fabric_memory_recipes.training import data, loop, loop_plumbing
from fabric_memory_recipes.training.data import attention_masks, text, text_samples
from fabric_memory_recipes.training.techniques import fused_loss
from fabric_memory_recipes.training.your_model import models, runner
from tests.tiny import HF_BERT, causal_lm_config, make_log, settings
from tests.training.test_bonus_fast_mode import HostReads, loss_and_gradients
from tests.training.test_graphs import FakeGraph, FakeStepGraph

VOCAB, TOKENS = 1000, 24


@pytest.fixture(scope="module")
def lm_ref(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("graph_lm")
    (folder / "config.json").write_text(json.dumps(causal_lm_config(vocab_size=VOCAB)))
    return f"hf:{folder}"


def _model(lm_ref: str, attn: str = "sdpa"):
    torch.manual_seed(0)
    model = models.build(models.resolve(lm_ref))
    model.config._attn_implementation = attn
    return model.train()


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(8, VOCAB, (3, TOKENS))
    mask = torch.ones(3, TOKENS, dtype=torch.long)
    mask[0, 15:] = 0  # right-padded, as the SFT samples are
    mask[2, 6:] = 0
    labels = ids.masked_fill(mask == 0, text.IGNORE_INDEX)
    labels[:, :4] = text.IGNORE_INDEX  # the prompt's tokens are not learned
    return ids, mask, labels


class HostWaits(HostReads):
    """Counts the host reads, and the selections by a boolean mask (a size the host waits for)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) == "aten.index.Tensor":
            self.count += any(i is not None and i.dtype == torch.bool for i in args[1])
        return super().__torch_dispatch__(func, types, args, kwargs)


def _loss_and_gradients(model, batch_fn, batch):
    return loss_and_gradients(model, batch_fn, batch, HostWaits)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_4d_causal_mask_gives_the_2d_masks_loss_and_gradients_without_host_reads(lm_ref, attn):
    model = _model(lm_ref, attn)
    ids, mask, labels = _batch()
    reference = copy.deepcopy(model)  # its attention left as it is
    graphed = attention_masks.capturable(functools.partial(text.causal_lm, train_accuracy=False), model)
    want_impl = attention_masks.CAUSAL_SDPA if attn == "sdpa" else "eager"
    assert model.config._attn_implementation == want_impl  # SDPA: the causal flag alone; eager: the 4-D mask
    for m in (mask, torch.ones_like(mask)):  # padded, and nothing padded (where a 2-D mask is dropped)
        want = _loss_and_gradients(reference, text.causal_lm, (ids, m, labels))
        got = _loss_and_gradients(model, graphed, (ids, m, labels))
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        assert len(got[1]) == len(want[1]) > 0
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert got[2] == 0 and got[3] is None  # nothing read on the host, no token accuracy: capturable
        assert want[2] >= 1 and want[3] is not None  # the selection (and SDPA's 2-D mask check) wait
    with torch.no_grad():  # evaluation (eager, never captured) keeps its token accuracy
        _, predicted, targets = graphed(model, (ids, mask, labels))
    assert predicted.shape == targets.shape == (int((labels[:, 1:] != text.IGNORE_INDEX).sum()),)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_fused_loss_in_the_captured_form_reads_nothing_on_the_host(lm_ref, attn):
    plain = _model(lm_ref, attn)
    want = _loss_and_gradients(plain, text.causal_lm, _batch())
    fused = copy.deepcopy(plain)
    batch_fn = attention_masks.capturable(fused_loss.fused_batch_fn(fused), fused)
    got = _loss_and_gradients(fused, batch_fn, _batch())
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    assert got[2] == 0 and got[3] is None


class HostCopies(HostWaits):
    """Counts the host reads and waits, and the tensors made from host data (each a copy to the GPU there)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.lift_fresh.default
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_a_model_with_its_own_attention_code_keeps_its_2d_mask_and_copies_nothing_from_the_host(tmp_path):
    """BLOOM builds its ALiBi biases from the 2-D mask (a 4-D one stopped its first step on an H200), and
    Hugging Face's eager mask copies a zero from the host (the capture refused it there): off the attention
    interface the 2-D mask stays and the mask is made on the device, with the 2-D path's loss and gradients."""
    bloom = {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "hidden_size": 64, "n_head": 4,
             "n_layer": 2, "vocab_size": VOCAB, "hidden_dropout": 0.0, "attention_dropout": 0.0}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(bloom))
    model = _model(f"hf:{tmp_path}", "eager")
    ids, mask, labels = _batch()
    want = loss_and_gradients(copy.deepcopy(model), text.causal_lm, (ids, mask, labels), HostCopies)
    assert want[2] >= 2  # the selection of the accuracy's tokens, and the eager mask's zero from the host
    for fused in (False, True):  # the model's own loss, then the fused loss (its head replaced)
        batch_fn = (
            fused_loss.fused_batch_fn(model)
            if fused
            else functools.partial(text.causal_lm, train_accuracy=False)
        )
        captured = attention_masks.capturable(batch_fn, model)
        got = loss_and_gradients(model, captured, (ids, mask, labels), HostCopies)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
        assert got[2] == 0 and got[3] is None


def test_the_causal_lm_samples_are_padded_at_their_end(lm_ref):
    """What lets SDPA's causal flag stand in for the padding mask (attention_masks.causal_only)."""
    ids, mask, labels = text_samples.sft_example([5, 6, 7], [8, 9], max_length=8, pad_id=0)
    assert mask.tolist() == [1] * 5 + [0] * 3 and labels[5:].tolist() == [text.IGNORE_INDEX] * 3
    splits = text.load("synthetic", None, TOKENS, models.token_ids(models.resolve(lm_ref)), lambda: None,
                       task="causal_lm")  # fmt: skip
    for i in range(20):
        m = splits.train[i][1]
        assert torch.equal(m, torch.sort(m, descending=True).values)  # ones, then zeros
    assert any(splits.train[i][1].min() == 0 for i in range(20))  # some are padded


def _train(fabric, model, splits, batch_fn, graphed, monkeypatch):
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, optimizer = fabric.setup(model, optimizer)
    torch.manual_seed(2)  # the same shuffle
    train, _, _ = data.build_loaders(splits.datasets(), 2, 2)
    if graphed:
        monkeypatch.setattr(loop_plumbing, "StepGraph", FakeStepGraph)
    log = make_log()
    cfg = settings(accumulation_steps=2, max_steps=5, log_every=1, cuda_graphs=graphed)
    loop.fit(fabric, model, optimizer, fabric.setup_dataloaders(train), batch_fn, cfg, log, num_classes=VOCAB)
    monkeypatch.undo()
    return model, log


def test_a_causal_lms_replayed_step_trains_as_its_eager_step(fabric, lm_ref, monkeypatch):
    model = _model(lm_ref)
    splits = text.load("synthetic", None, TOKENS, models.token_ids(models.resolve(lm_ref)), lambda: None,
                       task="causal_lm")  # fmt: skip
    FakeGraph.captures, FakeStepGraph.replays = 0, []
    eager, log_e = _train(fabric, model, splits, text.causal_lm, False, monkeypatch)
    graphed = copy.deepcopy(model)
    graphed_fn = attention_masks.capturable(functools.partial(text.causal_lm, train_accuracy=False), graphed)
    fast, log_f = _train(fabric, graphed, splits, graphed_fn, True, monkeypatch)
    assert FakeGraph.captures == 1 and len(FakeStepGraph.replays) == 5 - 2  # 2 warm-up steps, then replays
    assert log_f.optimizer_steps == log_e.optimizer_steps == 5 and log_f.micro_batches == 10
    for p, q in zip(fast.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert log_f.loss["last"] == pytest.approx(log_e.loss["last"], rel=1e-4)
    assert log_e.accuracy["train"] is not None and log_f.accuracy["train"] is None  # no selection in a graph
    assert not torch.equal(next(fast.parameters()), next(model.parameters()))  # it trained


def test_the_runner_captures_a_causal_lm_by_default_and_other_text_models_never(lm_ref, tmp_path):
    """Fast mode on one GPU captures a causal LM's step (each lever shown equal to eager in a graph on an H200:
    results/published/h200/your-model-speed/graphs/); --no-cuda-graphs, several GPUs, eager mode and the
    step in backward leave it out."""
    gpu = Hardware(cuda_devices=1, cpu_cores=2, bf16_supported=lambda: True)
    base = runner.default_config().with_flags(model=lm_ref, seq_len=TOKENS, batch_size=2, accelerator="cuda")
    fast = base.checked(gpu)
    assert (fast.mode, fast.compile, fast.cuda_graphs) == ("fast", True, True)  # the default: the graph too
    assert base.with_flags(cuda_graphs=False).checked(gpu).cuda_graphs is False
    assert base.with_flags(mode="eager").checked(gpu).cuda_graphs is False
    assert base.with_flags(optimizer_in_backward=True).checked(gpu).cuda_graphs is False
    asked = base.with_flags(cuda_graphs=True).checked(gpu)
    assert (asked.compile, asked.cuda_graphs) == (True, True)
    with pytest.raises(UsageError, match="--cuda-graphs: this runner's step in backward"):
        base.with_flags(cuda_graphs=True, optimizer_in_backward=True).checked(gpu)
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(
        json.dumps(HF_BERT)
    )  # a classifier, as the runner reads it
    bert = base.with_flags(model=f"hf:{tmp_path / 'bert'}", cuda_graphs=True)
    with pytest.raises(UsageError, match="--cuda-graphs: a classification model's steps are not captured"):
        bert.checked(gpu)
    assert bert.with_flags(cuda_graphs=None).checked(gpu).cuda_graphs is False

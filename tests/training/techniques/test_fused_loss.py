"""The fused linear cross-entropy (training/techniques/fused_loss.py) against the plain loss: the same
loss and gradients from a Hugging Face causal LM's own forward, and refusals for what it cannot fuse."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PhiConfig, PhiForCausalLM

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.training.data.text_samples import IGNORE_INDEX
from fabric_memory_recipes.training.techniques import fused_loss
from tests.conftest import free_port, result, submit


@pytest.mark.parametrize(
    ("vocab", "width", "rows"),
    [(1000, 32, 16), (4000, 96, 32)],  # Liger's chunks; 4 x Liger's (a third of the hidden size)
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])  # Phi's head has one
def test_chunked_loss_and_gradients_equal_the_plain_ones(vocab, width, rows, with_bias):
    torch.manual_seed(0)
    hidden = torch.randn(300, width, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, width, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, vocab, (300,))
    targets[::7] = IGNORE_INDEX
    assert fused_loss.chunk_rows(300, vocab, width) == rows  # several chunks
    inputs = (hidden, weight, bias) if with_bias else (hidden, weight)
    plain = F.cross_entropy(F.linear(hidden, weight, bias), targets, ignore_index=IGNORE_INDEX)
    g_plain = torch.autograd.grad(plain * 3, inputs)
    fused = fused_loss.linear_cross_entropy(hidden, weight, targets, bias)
    g_fused = torch.autograd.grad(fused * 3, inputs)
    assert torch.allclose(fused, plain, rtol=1e-10)
    for a, b in zip(g_fused, g_plain, strict=True):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize(
    ("shape", "liger", "torch_rows", "torch_on_cuda"),
    [
        ((8184, 151936, 896), 64, 256, True),  # Qwen2 0.2 B: Liger's chunks read the weight 4 x as often
        ((8184, 49152, 960), 256, 256, False),  # the Llama 0.36 B: the same chunks
        ((8184, 50257, 768), 128, 256, False),  # GPT-2 small: 2 x, Liger stays
        ((3, 151936, 896), 1, 4, True),  # a few tokens: no more than their next power of two
    ],
)
def test_the_torch_paths_chunks_hold_at_least_a_third_of_the_hidden_size(
    shape, liger, torch_rows, torch_on_cuda
):
    assert fused_loss.liger_rows(*shape) == liger
    assert fused_loss.chunk_rows(*shape) == torch_rows
    assert fused_loss.torch_reads_less(*shape) is torch_on_cuda


def test_fp32_hidden_states_of_a_bf16_true_model_meet_its_bf16_projection():
    """Fabric hands a bf16-true model's outputs back in fp32 (its precision converts them), so the fused
    loss got fp32 hidden states and the bf16 projection weight: "expected m1 and m2 to have the same
    dtype" (bonus_llm_finetune.py --all). It computes in the projection's dtype, as the model's head would."""
    torch.manual_seed(0)
    weight = torch.randn(300, 16, dtype=torch.bfloat16, requires_grad=True)
    hidden = torch.randn(40, 16, requires_grad=True)  # fp32
    targets = torch.randint(0, 300, (40,))
    loss = fused_loss.linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    plain = F.cross_entropy((hidden.detach().bfloat16() @ weight.detach().t()).float(), targets)
    assert torch.allclose(loss.float(), plain, rtol=2e-2)
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16


def _phi() -> PhiForCausalLM:
    """Phi's output projection has a bias (which the fused loss adds and trains)."""
    config = PhiConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=500
    )
    torch.manual_seed(0)
    model = PhiForCausalLM(config)
    with torch.no_grad():
        model.lm_head.bias.normal_()  # not zeros: the bias must matter to the loss
    return model


def _llama(tie: bool = True) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("make", [_llama, _phi], ids=["llama-tied", "phi-head-bias"])
def test_a_causal_lm_through_its_output_embeddings_learns_as_with_its_own_loss(make):
    plain = make()
    fused = copy.deepcopy(plain)
    head = fused_loss.fuse_output_embeddings(fused)
    assert fused.get_output_embeddings() is head
    assert list(fused.state_dict()) == list(plain.state_dict())  # a checkpoint loads into the plain model
    tied = plain.config.tie_word_embeddings
    assert (head.weight is fused.get_input_embeddings().weight) is tied
    ids = torch.randint(0, 500, (2, 16))
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # the prompt
    batch = (ids, torch.ones_like(ids), labels)
    expected = plain(input_ids=ids, attention_mask=batch[1], labels=labels).loss
    loss, predicted, targets = fused_loss.causal_lm_loss(head)(fused, batch)
    assert predicted is None and targets is None  # training: no logits
    assert torch.allclose(loss, expected, rtol=1e-5)
    expected.backward()
    loss.backward()
    for (name, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name
    with torch.no_grad():  # evaluation: the predicted tokens, chunk by chunk, as the logits' argmax
        _, predicted, targets = fused_loss.causal_lm_loss(head)(fused, batch)
        logits = plain(input_ids=ids).logits[:, :-1].reshape(-1, 500)
    keep = labels[:, 1:].reshape(-1) != IGNORE_INDEX
    assert torch.equal(predicted, logits[keep].argmax(-1)) and torch.equal(
        targets, labels[:, 1:].reshape(-1)[keep]
    )


def test_what_cannot_be_fused_is_one_line():
    with pytest.raises(UsageError, match="no output embeddings"):
        fused_loss.fuse_output_embeddings(torch.nn.Linear(4, 4))
    model = _llama(tie=False)
    model.register_buffer("final_logits_bias", torch.zeros(1, 500))  # BART adds one after its projection
    with pytest.raises(UsageError, match="bias after its output projection"):
        fused_loss.fuse_output_embeddings(model)
    model = _llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(UsageError, match="rescales its logits"):
        fused_loss.fuse_output_embeddings(model)


def _fsdp1_case(model, unit: type, make_batch_fn, batch, plain_loss_of) -> tuple:
    """``model``'s fused loss (``make_batch_fn(head, model)``'s) sharded by FSDP (FSDP1, each ``unit`` its own,
    the original parameters kept, as Fabric's FSDPStrategy wraps your model in eager mode) against
    ``plain_loss_of`` a whole copy: (loss, plain loss, largest gradient difference)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    plain = copy.deepcopy(model)  # before the fusion: the same weights
    plain_loss = plain_loss_of(plain)
    plain_loss.backward()
    batch_fn = make_batch_fn(fused_loss.fuse_output_embeddings(model), model)
    sharded = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({unit}), use_orig_params=True, device_id="cpu")
    loss, _, _ = batch_fn(sharded, batch)
    loss.backward()  # both ranks saw the same batch: the averaged gradients are the plain ones
    with FSDP.summon_full_params(sharded, with_grads=True):  # the original parameters, in order
        pairs = zip(sharded.parameters(), plain.parameters(), strict=True)
        worst = max((a.grad - b.grad).abs().max().item() for a, b in pairs if b.grad is not None)
    return float(loss), float(plain_loss), worst


def _sharded_rank(rank: int, port: int, queue) -> None:
    """One of two gloo processes: a causal LM's (Llama) and an encoder-decoder's (T5) fused loss under FSDP1;
    puts {case: (loss, plain loss, largest gradient difference), or the exception's repr}."""
    import torch.distributed as dist
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.t5.modeling_t5 import T5Block

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # the prompt
    targets = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(2))
    targets[:, 6:] = IGNORE_INDEX
    mask = torch.ones_like(ids)
    config = T5Config(
        vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    cases = {
        "causal": lambda: _fsdp1_case(
            _llama(tie=False),
            LlamaDecoderLayer,
            lambda head, model: fused_loss.causal_lm_loss(head),
            (ids, mask, labels),
            lambda plain: plain(input_ids=ids, attention_mask=mask, labels=labels).loss,
        ),
        "seq2seq": lambda: _fsdp1_case(
            T5ForConditionalGeneration(config).eval(),  # no dropout: the two losses comparable
            T5Block,
            lambda head, model: fused_loss.seq2seq_lm_loss(head, model.prepare_decoder_input_ids_from_labels),
            (ids, mask, targets),
            lambda plain: plain(input_ids=ids, attention_mask=mask, labels=targets).loss,
        ),
    }
    outcomes = {}
    try:
        for case, run in cases.items():
            try:
                outcomes[case] = run()
            except Exception as error:  # the parent asserts on what comes back
                outcomes[case] = repr(error)
    finally:
        queue.put(outcomes)
        dist.destroy_process_group()


# The two gloo processes run in the background from the start of the session (conftest.submit), while the
# in-process tests go on: the tests below wait for them at the end.
BACKGROUND_TESTS = {"test_under_fsdp_the_loss_is_made_where_the_projection_is_gathered"}
BACKGROUND_PRIORITY = 20  # two processes, about 10 s


def start_background_jobs() -> None:
    submit("fused-loss-fsdp1", _sharded_ranks)


@pytest.fixture(scope="module")
def under_fsdp1() -> list[dict]:
    return result("fused-loss-fsdp1")


def _sharded_ranks() -> list[dict]:
    """What each of the two gloo processes of :func:`_sharded_rank` put (one spawn for both cases)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    queue, port = context.Queue(), free_port()
    ranks = [context.Process(target=_sharded_rank, args=(rank, port, queue)) for rank in range(2)]
    for process in ranks:
        process.start()
    outcomes = [queue.get(timeout=240) for _ in ranks]
    for process in ranks:
        process.join(60)
    return outcomes


@pytest.mark.parametrize("case", ["causal", "seq2seq"])
def test_under_fsdp_the_loss_is_made_where_the_projection_is_gathered(under_fsdp1, case):
    """Under FSDP the projection's weight outside the model's forward is the rank's flat shard: the loss
    made there failed on every rank (a GPT-NeoX --fit set on 2 GPUs); made in the forward, a causal LM's and
    an encoder-decoder's loss and gradients equal the plain loss's."""
    for outcomes in under_fsdp1:
        assert isinstance(outcomes[case], tuple), outcomes[case]  # the exception's repr otherwise
        loss, expected, worst = outcomes[case]
        assert loss == pytest.approx(expected, rel=1e-5) and worst < 1e-5, (loss, expected, worst)

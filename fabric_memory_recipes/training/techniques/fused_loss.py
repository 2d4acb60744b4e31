"""The fused linear cross-entropy (``--fused-loss``, your model's causal LMs): the loss of the output
projection without the full logits.

A causal LM's last layer projects every token's hidden state onto the vocabulary: at 8 x 1024 tokens and a
49 k vocabulary the logits alone are 1.6 GB in fp32, their softmax and gradient as much again, and they
dominate the step's peak. The fused loss walks the tokens in chunks: for each chunk it makes that chunk's
logits, the loss and the gradients of the hidden states and of the projection's weight, then drops the
logits. What stays from the forward pass to the backward pass is those two gradients (tokens x hidden, and
the weight's shape), not tokens x vocabulary.

Applied to any Hugging Face causal LM through its output embeddings (:func:`fuse_output_embeddings`): the
projection's parameters are kept under their names (its weight stays tied to the input embeddings) by a
stand-in that returns its input, so the model's ``logits`` are the hidden states, and :func:`causal_lm_loss`
projects them chunk by chunk. An encoder-decoder's decoder is the same (:func:`seq2seq_lm_loss`: T5 and mT5;
T5's rescaling of tied outputs happens before the projection, so it stays; BART adds a bias after it and is
refused). A bias of the projection itself (Phi's) is added to each chunk's logits and gets its gradient, as
``nn.Linear`` would.

Backends, one call (:func:`linear_cross_entropy`): on CUDA Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``
(``pip install liger-kernel``), which computes the same chunked gradients with a Triton softmax; elsewhere,
and on the estimator's fake tensors, :class:`ChunkedLinearCrossEntropy` in plain torch, whose allocations
follow Liger's (the gradients made in the forward pass, one chunk's logits at a time), so the estimate
sees what the GPU run holds. At a large vocabulary over a small hidden size the torch path takes larger
chunks than Liger's (:func:`chunk_rows`), and CUDA runs it too (:func:`backend`). ``FMR_FUSED_LOSS=torch``
forces the torch path on CUDA; fast mode's CUDA graph records the torch path (Liger reads the count of
tokens on the host, which a graph cannot capture).
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch
from torch._subclasses.fake_tensor import is_fake

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.training.data.text_samples import IGNORE_INDEX

BACKENDS = ("liger", "torch")


class HiddenStates(torch.nn.Module):
    """The output projection's stand-in: holds the projection's weight and bias, the same parameters under the
    same names (tied where they were; a checkpoint's keys are the plain model's), and returns its input, the
    hidden states, in place of the logits.

    Told the targets first (:meth:`expect`, what the batch functions do), its forward computes the fused
    loss itself and returns the loss in place of the logits; :meth:`outcome` hands the batch function the
    loss and, in evaluation, the predicted tokens. The loss is made inside the model's forward because a
    sharded model holds the projection's weight gathered only there: under FSDP the weight read after the
    forward is the rank's flat shard."""

    def __init__(self, projection: torch.nn.Linear) -> None:
        super().__init__()
        self.register_parameter("weight", projection.weight)
        self.register_parameter("bias", projection.bias)
        self._expected: tuple[torch.Tensor, bool] | None = None
        self._outcome: tuple | None = None

    def expect(self, targets: torch.Tensor, shift: bool) -> None:
        """The next forward's targets; ``shift``: a causal LM's (the hidden state of token t predicts t + 1)."""
        self._expected, self._outcome = (targets, shift), None

    def outcome(self) -> tuple:
        """(loss, predicted ids or None, their targets or None) of the forward that :meth:`expect` prepared."""
        if self._outcome is None:
            raise RuntimeError("--fused-loss: the model's forward did not reach its output embeddings")
        outcome, self._outcome = self._outcome, None
        return outcome

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._expected is None:
            return hidden
        (targets, shift), self._expected = self._expected, None
        if shift:
            hidden = hidden[:, :-1]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        self._outcome = _loss_and_predictions(hidden, self.weight, targets.reshape(-1), self.bias)
        return self._outcome[0]


def refusal(model: torch.nn.Module) -> str | None:
    """Why the fused loss cannot apply to ``model`` (no output embeddings, a bias added after the projection,
    or logits that the model rescales after it), or None when it can."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if isinstance(head, HiddenStates):
        return None
    if not isinstance(head, torch.nn.Linear):
        return (
            f"--fused-loss: {type(model).__name__} has no output embeddings to fuse (a causal LM's"
            " linear projection onto the vocabulary)"
        )
    if getattr(model, "final_logits_bias", None) is not None:  # BART adds a bias after the projection
        return "--fused-loss: the model adds a bias after its output projection, which the fused loss does not add"
    config = getattr(model, "config", None)
    for field in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(config, field, None) not in (None, 0, 1, 1.0):
            return f"--fused-loss: the model rescales its logits ({field}), which the fused loss does not do"
    return None


def fuse_output_embeddings(model: torch.nn.Module) -> HiddenStates:
    """Make ``model`` return hidden states instead of logits; one line (:func:`refusal`) when it cannot apply."""
    why = refusal(model)
    if why:
        raise UsageError(why)
    head = model.get_output_embeddings()
    if isinstance(head, HiddenStates):
        return head
    stand_in = HiddenStates(head)
    model.set_output_embeddings(stand_in)
    return stand_in


def backend(hidden: torch.Tensor, vocab: int | None = None) -> str:
    """The implementation ``hidden`` gets: Liger's kernel for a real CUDA tensor when liger-kernel is
    installed, unless the torch path's chunks (:func:`chunk_rows`) are 4 or more times Liger's, so that it
    reads the weight a quarter as often (Qwen2's 152 k x 896: 256 tokens against 64, 29.1 ms against 51.9 on
    one H200; at 2 x neither was measured faster, and Liger stays); else torch (the CPU, and the estimator's
    fake tensors, which no kernel can read)."""
    forced = os.environ.get("FMR_FUSED_LOSS")
    if forced and forced not in BACKENDS:
        raise UsageError(f"FMR_FUSED_LOSS={forced}: one of {', '.join(BACKENDS)}")
    if is_fake(hidden) or hidden.device.type != "cuda":
        return "torch"
    if torch.cuda.is_current_stream_capturing():  # Liger counts the tokens on the host (.item())
        return "torch"
    if forced:
        return forced
    if vocab is not None and torch_reads_less(hidden.shape[0], vocab, hidden.shape[-1]):
        return "torch"
    return "liger" if importlib.util.find_spec("liger_kernel") else "torch"


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets`` (``IGNORE_INDEX`` skipped), as
    ``F.cross_entropy(F.linear(hidden, weight, bias), targets)`` under the same autocast, without the logits."""
    if torch.is_autocast_enabled(hidden.device.type):  # the dtype nn.Linear would compute in
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    else:  # a 16-bit-true model's outputs come back from Fabric in fp32: the projection's dtype, as in the model
        dtype = weight.dtype
        hidden = hidden.to(dtype)
    bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(hidden.device.type, enabled=False):
        if backend(hidden, weight.shape[0]) == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)(weight, hidden, targets, bias)
        return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, bias)


def liger_rows(tokens: int, vocab: int, hidden: int) -> int:
    """Liger's tokens per chunk: about as many logits per chunk as the hidden states hold."""
    return 2 ** max(0, math.ceil(math.log2(max(1, math.ceil(tokens / max(1, math.ceil(vocab / hidden)))))))


def chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """The torch path's tokens per chunk: Liger's (:func:`liger_rows`), or more where a chunk would hold
    fewer than hidden / 3 tokens (a power of two, at most the tokens' next one). Each chunk reads the weight in
    three matmuls and reads and writes its gradient once, so few tokens a chunk make the weight's traffic
    the loss's time (Qwen2's 152 k x 896 weight, 64 tokens a chunk: 128 chunks, 139 GB a micro-batch of
    8 x 1023 tokens); hidden / 3 tokens of fp32 log-probabilities and bf16 gradients (6 bytes a logit) take
    about the bytes of the weight's gradient, which the loss holds anyway (where Liger runs, these chunks are
    Liger's or twice as large: the estimate then holds a little more than the run)."""
    floor = 2 ** max(0, math.floor(math.log2(max(1, hidden // 3))))
    return max(liger_rows(tokens, vocab, hidden), min(floor, 2 ** math.ceil(math.log2(max(1, tokens)))))


def torch_reads_less(tokens: int, vocab: int, hidden: int) -> bool:
    """Whether the torch path's chunks are 4 or more times Liger's (:func:`backend` then takes it on CUDA)."""
    return chunk_rows(tokens, vocab, hidden) >= 4 * liger_rows(tokens, vocab, hidden)


def chunk_count(tokens: int, vocab: int, hidden: int) -> int:
    """How many chunks the loss of ``tokens`` rows walks (:func:`chunk_rows` each)."""
    return math.ceil(tokens / chunk_rows(tokens, vocab, hidden)) if tokens > 0 else 0


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The fused loss in torch: the gradients are made in the forward pass, one chunk of tokens at a time,
    and the backward pass only scales them, in place (so nothing of size tokens x vocabulary is saved, and
    the loss is backward once).

    A chunk's logits pass through memory three times: the matmul writes them, ``log_softmax`` reads them
    and writes fp32 log-probabilities, whose ``exp_`` in place is the softmax, cast once to the gradient;
    the one-hot is subtracted at the targets alone, and ignored tokens are masked in the small tensors
    (their hidden states and their rows of the hidden states' gradient), not in the chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias=None) -> torch.Tensor:
        rows = hidden.shape[0]
        count = (targets != IGNORE_INDEX).sum().clamp(min=1)
        grad_hidden = torch.zeros_like(hidden) if hidden.requires_grad else None
        wide = torch.promote_types(hidden.dtype, torch.float32)  # the softmax's and the loss's dtype
        # the weight's gradient in the weight's dtype, each chunk's product added inside one addmm, as Liger does
        # (a wide copy of the weight's size made, cast and added per chunk was 265 of the 474 GB a micro-batch of
        # Qwen2 0.2 B moved, simulated: 152 k vocabulary, 128 chunks)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias, dtype=wide) if bias is not None and bias.requires_grad else None
        loss = torch.zeros((), device=hidden.device, dtype=wide)
        step = chunk_rows(rows, weight.shape[0], weight.shape[1])
        minus_one = torch.full((step, 1), -1.0, dtype=wide, device=hidden.device)  # the one-hot, subtracted
        for start in range(0, rows, step):
            h, t = hidden[start : start + step], targets[start : start + step]
            valid = (t != IGNORE_INDEX).unsqueeze(1)
            index = t.clamp(min=0).unsqueeze(1)
            logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
            log_p = torch.log_softmax(logits, dim=-1, dtype=wide)
            del logits
            loss = loss - (log_p.gather(1, index) * valid).sum()
            # d(sum of losses)/d(logits) = softmax - one-hot; ignored rows are masked below
            grad = log_p.exp_().scatter_add_(1, index, minus_one[: t.shape[0]])
            if grad_bias is not None:  # ignored rows masked: d(loss)/d(bias) sums the counted rows
                grad_bias += (grad * valid).sum(0)
            grad = grad.to(hidden.dtype)
            del log_p
            if grad_hidden is not None:
                grad_hidden[start : start + step] = (grad @ weight) * valid
            if grad_weight is not None:
                torch.addmm(grad_weight, grad.t(), h * valid, out=grad_weight)
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, count)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight, grad_bias, count = ctx.saved_tensors
        scale = grad_loss / count
        gh = grad_hidden.mul_(scale) if grad_hidden is not None else None
        gw = grad_weight.mul_(scale) if grad_weight is not None else None
        gb = grad_bias.mul_(scale) if grad_bias is not None else None
        return gh, gw, None, gb


def predicted_ids(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The most likely token of each row of ``hidden``, one chunk of logits at a time (evaluation)."""
    step = chunk_rows(hidden.shape[0], weight.shape[0], weight.shape[1])
    weight = weight.to(hidden.dtype)
    bias = bias.to(hidden.dtype) if bias is not None else None
    return torch.cat(
        [
            torch.nn.functional.linear(hidden[i : i + step], weight, bias).argmax(-1)
            for i in range(0, hidden.shape[0], step)
        ]
    )


def apply(model: torch.nn.Module, batch_fn=None):
    """What the recipe's lines do (``--fused-loss``), for the estimate: the output projection fused into the
    loss (:func:`fused_batch_fn`: a causal LM's or an encoder-decoder's), and the loss's batch function returned
    in place of ``batch_fn``; one line (:func:`refusal`) for a model it cannot fuse."""
    return fused_batch_fn(model)


def causal_lm_loss(head: HiddenStates):
    """batch_fn for a causal LM whose output embeddings are fused (``fabric_memory_recipes.training.loop``):
    next-token loss on the completion tokens. Training makes no logits, so it reports no token accuracy
    (None); evaluation (no gradients) predicts the tokens chunk by chunk for the accuracy."""

    def batch_fn(model, batch):
        input_ids, attention_mask, labels = batch
        head.expect(labels[:, 1:], shift=True)  # the loss is made in the model's forward (HiddenStates)
        model(input_ids=input_ids, attention_mask=attention_mask)
        return head.outcome()

    return batch_fn


def _loss_and_predictions(hidden, weight, targets, bias=None):
    """The fused loss of ``hidden`` against ``targets``; in evaluation (no gradients) also the predicted ids
    of the tokens that count, chunk by chunk, for the accuracy."""
    loss = linear_cross_entropy(hidden, weight, targets, bias)
    if torch.is_grad_enabled():
        return loss, None, None
    keep = targets != IGNORE_INDEX
    return loss, predicted_ids(hidden[keep], weight, bias), targets[keep]


def seq2seq_lm_loss(head: HiddenStates, decoder_input_ids):
    """batch_fn for an encoder-decoder whose output embeddings are fused: the decoder reads the target
    shifted right (``decoder_input_ids(labels)``, the model's own shift, which its loss would make) and the
    loss is on every target token; as :func:`causal_lm_loss`, no token accuracy in training."""

    def batch_fn(model, batch):
        input_ids, attention_mask, labels = batch
        head.expect(labels, shift=False)
        model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids(labels))
        return head.outcome()

    return batch_fn


def fused_batch_fn(model: torch.nn.Module):
    """The fused loss's batch_fn for ``model`` (its output embeddings fused here): a causal LM's, or an
    encoder-decoder's (``config.is_encoder_decoder``)."""
    head = fuse_output_embeddings(model)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return seq2seq_lm_loss(head, model.prepare_decoder_input_ids_from_labels)
    return causal_lm_loss(head)

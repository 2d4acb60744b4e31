"""A text batch's attention mask in a form a CUDA graph can capture (fast mode of a text model).

From a 2-D padding mask a Hugging Face model first checks on the host whether any token is padded, to drop
the mask when none is (so that SDPA can run its causal flash kernel): a synchronisation in every forward pass,
which a CUDA graph cannot capture. Two ways round it (a causal LM's chosen once per run by :func:`capturable`):

- :func:`mask_4d`: the mask handed over in the 4-D form the model takes as it is (boolean for SDPA, added to
  the scores for eager attention), with the causal triangle for a causal LM. Any attention, any padding.
- For a causal LM under SDPA, the causal flag alone (:func:`causal_only`): the project's causal-LM samples are padded
  at their end (``text_samples.sft_example``), and under the causal triangle a real token never sees a later
  position, so the padding changes nothing a real token computes; the padded positions' outputs differ, but
  their labels are ignored, so the loss and every gradient are the masked run's. The model's attention is then
  registered under :data:`CAUSAL_SDPA`, whose mask function returns no mask, so the flash kernel runs in the
  graph as in the warm-up (Hugging Face would build the full causal mask under capture).

A model with its own attention code, off Hugging Face's attention interface (``_supports_attention_backend``
false), may read the 2-D mask for more than the mask: BLOOM builds its ALiBi biases from it, and a 4-D mask
stops its first step. It keeps the 2-D mask, and its eager attention's 4-D mask is made inside
:func:`eager_mask_on_device`: Hugging Face's eager mask without the zero it copies from the host in every
forward (a CUDA graph refuses the copy: results/published/h200/ranking-check/NOTES.md, "Six more families").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

CAUSAL_SDPA = "sdpa_causal_only"  # SDPA attention with no mask but the causal flag (registered below)


def mask_4d(model, attention_mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """The 2-D padding mask as (batch, 1, 1, tokens), or (batch, 1, tokens, tokens) with the causal triangle:
    boolean for SDPA (``True``: attend), added to the scores for eager attention. A padded token attends to
    itself (no row all masked)."""
    keep = attention_mask[:, None, None, :].bool()
    if causal:
        tokens = attention_mask.shape[-1]
        keep = keep & torch.ones(tokens, tokens, dtype=torch.bool, device=keep.device).tril()
        keep = keep | torch.eye(tokens, dtype=torch.bool, device=keep.device)
    if model.config._attn_implementation == "eager":
        return additive(keep, next(model.parameters()).dtype)
    return keep


def additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (``True``: attend) as eager attention adds it to the scores: 0, or the dtype's minimum;
    made on the device (no number copied from the host)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def _no_mask(*args, **kwargs) -> None:
    return None


def causal_only(model) -> bool:
    """Run ``model``'s SDPA attention with the causal flag alone (its mask function returns none); False, and
    nothing changed, for another attention implementation."""
    if model.config._attn_implementation not in ("sdpa", CAUSAL_SDPA):
        return False
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, _no_mask)
    model.config._attn_implementation = CAUSAL_SDPA
    return True


def _mask_on_device(*args, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    """``masking_utils.eager_mask``: SDPA's boolean mask, 0 where a token attends and the dtype's minimum
    elsewhere; the 0 written on the device, not copied from the host."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    mask = sdpa_mask(*args, **kwargs)
    return None if mask is None else additive(mask, dtype)


def own_attention(model) -> bool:
    """Whether ``model`` runs its own eager attention code, off Hugging Face's attention interface: its 2-D mask
    stays, and its 4-D mask is made by :func:`eager_mask_on_device`."""
    return (
        not getattr(model, "_supports_attention_backend", False)
        and model.config._attn_implementation == "eager"
    )


@contextlib.contextmanager
def eager_mask_on_device():
    """Within it, Hugging Face makes an eager attention's mask with :func:`_mask_on_device` (a local override of
    its mask functions' table, removed on leaving)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as table

    table["eager"] = _mask_on_device
    try:
        yield
    finally:
        del table["eager"]


def capturable(batch_fn: Callable, model) -> Callable:
    """A causal LM's ``batch_fn`` (its own loss or the fused loss) as fast mode's CUDA graph runs it: under SDPA
    with the causal flag alone (:func:`causal_only`, applied to ``model`` now: its mask function ignores the 2-D
    mask), under eager attention with the 4-D causal mask (:func:`mask_4d`), the 2-D one for a model with
    its own attention code (:func:`own_attention`)."""
    unmasked = causal_only(model)
    own = not unmasked and own_attention(model)

    def captured(model, batch):
        input_ids, attention_mask, labels = batch
        if own:
            with eager_mask_on_device():
                return batch_fn(model, batch)
        if not unmasked:  # (the 2-D mask stays for a causal-only model: without one, Hugging Face would
            attention_mask = mask_4d(model, attention_mask, True)  # look for packed sequences on the host)
        return batch_fn(model, (input_ids, attention_mask, labels))

    return captured

"""Inference with your model (``recipes/your_model.py --infer``): a causal LM's ``generate()`` (greedy, batch
``--batch-size`` x prompt ``--seq-len`` x ``--new-tokens``, its KV cache kept in ``--kv-cache-dtype``), an
encoder-decoder's ``generate()`` (the encoder reads ``--seq-len`` tokens, the decoder writes ``--new-tokens``),
or one forward pass of an encoder or a vision model at ``--batch-size`` under ``torch.inference_mode``. The run
records peak allocated, peak reserved and the whole-device peak as a training run does (its phases
``model_load`` and ``infer``), next to the prediction the recipe passes in (planning/inference/). With
``--weights-quant int8`` the weights are quantized after the model is built (training/techniques/inference/weights_quant.py).

:func:`infer` is the one inference call: the run executes it on the GPU, and the estimate executes the same
function on fake tensors (planning/inference/simulate.py), so that both see the same ``generate()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.training.techniques.inference import weights_quant
from fabric_memory_recipes.training.your_model import models
from fabric_memory_recipes.training.your_model.models import UserModel

# The KV cache's storage dtype; 'auto' keeps the weights' dtype (what generate() does by itself).
KV_CACHE_DTYPES = {
    "auto": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}
# Inference runs the model in one dtype: Fabric's "true" precisions.
WEIGHT_DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float16}
PROMPT_TOKEN = 5  # every prompt token (the values change nothing the memory depends on)
GENERATING = ("causal_lm", "seq2seq_lm")  # the tasks whose inference call is generate()


def generates(um: UserModel) -> bool:
    """Whether ``um``'s inference call is ``generate()`` (``--new-tokens`` counts), not one forward pass."""
    return um.task in GENERATING


def weights_dtype(precision: str) -> torch.dtype:
    """The dtype of the weights and the compute for ``--precision``; a mixed precision is refused in one line."""
    if precision not in WEIGHT_DTYPES:
        raise UsageError(
            f"--infer runs the model in one dtype: --precision {precision} is not one of"
            f" {', '.join(WEIGHT_DTYPES)}"
        )
    return WEIGHT_DTYPES[precision]


def cache_dtype(kv_cache_dtype: str, weights: torch.dtype) -> torch.dtype:
    return KV_CACHE_DTYPES[kv_cache_dtype] or weights


def check(um: UserModel, cfg: Any) -> None:
    """One line (:class:`UsageError`) for an inference request the runner cannot make."""
    weights_dtype(cfg.precision)
    if cfg.kv_cache_dtype != "auto" and um.task != "causal_lm":
        raise UsageError(
            f"--kv-cache-dtype goes with a causal LM's generate(); {um.ref} is {um.task.replace('_', ' ')}"
        )
    try:  # a causal LM's cache holds the prompt and the new tokens
        models.check_seq_len(um, cfg.seq_len + (cfg.new_tokens if um.task == "causal_lm" else 0))
        if um.task == "seq2seq_lm":  # the decoder's positions: the start token and the new tokens
            models.check_seq_len(um, cfg.new_tokens + 1, "--new-tokens")
    except UsageError as e:
        asked = f"--seq-len {cfg.seq_len}" + (
            f" + --new-tokens {cfg.new_tokens}" if um.task == "causal_lm" else ""
        )
        if str(e).startswith("--new-tokens"):
            asked = f"--new-tokens {cfg.new_tokens} (+ the decoder's start token)"
        raise UsageError(f"{asked}: {str(e).split(': ', 1)[1]}") from None
    if cfg.weights_quant != "none":
        weights_quant.require_torchao(cfg.weights_quant)
    if cfg.fsdp or cfg.world_size > 1:
        raise UsageError("--infer runs on one GPU: leave out --devices and --fsdp")
    if cfg.mode == "fast" or cfg.compile or cfg.cuda_graphs:
        raise UsageError(
            "--infer runs eagerly with the default allocator: leave out --mode fast, --compile and"
            " --cuda-graphs"
        )


def stored_cache(stored: torch.dtype, compute: torch.dtype, config: Any):
    """A DynamicCache that keeps keys and values in ``stored`` and hands attention ``compute`` copies."""
    from transformers import DynamicCache

    class StoredCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = super().update(
                key_states.to(stored), value_states.to(stored), layer_idx, *args, **kwargs
            )
            return keys.to(compute), values.to(compute)

    return StoredCache(config=config)


def model_inputs(
    um: UserModel, model: Any, batch_size: int, seq_len: int, dtype: torch.dtype, device
) -> dict:
    """The batch of one inference call: a prompt of ones-masked tokens, or images at the model's size."""
    if um.is_text:
        ids = torch.full((batch_size, seq_len), PROMPT_TOKEN, dtype=torch.long, device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    size = getattr(model, "image_size", 224)
    return {"images": torch.zeros(batch_size, 3, size, size, dtype=dtype, device=device)}


def infer(
    model: Any, um: UserModel, inputs: dict, new_tokens: int, kv_cache_dtype: str, weights: torch.dtype
):
    """The inference call: greedy ``generate()`` of exactly ``new_tokens`` tokens (a causal LM, an
    encoder-decoder), or one forward pass."""
    if um.task == "causal_lm":
        stored = cache_dtype(kv_cache_dtype, weights)
        cache = stored_cache(stored, weights, model.config) if stored != weights else None
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        return model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            past_key_values=cache,
            pad_token_id=pad,
        )
    if um.task == "seq2seq_lm":  # the encoder once, then the decoder token by token from its start token
        return model.generate(
            **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True
        )
    if um.is_text:
        return model(**inputs).logits
    return model(inputs["images"])


def run(
    cfg: Any, results: Any, predict: Callable[[Any], dict], quantize: Callable[[Any, str], dict] | None = None
) -> None:
    """``recipes/your_model.py --infer``: build, quantize the weights as ``--weights-quant`` says
    (``quantize(model, kind)``: training/techniques/inference/weights_quant.py), predict (``predict(cfg)``), infer once,
    record."""
    import lightning as L  # here: the estimator imports this module, and Lightning costs it seconds of start-up

    um = models.resolve(cfg.model)
    check(um, cfg)
    dtype = weights_dtype(cfg.precision)
    fabric = L.Fabric(accelerator=cfg.accelerator, devices=1, precision=cfg.precision)
    results.attach(fabric)
    results.set(data_source="synthetic", weights="random")
    results.extra.update(model=um.ref, task=um.task, inference=True)
    start = time.perf_counter()
    results.extra["predicted_inference"] = predict(cfg)  # before CUDA holds anything: a CPU simulation
    results.extra["predicted_inference_s"] = time.perf_counter() - start
    with results.phase("model_load"):
        with fabric.init_module(empty_init=False):  # on the device, in the precision's dtype
            model = models.build(um)
        model.eval()
        if cfg.weights_quant != "none":  # on the device, as built: each weight replaced by its int8 copy
            with torch.no_grad():
                results.extra["weights_quant"] = quantize(model, cfg.weights_quant)
    results.set(parameters=sum(p.numel() for p in model.parameters()))
    inputs = model_inputs(um, model, cfg.batch_size, cfg.seq_len, dtype, fabric.device)
    with results.phase("infer"), torch.inference_mode():
        out = infer(model, um, inputs, cfg.new_tokens, cfg.kv_cache_dtype, dtype)
    results.extra["inference_output_shape"] = list(out.shape)
    results.extra["inference_s"] = results.phases["infer"]["wall_s"]

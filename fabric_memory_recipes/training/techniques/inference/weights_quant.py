"""Quantized frozen weights for inference (``recipes/your_model.py --infer --weights-quant int8``).

:func:`quantize` is torchao's weight-only int8 (``quantize_(model, Int8WeightOnlyConfig(version=2))``):
every ``nn.Linear``'s weight becomes an ``Int8Tensor``, its values int8 and, per output row, a scale (in the
weights' dtype) and a zero point (int8). The layer's matmul casts the int8 weight to the activations' dtype
(a transient copy of the whole weight), multiplies, and scales the product: two outputs' worth of memory
and one weight's, where the plain layer needs one output. Quantizing runs on the device, after the model
is built: each weight's scale search and rounding make temporaries of the weight's size, and its
high-precision copy is freed as its ``Int8Tensor`` replaces it.

A causal LM whose output projection shares its weight with the input embedding keeps that layer as it is:
quantizing it would untie the two and keep the embedding's weight beside the int8 copy. The runner calls
:func:`quantize` on its model, the estimate (planning/inference/simulate.py) on its fake-tensor model, so
both hold the same weights and run the same matmuls. torchao is optional (the extra ``lowbit``): without it,
:func:`require_torchao` refuses in one line.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from fabric_memory_recipes.config import UsageError

KINDS = ("none", "int8")  # --weights-quant: the frozen weights' storage


def require_torchao(kind: str = "int8") -> None:
    """One line (:class:`UsageError`) when torchao, which quantizes the weights, is missing or predates its
    ``Int8Tensor`` (``Int8WeightOnlyConfig(version=2)``; the committed runs used torchao 0.17)."""
    try:
        import torchao.quantization as quantization  # optional: only --weights-quant needs it
    except ImportError:
        quantization = None
    if not hasattr(quantization, "Int8Tensor"):
        raise UsageError(
            f"--weights-quant {kind} needs torchao with Int8WeightOnlyConfig(version=2), 0.17 or"
            " newer: python3 -m pip install 'torchao>=0.17'"
        )


def tied_output(model: nn.Module) -> nn.Module | None:
    """The output projection when it shares its weight with the input embedding (Hugging Face's tied
    embeddings), else None."""
    get_out, get_in = (
        getattr(model, "get_output_embeddings", None),
        getattr(model, "get_input_embeddings", None),
    )
    out, into = (get_out() if callable(get_out) else None), (get_in() if callable(get_in) else None)
    if out is None or into is None or getattr(out, "weight", None) is None:
        return None
    return out if out.weight is getattr(into, "weight", None) else None


def quantize(model: nn.Module, kind: str) -> dict[str, Any]:
    """Quantize ``model``'s ``Linear`` weights in place as ``kind`` says ('none': nothing); what the results
    record: the layers quantized and the one left as it is."""
    if kind == "none":
        return {"weights_quant": "none"}
    require_torchao(kind)
    from torchao.quantization import Int8WeightOnlyConfig, quantize_  # optional: checked above

    kept = tied_output(model)
    names = {id(m): n for n, m in model.named_modules()}
    quantized: list[str] = []

    def chosen(module: nn.Module, fqn: str) -> bool:
        # torchao's own choice (every Linear but MultiheadAttention's output projection), less the tied head
        take = isinstance(module, nn.Linear) and not isinstance(module, NonDynamicallyQuantizableLinear)
        take = take and module is not kept
        if take:
            quantized.append(fqn)
        return take

    quantize_(model, Int8WeightOnlyConfig(version=2, set_inductor_config=False), filter_fn=chosen)
    return {
        "weights_quant": kind,
        "quantized_layers": len(quantized),
        "kept": [names[id(kept)]] if kept is not None else [],
    }

"""A Hugging Face model built from its config on the current device, holding nothing above its weights.

``AutoModel*.from_config`` on a device allocates each layer's weights as its constructor runs and ties the
shared ones only at the end (``post_init``). A model whose output layer shares the input embedding so holds
a second vocabulary x width tensor until then (GPT-2, Qwen2, Llama with tied embeddings), and T5 and mT5
hold four (``shared``, each stack's ``embed_tokens``, ``lm_head``) before three of them become ``shared``.
Built inside ``fabric.init_module()`` on an H100, mT5-base in fp32 (its output layer then untied: two
embeddings of 0.77 GB) peaked at 3.87 GB allocated against 2.33 GB of weights, and the allocator kept the
freed blocks reserved through ``generate()``.

:func:`from_config` builds the model on the meta device with tying held off, allocates on the current device
the tensors that tying does not replace (in the order of ``named_parameters()``, then ``named_buffers()``),
fills them with the model's own initialization (``initialize_weights``: every module's ``_init_weights``, the
buffers' values included) and ties. This is what transformers' ``from_pretrained`` does for the weights a
checkpoint lacks. Against ``from_config`` on the device, each weight has the same distribution (the same
initialization; torch's per-layer defaults, which ``_init_weights`` overwrites, are skipped), the buffers
and the tied pairs are the same, and the random values differ (the generator is drawn in another order).
A model left with a tensor that its initialization did not write (still NaN, or still on the meta device) is
built again with ``from_config`` on the device, as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def supported() -> bool:
    """Whether this transformers can build on the meta device and initialize afterwards (transformers 5:
    ``initialization.no_tie_weights``, ``PreTrainedModel.initialize_weights``)."""
    try:
        from transformers import PreTrainedModel, initialization
    except ImportError:
        return False
    return hasattr(initialization, "no_tie_weights") and hasattr(PreTrainedModel, "initialize_weights")


def from_config(auto: Any, config: Any) -> nn.Module:
    """``auto.from_config(config)`` on the current default device and dtype, with no tensor allocated beyond
    the model's own (on the meta device, or with an older transformers: ``from_config`` itself)."""
    device = torch.get_default_device()
    if device.type == "meta" or not supported():
        return auto.from_config(config)
    from transformers.initialization import no_tie_weights

    with torch.device("meta"), no_tie_weights():
        model = auto.from_config(config)
    materialize(model, device, skip=set(getattr(model, "all_tied_weights_keys", None) or {}))
    model.initialize_weights()
    model.tie_weights()
    if uninitialized(model):
        del model
        return auto.from_config(config)
    return model


def materialize(model: nn.Module, device: torch.device, skip: set[str] = frozenset()) -> None:
    """Replace every meta parameter and buffer of ``model`` by an uninitialized tensor on ``device``, one per
    shared tensor, floating ones filled with NaN (so that :func:`uninitialized` finds what no initialization
    wrote); the names in ``skip`` (what tying will replace) stay on the meta device. All parameters come
    first, in the order of ``named_parameters()``: the order in which the estimate allocates them."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, kept alive; its copy)

    def on_device(t: torch.Tensor, as_parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            nan = t.is_floating_point()
            new = (
                torch.full_like(t, float("nan"), device=device) if nan else torch.empty_like(t, device=device)
            )
            made[id(t)] = (t, nn.Parameter(new, requires_grad=t.requires_grad) if as_parameter else new)
        return made[id(t)][1]

    for kind in ("_parameters", "_buffers"):
        for prefix, module in model.named_modules():
            held = getattr(module, kind)
            for name, t in list(held.items()):
                if t is not None and t.device.type == "meta" and f"{prefix}.{name}".lstrip(".") not in skip:
                    held[name] = on_device(t, kind == "_parameters")


def uninitialized(model: nn.Module) -> bool:
    """Whether a tensor of ``model`` is still on the meta device, or a floating one holds a NaN (one sum per
    tensor, reduced where it lives: no copy of a weight)."""
    tensors = list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    if any(t.device.type == "meta" for t in tensors):
        return True
    with torch.no_grad():
        sums = [t.sum(dtype=torch.float32) for t in tensors if t.is_floating_point() and t.numel()]
        return bool(sums) and bool(torch.stack(sums).isnan().any())

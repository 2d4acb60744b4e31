"""LoRA: the model's weights frozen, low-rank adapters trained beside chosen layers
(``recipes/your_model.py --lora-rank R [--lora-targets NAMES]``).

:func:`add_adapters` injects peft's LoRA layers (``LoraConfig``, ``inject_adapter_in_model``: the model
keeps its class and its module names, the targets become ``base_layer`` + ``lora_A`` + ``lora_B``) and
leaves trainable only the adapters and the task's head (:func:`head_modules`: a classifier's output layer,
random here, must learn its classes; a causal LM's output embedding stays frozen). The runner calls it on
the model it trains and the estimate on its meta-device model, so both see the same trainable parameters:
frozen weights have no gradients and no optimizer state, and the backward still saves what the adapters'
and the inputs' gradients need.

Targets, chosen per architecture (:func:`default_targets`) among the ``Linear`` layers (and transformers'
``Conv1D``) inside the model's repeated blocks: every one for a Hugging Face model (attention and MLP), the
attention's (``qkv``, ``proj``) for timm, and for torchvision those called as modules (its
``MultiheadAttention`` reads ``out_proj``'s weight directly, so an adapter there would never run).
``--lora-targets`` names them instead (peft's rule: a module whose name is, or ends with, one of the names).

The adapters are made in the default dtype and device (inside ``fabric.init_module``: the precision's and the
accelerator's), without dropout (``lora_dropout=0``: no mask is saved), ``lora_alpha = 2 x rank``.
"""

from __future__ import annotations

import importlib.util

import torch.nn as nn

from fabric_memory_recipes.config import UsageError

ALPHA_PER_RANK = 2  # lora_alpha = 2 x rank: the adapters' scale; memory does not depend on it
ADAPTED = ("Linear", "Conv1D")  # the layer classes a default target may be (Conv1D: GPT-2's)
HF_HEADS = ("pre_classifier", "classifier", "score")  # a Hugging Face sequence classifier's head modules


def require_peft(flag: str = "--lora-rank") -> None:
    """One line (:class:`UsageError`) when peft is not installed."""
    if importlib.util.find_spec("peft") is None:
        raise UsageError(f"{flag} needs peft: python3 -m pip install peft")


def default_targets(model: nn.Module, source: str, blocks: tuple[str, ...]) -> tuple[str, ...]:
    """The full names of the layers that get adapters by default (module docstring); ``()`` when none."""
    found = []
    for block in (m for m in model.modules() if type(m).__name__ in blocks):
        skip = {id(c) for m in block.modules() if isinstance(m, nn.MultiheadAttention) for c in m.modules()}
        for name, m in block.named_modules():
            if type(m).__name__ not in ADAPTED and not isinstance(m, nn.Linear) or id(m) in skip:
                continue
            if source == "timm" and name.split(".")[-2:-1] != ["attn"]:
                continue
            found.append(id(m))
    return tuple(n for n, m in model.named_modules() if id(m) in found)


def head_modules(model: nn.Module, source: str, task: str) -> tuple[str, ...]:
    """The names of the task head's modules, trained with the adapters; ``()`` for a causal LM."""
    if task == "causal_lm":
        return ()
    if source == "hf":
        return tuple(n for n, _ in model.named_children() if n in HF_HEADS)
    if source == "timm" and hasattr(model, "get_classifier"):
        head = model.get_classifier()
        return tuple(n for n, m in model.named_modules() if m is head and n)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return linears[-1:]  # torchvision: its last Linear is the classifier


def short_names(names: tuple[str, ...]) -> list[str]:
    """The distinct last parts of module names (``q_proj``, ``v_proj``), in order: what a run records."""
    return list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))


def add_adapters(
    model: nn.Module,
    source: str,
    task: str,
    blocks: tuple[str, ...],
    rank: int,
    targets: str | None = None,
) -> dict:
    """Freeze ``model``, inject rank-``rank`` adapters at ``targets`` (comma-separated names; None: the
    :func:`default_targets`), and train the adapters and the task's head. Returns what it did (the run
    records it). A choice that adapts nothing is refused in one line."""
    require_peft()
    from peft import LoraConfig, inject_adapter_in_model

    chosen = tuple(t.strip() for t in targets.split(",") if t.strip()) if targets else None
    if chosen is None:
        chosen = default_targets(model, source, blocks)
        if not chosen:
            where = ", ".join(blocks) or "no repeated blocks"
            raise UsageError(
                f"--lora-rank: no Linear layer to adapt inside the repeated blocks ({where}) of this"
                " model: name the layers with --lora-targets NAME,NAME"
            )
    matched = [n for n, _ in model.named_modules() if any(n == t or n.endswith("." + t) for t in chosen)]
    if not matched:
        raise UsageError(f"--lora-targets {','.join(chosen)}: no module of this model has that name")
    fan_in_fan_out = any(type(model.get_submodule(n)).__name__ == "Conv1D" for n in matched)
    config = LoraConfig(
        r=rank,
        lora_alpha=ALPHA_PER_RANK * rank,
        lora_dropout=0.0,
        target_modules=list(chosen),
        fan_in_fan_out=fan_in_fan_out,
    )
    try:
        inject_adapter_in_model(config, model)
    except ValueError as e:  # peft: a layer type it cannot adapt
        raise UsageError(f"--lora-targets: {str(e).splitlines()[0][:300]}") from None
    heads = head_modules(model, source, task)
    for name in heads:
        model.get_submodule(name).requires_grad_(True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "rank": rank,
        "alpha": ALPHA_PER_RANK * rank,
        "targets": short_names(tuple(matched)),
        "adapted_layers": len(matched),
        "heads": list(heads),
        "trainable_parameters": trainable,
    }

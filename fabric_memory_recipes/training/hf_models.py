"""Hugging Face models for the bonus recipes: DistilBERT, BigBird (IMDb classifiers) and a Qwen2 causal LM.

Each ``--model`` name maps to a :class:`Spec`: the model type that ``AutoConfig.for_model`` knows, the
hub id that holds pretrained weights and the tokenizer, and the config fields that make the size.
``--weights auto`` loads the hub weights when they are cached or huggingface.co is reachable and
otherwise builds the same architecture from its config with random initialisation, printing one line
(real first, offline always). Memory and speed do not depend on the weights' values.

The ``*-tiny`` names are a few layers of width 64: the CPU path of ``run_all.sh`` and the tests use them.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.console import notice
from fabric_memory_recipes.training.data.network import hub_online
from fabric_memory_recipes.training.data.text_samples import TokenIds


@dataclass(frozen=True)
class Spec:
    """What ``--model NAME`` builds."""

    name: str
    task: str  # "classification" (AutoModelForSequenceClassification) or "causal_lm"
    model_type: str  # the key of AutoConfig.for_model
    hub_id: str | None  # pretrained weights and tokenizer (None: random init only)
    ids: TokenIds
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields on top of the type's defaults

    def tokenizer(self, path: str | None = None):
        """:func:`load_tokenizer` of this model (what the text data asks for real text)."""
        return load_tokenizer(self, path)


# Qwen2-0.5B-Instruct's shape (config.json of the hub repository); Qwen2Config's defaults are a 7B model.
QWEN2_0_5B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
)
TINY_IDS = TokenIds(pad=0, cls=1, sep=2, first_regular=8, vocab_size=1024)

SPECS: dict[str, Spec] = {
    spec.name: spec
    for spec in (
        # AutoConfig.for_model("distilbert") defaults *are* distilbert-base-uncased (6 layers, dim 768).
        Spec(
            "distilbert-base-uncased",
            "classification",
            "distilbert",
            "distilbert-base-uncased",
            TokenIds(pad=0, cls=101, sep=102, first_regular=1996, vocab_size=30522),
        ),
        Spec(
            "distilbert-tiny",
            "classification",
            "distilbert",
            None,
            TINY_IDS,
            dict(dim=64, hidden_dim=128, n_layers=2, n_heads=2, vocab_size=1024),
        ),
        # BigBirdConfig's defaults are bigbird-roberta-base: 12 layers, block-sparse attention, 4096 positions.
        Spec(
            "google/bigbird-roberta-base",
            "classification",
            "big_bird",
            "google/bigbird-roberta-base",
            TokenIds(pad=0, cls=65, sep=66, first_regular=1000, vocab_size=50358),
        ),
        # Block-sparse attention needs sequences longer than (5 + 2 * num_random_blocks) * block_size = 72.
        Spec(
            "bigbird-tiny",
            "classification",
            "big_bird",
            None,
            TINY_IDS,
            dict(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=128,
                vocab_size=1024,
                max_position_embeddings=1024,
                block_size=8,
                num_random_blocks=2,
            ),
        ),
        Spec(
            "Qwen/Qwen2-0.5B-Instruct",
            "causal_lm",
            "qwen2",
            "Qwen/Qwen2-0.5B-Instruct",
            TokenIds(pad=151643, cls=None, sep=None, first_regular=1000, vocab_size=151936),
            QWEN2_0_5B,
        ),
        Spec(
            "qwen2-tiny",
            "causal_lm",
            "qwen2",
            None,
            TokenIds(pad=0, cls=None, sep=None, first_regular=8, vocab_size=1024),
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=1024,
                max_position_embeddings=1024,
                tie_word_embeddings=True,
                pad_token_id=0,
            ),
        ),
    )
}
DISTILBERT = ("distilbert-base-uncased", "distilbert-tiny")
BIGBIRD = ("google/bigbird-roberta-base", "bigbird-tiny")
QWEN2 = ("Qwen/Qwen2-0.5B-Instruct", "qwen2-tiny")


def config(spec: Spec, **fields: Any):
    """``AutoConfig.for_model(model_type, **overrides, **fields)``: the architecture without any download."""
    from transformers import AutoConfig

    return AutoConfig.for_model(spec.model_type, **{**spec.overrides, **fields})


def require_transformers(what: str) -> None:
    """One line and exit 2 when ``transformers`` is missing: it is an extra, not a dependency, so an
    installed wheel estimates vision models without it (``--model hf:`` and the bonus cases need it)."""
    if importlib.util.find_spec("transformers") is None:
        raise UsageError(f"{what} needs Hugging Face transformers: pip install 'fabric-memory-recipes[hf]'")


def _cached(hub_id: str) -> bool:
    """True if the hub repository's config is in the local Hugging Face cache (usable offline)."""
    from huggingface_hub import try_to_load_from_cache  # with transformers, an extra (require_transformers)

    return isinstance(try_to_load_from_cache(hub_id, "config.json"), str)


def resolve_weights(spec: Spec, weights: str) -> bool:
    """Map --weights auto|pretrained|none to True (load the hub weights) or False (random init).

    ``auto`` falls back to random init with one printed line; ``pretrained`` without the weights is a
    UsageError (exit 2).
    """
    if weights == "none":
        return False
    if spec.hub_id is None:
        if weights == "pretrained":
            raise UsageError(f"--weights pretrained: no pretrained weights exist for --model {spec.name}")
        notice(f"[weights] {spec.name} has no pretrained weights: random init from its config")
        return False
    if _cached(spec.hub_id) or hub_online():
        return True
    if weights == "pretrained":
        raise UsageError(
            f"--weights pretrained: {spec.hub_id} is not cached and huggingface.co is unreachable"
        )
    notice(
        f"[weights] {spec.hub_id} unreachable (offline): random init of the same architecture"
        f" (AutoConfig.for_model({spec.model_type!r}, ...))"
    )
    return False


def build_model(
    spec: Spec,
    pretrained: bool,
    *,
    num_labels: int = 2,
    attn_implementation: str | None = None,
    vocab_size: int | None = None,
):
    """The model of ``spec``: hub weights if ``pretrained``, else random init from its config.

    Tensors are allocated on the current default device and dtype, so inside ``fabric.init_module()``
    the model is created on the accelerator in the precision's dtype. ``from_pretrained`` may keep the
    checkpoint's dtype (Qwen2's is bf16), so it is cast to the default dtype: the precision flag alone
    decides the weights' dtype. ``vocab_size`` widens a random-init embedding to fit a tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if spec.task == "classification" else AutoModelForCausalLM
    kwargs: dict[str, Any] = {}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    fields: dict[str, Any] = {"num_labels": num_labels} if spec.task == "classification" else {}
    if pretrained:
        local = not hub_online()
        model = auto.from_pretrained(spec.hub_id, local_files_only=local, **fields, **kwargs)
        return model.to(torch.get_default_dtype())
    if vocab_size is not None and vocab_size > spec.ids.vocab_size:
        fields["vocab_size"] = vocab_size
    return auto.from_config(config(spec, **fields), **kwargs)


def load_tokenizer(spec: Spec, path: str | None = None):
    """The tokenizer for real text: ``path`` (a directory, or a WordPiece ``vocab.txt``) if given, else the
    model's own from the hub when cached or reachable; None when there is none to be had offline."""
    from transformers import AutoTokenizer, BertTokenizerFast

    if path:
        if os.path.isdir(path):
            return AutoTokenizer.from_pretrained(path)
        if os.path.isfile(path):
            # transformers 5 takes the vocabulary as `vocab` (and ignores `vocab_file`); 4.x as `vocab_file`.
            params = inspect.signature(BertTokenizerFast.__init__).parameters
            return BertTokenizerFast(
                **{"vocab" if "vocab" in params else "vocab_file": path}, do_lower_case=True
            )
        raise UsageError(f"--tokenizer {path}: no such file or directory")
    if spec.hub_id is None or not (_cached(spec.hub_id) or hub_online()):
        return None
    tokenizer = AutoTokenizer.from_pretrained(spec.hub_id, local_files_only=not hub_online())
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def count_parameters(model, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def weights_dtype(model) -> str:
    """The dtype of the (first) parameter, e.g. 'torch.bfloat16': what --half changes."""
    return str(next(model.parameters()).dtype)


def checkpointing_enabled(model) -> bool:
    """True if any layer will recompute its activations: Hugging Face marks such modules with
    ``gradient_checkpointing = True`` (read from the model, not from the flag that asked for it)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def fix_random_blocks(model, seq_len: int, on_device: bool = False) -> int:
    """BigBird's random attention blocks drawn once per layer (fast mode of ``recipes/bonus_bigbird_after.py``).

    Hugging Face draws them with numpy on every forward pass, after seeding numpy with the layer's own fixed
    seed, so each layer gets the same blocks at every call: at 2048 tokens the 12 layers spend about 0.1 s of
    host time per forward pass on it (on a CPU core), and a compiled layer breaks its graph there. Here each
    attention module keeps what its first draw returned, per set of arguments and per train/eval mode (eval
    draws no random blocks). The training draws for ``seq_len`` are made now, by one forward pass of one
    sequence without gradients, so that a layer compiled afterwards finds them.

    ``on_device``: each module also keeps the device copy of its blocks. Hugging Face copies the draw from the
    host at every call (``torch.tensor(..., device=...)``), and the host waits for that copy, which a CUDA graph
    cannot capture; here the copy made in the first pass is handed out again (a copy of it on the device) for
    every equal draw. The model must then run block-sparse attention at ``seq_len``: at a length too short for
    it Hugging Face falls back to full attention, whose padding mask it checks on the host (a UsageError).
    Returns how many attention modules reuse their draw."""
    found = [m for m in model.modules() if hasattr(m, "_bigbird_block_rand_mask_with_head")]
    for module in found:
        module._bigbird_block_rand_mask_with_head = _drawn_once(module)
        if on_device:
            module.bigbird_block_sparse_attention = _copies_kept(module.bigbird_block_sparse_attention)
    was_training, device = model.training, next(model.parameters()).device
    model.train()
    # the random generators as they were: the training draws the dropout masks it would have drawn without this pass
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        ids = torch.zeros(1, seq_len, dtype=torch.long, device=device)
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    model.train(was_training)
    if on_device and getattr(model.base_model, "attention_type", None) != "block_sparse":
        raise UsageError(
            f"--max-length {seq_len}: BigBird falls back to full attention at this length, and checks its padding"
            " mask on the host, which a CUDA graph cannot capture: use a longer --max-length or --no-cuda-graphs"
        )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # that pass's temporaries: not left reserved for the training's peak
    return len(found)


class _KeptCopies(TorchFunctionMode):
    """Inside one block-sparse attention call: ``torch.tensor`` of a numpy array (the random blocks) returns a
    device copy of the tensor the first equal array made, so no copy from the host happens after the first."""

    def __init__(self, kept: dict) -> None:
        super().__init__()
        self.kept = kept

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.tensor or not args or not isinstance(args[0], np.ndarray):
            return func(*args, **kwargs)
        array = args[0]
        key = (
            array.shape,
            array.dtype.str,
            array.tobytes(),
            str(kwargs.get("device")),
            str(kwargs.get("dtype")),
        )
        if key not in self.kept:
            self.kept[key] = func(*args, **kwargs)  # the first call's copy from the host, kept
        return self.kept[key].clone()  # a copy on the device: the kept tensor stays as it was made


def _copies_kept(attend):
    kept: dict = {}

    @torch.compiler.disable  # a compiled layer would trace the draw as a host tensor copied at each call
    def attention(*args, **kwargs):
        with _KeptCopies(kept):
            return attend(*args, **kwargs)

    return attention


def _drawn_once(module):
    draw, drawn = type(module)._bigbird_block_rand_mask_with_head.__get__(module), {}

    @torch.compiler.disable  # the first draw runs numpy: outside a compiled graph, as in eager
    def first_draw(key, args, kwargs) -> None:
        np.random.seed(module.seed)  # what the caller did just before: the same draw
        drawn[key] = draw(*args, **kwargs)

    def blocks(*args, **kwargs):
        named = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(kwargs.items()))
        key = (module.training, tuple(tuple(v) if isinstance(v, list) else v for v in args), named)
        if key not in drawn:
            first_draw(key, args, kwargs)
        return drawn[key]

    return blocks

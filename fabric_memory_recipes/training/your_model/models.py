"""Models a user names, built without weights: ``--model torchvision:NAME``, ``--model timm:NAME`` and
``--model hf:ID_OR_PATH`` (a Hugging Face ``config.json``, or a folder holding one; a hub id when the
hub is reachable).

The task follows from the model: torchvision and timm models classify images (10 classes: the digits'
labels); a Hugging Face config is an encoder-decoder trained as a sequence-to-sequence LM when it says it is
one (``is_encoder_decoder``: T5, mT5, BART), a causal LM when its ``architectures`` say so (``*ForCausalLM``,
``*LMHeadModel``), else a sequence classifier (2 labels: IMDb's) when transformers has that head for
its model type, else a causal LM when it has that head. Every model is built with ``from_config`` /
``weights=None`` / ``pretrained=False``: memory and speed do not depend on the weights' values.

:func:`repeated_blocks` finds what activation checkpointing and FSDP wrap: Hugging Face's
``_no_split_modules``, timm's ``blocks``, torchvision's ``encoder.layers``, else the class that fills
the most ``ModuleList`` / ``Sequential`` containers whose children all share one class.
"""

from __future__ import annotations

import collections
import difflib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torchvision.models as tvm

from fabric_memory_recipes import console
from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.training.data.network import hub_online
from fabric_memory_recipes.training.data.text_samples import TokenIds
from fabric_memory_recipes.training.hf_models import _cached, require_transformers
from fabric_memory_recipes.training.your_model import hf_init, regions

SOURCES = ("torchvision", "timm", "hf")
IMAGE_CLASSES = 10  # the digits' labels: what the runner trains on
TEXT_LABELS = 2  # IMDb's
EXAMPLES = "torchvision:resnet50, timm:convnext_tiny, hf:path/to/config.json"


class SourcePrefixed(tuple):
    """``model_choices`` of a configuration that takes any ``SOURCE:NAME`` (``in`` checks the prefix);
    its items are what an error message lists."""

    def __contains__(self, name: object) -> bool:
        return is_user_model(name)


def is_user_model(name: object) -> bool:
    """True for ``torchvision:...``, ``timm:...`` and ``hf:...``."""
    return isinstance(name, str) and ":" in name and name.split(":", 1)[0] in SOURCES


# Tasks whose fast-mode step the runner captures in CUDA graphs on one GPU: their batches have static shapes
# and nothing is read on the host (a text classifier's and an encoder-decoder's batches read their padding).
CAPTURED_TASKS = ("image_classification", "causal_lm")


@dataclass(frozen=True, eq=False)
class UserModel:
    """What ``--model SOURCE:NAME`` resolved to."""

    ref: str  # as the user wrote it
    source: str
    name: str
    task: str  # image_classification | classification | causal_lm | seq2seq_lm
    hf_config: Any = None  # a transformers PretrainedConfig (source hf)

    @property
    def is_text(self) -> bool:
        return self.task != "image_classification"

    @property
    def captured(self) -> bool:
        """Whether fast mode captures this model's step in CUDA graphs on one GPU (:data:`CAPTURED_TASKS`)."""
        return self.task in CAPTURED_TASKS

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.hf_config, "vocab_size", None)

    @property
    def num_labels(self) -> int:
        """Classes of the loss: 10 digits, 2 IMDb labels, or the vocabulary of a causal LM."""
        return {"image_classification": IMAGE_CLASSES, "classification": TEXT_LABELS}.get(
            self.task, self.vocab_size or 0
        )


def resolve(ref: str) -> UserModel:
    """``SOURCE:NAME`` -> :class:`UserModel`, or :class:`UsageError` (one line) for an unknown source,
    model, a missing or malformed config, or a hub id while offline."""
    if not is_user_model(ref):
        raise UsageError(
            f"--model {ref!r}: expected SOURCE:NAME with SOURCE one of {', '.join(SOURCES)} ({EXAMPLES})"
        )
    source, name = ref.split(":", 1)
    if not name:
        raise UsageError(f"--model {ref!r}: no model name after '{source}:'")
    if source == "torchvision":
        _known(ref, name, tvm.list_models(module=tvm))  # the classification models
    elif source == "timm":
        try:
            import timm
        except ImportError:
            raise UsageError(
                f"--model {ref}: timm is not installed (pip install 'fabric-memory-recipes[timm]')"
            ) from None
        if not timm.is_model(name):
            _known(ref, name, timm.list_models())
    else:
        config = hf_config(ref, name)
        return UserModel(ref, source, name, _hf_task(ref, config), config)
    return UserModel(ref, source, name, "image_classification")


POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def check_seq_len(um: UserModel, seq_len: int, flag: str = "--seq-len") -> None:
    """One line (:class:`UsageError`) when ``--seq-len`` exceeds the positions a text model's config has:
    on fake tensors nothing would fail, and the estimate would describe a model that cannot run."""
    if not um.is_text:
        return
    for name in POSITION_FIELDS:
        positions = getattr(um.hf_config, name, None)
        if isinstance(positions, int) and positions > 0:
            if seq_len > positions:
                raise UsageError(f"{flag} {seq_len}: {um.ref} has {positions} positions ({name})")
            return


def _known(ref: str, name: str, names: list[str]) -> None:
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        raise UsageError(f"--model {ref}: unknown model" + (f" (close: {', '.join(close)})" if close else ""))


def hf_config(ref: str, name: str):
    """A local ``config.json`` (or a folder with one), else the hub's config for an id, when online."""
    require_transformers(f"--model {ref}")
    if os.path.exists(name):
        path = os.path.join(name, "config.json") if os.path.isdir(name) else name
        try:
            with open(path, encoding="utf-8") as f:
                fields = json.load(f)
        except (OSError, ValueError) as e:
            raise UsageError(
                f"--model {ref}: {path} is not a readable JSON config ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
            raise UsageError(f'--model {ref}: {path} has no "model_type" (not a Hugging Face config.json)')
        from transformers import AutoConfig  # only hf: models pay for importing transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        kind = fields.pop("model_type")
        if kind not in CONFIG_MAPPING:  # transformers' own error lists all of its ~700 types in one line
            close = difflib.get_close_matches(kind, list(CONFIG_MAPPING.keys()), n=3)
            raise UsageError(
                f'--model {ref}: {path}: model_type "{kind}" is not one this transformers knows'
                + (f" (closest: {', '.join(close)})" if close else "")
            )
        try:
            config = AutoConfig.for_model(kind, **fields)
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--model {ref}: {path}: {str(e).splitlines()[0][:300]}") from None
        if fields.get("tie_word_embeddings") is False and config.tie_word_embeddings:  # transformers 5 ties
            config.untied_output_embeddings = True  # T5's and mT5's anyway: build() unties the output layer
        return config
    if name.endswith(".json") or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UsageError(f"--model {ref}: no such file or folder")
    if not (_cached(name) or hub_online()):
        raise UsageError(
            f"--model {ref}: not a local config.json or folder, and the Hugging Face hub is"
            " unreachable (offline): pass the path of a config.json"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, local_files_only=not hub_online())
    except Exception as e:
        raise UsageError(
            f"--model {ref}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None


def _hf_task(ref: str, config) -> str:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    )

    if getattr(config, "is_encoder_decoder", False):  # T5, mT5, BART, ...: source in, target out
        if type(config) in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING:
            return "seq2seq_lm"
        raise UsageError(
            f"--model {ref}: {config.model_type} is an encoder-decoder without a sequence-to-sequence"
            " LM head in transformers (AutoModelForSeq2SeqLM)"
        )

    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or [])):
        return "causal_lm"
    if type(config) in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        return "classification"
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return "causal_lm"
    raise UsageError(
        f"--model {ref}: transformers has neither a sequence-classification nor a causal-LM"
        f" head for model type {config.model_type!r}"
    )


def build(um: UserModel) -> nn.Module:
    """The model with random weights on the current default device and dtype (inside
    ``fabric.init_module()``: on the accelerator, in the precision's dtype; under ``torch.device("meta")``:
    shapes only). Vision models get ``image_size``, the resolution the data path resizes to. A Hugging Face
    model is built on the meta device and initialized where it lives (training/your_model/hf_init.py), so
    that building it holds no tensor beyond its weights."""
    if um.source == "torchvision":
        model = tvm.get_model(um.name, weights=None, num_classes=IMAGE_CLASSES)
        model.image_size = _torchvision_size(um.name)
        return model
    if um.source == "timm":
        import timm

        model = timm.create_model(um.name, pretrained=False, num_classes=IMAGE_CLASSES)
        model.image_size = int((model.pretrained_cfg or {}).get("input_size", (3, 224, 224))[-1])
        return model
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

    config = um.hf_config
    config.use_cache = False  # training: a KV cache is a generation feature (and breaks recomputation)
    if um.task == "seq2seq_lm":  # an encoder-decoder: the loss on the target, given the source
        if getattr(config, "decoder_start_token_id", None) is None:  # T5's convention when a config omits it
            config.decoder_start_token_id = config.pad_token_id or 0
        model = hf_init.from_config(AutoModelForSeq2SeqLM, config)
        head = model.get_output_embeddings()
        if getattr(config, "untied_output_embeddings", False) and head is not None:  # the config's own layer
            head.weight = nn.Parameter(head.weight.detach().clone())  # mT5: 582 M parameters, not 390 M
        return model
    if um.task == "classification":
        config.num_labels = TEXT_LABELS
        if config.pad_token_id is None:  # decoder classifiers find the last token through the pad id
            config.pad_token_id = 0
        return hf_init.from_config(AutoModelForSequenceClassification, config)
    return hf_init.from_config(AutoModelForCausalLM, config)


def build_on_meta(um: UserModel) -> nn.Module:
    """:func:`build` on the meta device (shapes only). A constructor that computes with tensor values (torchvision's
    RegNets derive their widths with ``.tolist()``) cannot run there: that model is built on the CPU and moved."""
    try:
        with torch.device("meta"):
            return build(um)
    except NotImplementedError as error:
        if "meta" not in str(error):
            raise
    return build(um).to("meta")


def _torchvision_size(name: str) -> int:
    """The crop size of the model's published weights (224 for most, 299 for Inception v3, ...)."""
    try:
        weights = next(iter(tvm.get_model_weights(name)))
        return int(weights.transforms.keywords.get("crop_size", 224))
    except (ValueError, StopIteration, AttributeError, TypeError):
        return 224


def repeated_blocks(model: nn.Module) -> tuple[tuple[str, ...], str]:
    """(class names of the repeated blocks, how they were found); ``()`` when there are none."""
    present = collections.Counter(type(m).__name__ for m in model.modules())
    hf = [n for n in (getattr(model, "_no_split_modules", None) or []) if present[n] >= 2]  # not embeddings
    if hf:
        return tuple(sorted(hf)), "Hugging Face _no_split_modules"
    for path, how in (("blocks", "timm: model.blocks"), ("encoder.layers", "torchvision: encoder.layers")):
        found = _same_class(model.get_submodule(path)) if _has(model, path) else None
        if found:
            return (found,), how
    counts: collections.Counter[str] = collections.Counter()
    for m in model.modules():
        cls = _same_class(m)
        if cls:
            counts[cls] += len(m)
    if counts:
        return (counts.most_common(1)[0][0],), "the ModuleList/Sequential children of one class"
    return (), "no repeated blocks found"


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def _same_class(m: nn.Module) -> str | None:
    """The class of the children of a ModuleList/Sequential of at least two, all of one class."""
    if not isinstance(m, nn.ModuleList | nn.Sequential) or len(m) < 2:
        return None
    kinds = {type(c) for c in m.children()}
    return next(iter(kinds)).__name__ if len(kinds) == 1 else None


def token_ids(um: UserModel):
    """The special ids the synthetic token stand-in needs (training/data/text_samples.py)."""
    vocab = um.vocab_size or 1024
    pad = um.hf_config.pad_token_id if um.hf_config.pad_token_id is not None else 0
    first = min(1000, max(8, vocab // 10))
    if um.task in ("causal_lm", "seq2seq_lm"):
        return TokenIds(pad=pad, cls=None, sep=None, first_regular=first, vocab_size=vocab)
    return TokenIds(pad=pad, cls=1, sep=2, first_regular=first, vocab_size=vocab)


def compile_repeated(model: nn.Module, blocks: tuple[str, ...]) -> int:
    """Fast mode (regional compilation): ``torch.compile`` each repeated block in place (its checkpoint
    wrapper, when it has one, so the recompute is compiled too); blocks of one class share their compiled
    code. Returns how many were compiled.

    Blocks that hold BatchNorm stay eager: a compiled ResNet-18 block in training mode was not shown equal
    to eager (devtools/your_model/equivalence.py: 18 % of the eager change apart after 6 fp32 Adam steps, the
    same on an H100 and an H200, while eager twice and CUDA graphs alone matched exactly), so such a
    model's fast mode is its CUDA graphs. So is that of a model whose blocks would need more than
    ``regions.MAX_GRAPHS`` distinct compiled graphs (Swin-V2-T: 12 for its 12 blocks), with one line
    saying so; blocks that need 2 to ``MAX_GRAPHS`` are compiled with static shapes (regions.py).

    An encoder-decoder's checkpointed block is compiled inside its wrapper (the recompute reruns the compiled
    block): inductor refused a compiled wrapper of T5's block on a CPU ("Node ... was invalid, but is
    output"), while the block alone compiled."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        wrapped = [m.block for m in model.modules() if type(m).__name__ == "CheckpointedBlock"]
        inside = {id(m) for m in wrapped}
        chosen = wrapped + [m for m in model.modules() if type(m).__name__ in blocks and id(m) not in inside]
        for module in chosen:
            module.compile()
        return len(chosen)
    chosen = _without_batch_norm(model, blocks)
    graphs = regions.distinct_graphs(model, chosen)
    if regions.too_many(graphs):
        console.notice(regions.fallback_notice(type(model).__name__, graphs, len(chosen)))
        return 0
    for module in chosen:
        module.compile(dynamic=regions.dynamic(graphs))
    return len(chosen)


def compilable(model: nn.Module, blocks: tuple[str, ...]) -> list[nn.Module]:
    """The modules fast mode compiles (:func:`compile_repeated`): each repeated block, or its checkpoint
    wrapper, that holds no BatchNorm; none when they would need more distinct compiled graphs than
    regional compilation pays for (regions.py)."""
    chosen = _without_batch_norm(model, blocks)
    return [] if regions.too_many(regions.distinct_graphs(model, chosen)) else chosen


def _without_batch_norm(model: nn.Module, blocks: tuple[str, ...]) -> list[nn.Module]:
    wrapped = [m for m in model.modules() if type(m).__name__ == "CheckpointedBlock"]
    inside = {id(m.block) for m in wrapped}
    chosen = wrapped + [m for m in model.modules() if type(m).__name__ in blocks and id(m) not in inside]
    return [m for m in chosen if not holds_batch_norm(m)]


def holds_batch_norm(module: nn.Module) -> bool:
    """Whether a block holds BatchNorm: fast mode leaves such a block eager (:func:`compile_repeated`)."""
    return any(isinstance(x, nn.modules.batchnorm._BatchNorm) for x in module.modules())

"""IMDb for the bonus recipes: real reviews tokenized with the model's tokenizer, or a synthetic stand-in.

Real first, offline always. ``--data auto|imdb`` looks for IMDb in this order:

1. ``--data-dir`` is a CSV file, or holds ``imdb.csv`` (columns ``text``/``review`` and ``label``/
   ``sentiment``; labels 0/1 or negative/positive);
2. ``--data-dir`` holds the original archive unpacked: ``aclImdb/{train,test}/{pos,neg}/*.txt``;
3. ``datasets.load_dataset("imdb")`` when the ``datasets`` package is installed and the hub is online
   (``network.hub_online``: the same decision as for the weights, HF_HUB_OFFLINE honoured);
4. the archive from ai.stanford.edu, unpacked into ``--data-dir``, when that host is reachable.

All 50,000 labelled reviews are pooled and split 35k / 5k / 10k (train / val / test) with a fixed
permutation, as the article's scripts did. Real text also needs a tokenizer: the model's own from the hub,
or ``--tokenizer`` (a directory, or a WordPiece ``vocab.txt``). Without data or tokenizer, ``--data auto``
falls back to the synthetic stand-in with one printed line; ``--data imdb`` is an error (exit 2).

The synthetic stand-in (token ids made on demand, IMDb-like lengths) is in fabric_memory_recipes/training/data/text_samples.py.

Every sequence is padded to ``--max-length``. The article's scripts padded the whole dataset to its
longest review (``padding=True`` over one batch of everything), i.e. to the truncation length; fixed
shapes also make the peak memory a property of the configuration rather than of which batches were
drawn. ``datasets`` is imported only on the path that uses it (the GPU machines do not have it).
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import os
import tarfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fabric_memory_recipes.config import RunConfig, UsageError, at_least, flag
from fabric_memory_recipes.console import notice
from fabric_memory_recipes.training.data.attention_masks import mask_4d
from fabric_memory_recipes.training.data.network import hub_online, reachable
from fabric_memory_recipes.training.data.text_samples import (
    IGNORE_INDEX,
    NUM_LABELS,
    PaddedReviews,
    SFTSamples,
    TextSplits,
    synthetic,
)
from fabric_memory_recipes.training.techniques.checkpointing import MODES as CHECKPOINT_MODES

DATA_CHOICES = ("auto", "imdb", "synthetic")
SPLIT_FRACTIONS = (0.7, 0.1, 0.2)  # the same proportions as 35k / 5k / 10k, for a smaller CSV or folder
ACLIMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
SFT_QUESTION = "Is the sentiment of this movie review positive or negative?"
SFT_ANSWERS = ("negative", "positive")
__all__ = [
    "IGNORE_INDEX",
    "NUM_LABELS",
    "AfterConfig",
    "TextConfig",
    "TextSplits",
    "load",
    "load_for",
    "synthetic",
]


@dataclass
class TextConfig(RunConfig):
    """The bonus recipes' configuration: the shared flags (with IMDb's and the hub models' meaning of
    --data, --data-dir and --model) and two of their own."""

    max_length: int = flag(
        512, "text", "tokens per sequence: reviews are truncated to it and padded to it", type=at_least(8)
    )
    tokenizer: str | None = flag(
        None,
        "text",
        "tokenizer for real text: a directory or a WordPiece vocab.txt (default: the model's own)",
    )

    GROUPS: ClassVar[dict[str, str]] = {**RunConfig.GROUPS, "text": "text"}
    DATA_CHOICES: ClassVar[tuple[str, ...]] = DATA_CHOICES
    HELP: ClassVar[dict[str, str]] = {
        "data": "auto: IMDb when present or downloadable, else a synthetic token-id stand-in",
        "data_dir": "a folder holding aclImdb/ or imdb.csv (downloads go here), or a CSV file",
        "model": "a hub name (full size) or a *-tiny config (CPU/tests)",
        "mode": "fast: each repeated block of the model compiled, the steps eager; eager: nothing compiled"
        " (default: fast with CUDA, eager on CPU; the before recipes run eagerly)",
        "compile": "torch.compile each repeated block of the model (default: on in fast mode, on one device)",
    }

    def checked(self, hardware) -> TextConfig:
        """The shared checks; fast mode compiles the blocks of a run on one device only (with several, the
        after recipes shard with FSDP, whose units run eagerly here, as rung 08's do)."""
        c = dataclasses.replace(self)
        if c.world_size > 1 and c.compile:
            raise UsageError(
                "--compile works on one device here; with --devices > 1 leave it out (FSDP runs"
                " its units eagerly)"
            )
        if c.world_size > 1:
            c.compile = False
        return super(TextConfig, c).checked(hardware)


@dataclass
class AfterConfig(TextConfig):
    """The after recipes' flags: the text flags and ``--checkpointing`` (rung 10 applied to the model's blocks,
    an option beside the recipe's own techniques: a larger micro-batch with fewer activations kept)."""

    checkpointing: str | None = flag(
        None,
        "text",
        "checkpoint each block (rung 10): full keeps its input only, selective also its matmuls and"
        " attention, and the rest is recomputed in backward (default: none)",
        choices=CHECKPOINT_MODES,
    )

    HELP: ClassVar[dict[str, str]] = {
        **TextConfig.HELP,
        "mode": "fast: each optimizer step one CUDA graph (one GPU), and the blocks compiled where --compile's"
        " default is on; eager: neither (default: fast with CUDA, eager on CPU)",
        "compile": "torch.compile each repeated block of the model (default: the recipe's, in fast mode on one"
        " device)",
    }


# --------------------------------------------------------------------------------------------- real text
def read_aclimdb(root: str) -> tuple[list[str], list[int]]:
    """Every labelled review of an unpacked ``aclImdb`` folder (train and test, pos=1, neg=0)."""
    texts, labels = [], []
    for split in ("train", "test"):
        for name, label in (("neg", 0), ("pos", 1)):
            folder = os.path.join(root, split, name)
            if not os.path.isdir(folder):
                continue
            for file in sorted(os.listdir(folder)):
                if file.endswith(".txt"):
                    with open(os.path.join(folder, file), encoding="utf-8") as f:
                        texts.append(f.read())
                    labels.append(label)
    if not texts:
        raise ValueError(f"{root}: no reviews under {{train,test}}/{{pos,neg}}/*.txt")
    return texts, labels


def _label(value: str) -> int:
    v = value.strip().lower()
    if v in ("1", "pos", "positive"):
        return 1
    if v in ("0", "neg", "negative"):
        return 0
    raise ValueError(f"unknown sentiment label {value!r} (expected 0/1 or negative/positive)")


def read_csv(path: str) -> tuple[list[str], list[int]]:
    """Reviews from a CSV with a header: ``text`` or ``review``, and ``label`` or ``sentiment``."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        text_col = next((c for c in ("text", "review") if c in fields), None)
        label_col = next((c for c in ("label", "sentiment") if c in fields), None)
        if text_col is None or label_col is None:
            raise ValueError(f"{path}: needs columns text|review and label|sentiment, has {fields}")
        rows = [(row[text_col], _label(row[label_col])) for row in reader]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return [r[0] for r in rows], [r[1] for r in rows]


def _load_hf_imdb() -> tuple[list[str], list[int]]:
    from datasets import load_dataset  # optional: the GPU machines behind the committed results lack it

    ds = load_dataset("imdb")
    texts, labels = [], []
    for split in ("train", "test"):  # "unsupervised" has no labels
        texts += list(ds[split]["text"])
        labels += [int(v) for v in ds[split]["label"]]
    return texts, labels


def _download_aclimdb(data_dir: str) -> str:
    os.makedirs(data_dir, exist_ok=True)
    archive = os.path.join(data_dir, os.path.basename(ACLIMDB_URL))
    notice(f"[data] downloading {ACLIMDB_URL} (80 MB) into {data_dir}")
    urllib.request.urlretrieve(ACLIMDB_URL, archive)
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12: refuse paths outside data_dir
            tar.extractall(data_dir, filter="data")
        else:
            tar.extractall(data_dir)
    return os.path.join(data_dir, "aclImdb")


def find_reviews(data_dir: str) -> tuple[str, Callable[[], tuple[list[str], list[int]]]] | None:
    """Where real IMDb can be read from (a description and a reader), or None."""
    if os.path.isfile(data_dir) and data_dir.endswith(".csv"):
        return f"csv {data_dir}", lambda: read_csv(data_dir)
    csv_path = os.path.join(data_dir, "imdb.csv")
    if os.path.isfile(csv_path):
        return f"csv {csv_path}", lambda: read_csv(csv_path)
    folder = os.path.join(data_dir, "aclImdb")
    if os.path.isdir(folder):
        return f"aclImdb folder {folder}", lambda: read_aclimdb(folder)
    if importlib.util.find_spec("datasets") is not None and hub_online():
        return "datasets.load_dataset('imdb')", _load_hf_imdb
    if reachable("ai.stanford.edu"):
        return f"aclImdb archive from {ACLIMDB_URL}", lambda: read_aclimdb(_download_aclimdb(data_dir))
    return None


def split_indices(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A fixed permutation cut 70 / 10 / 20 % (35k / 5k / 10k for IMDb's 50k); each part non-empty."""
    perm = np.random.default_rng(seed).permutation(n)
    n_val = max(1, round(n * SPLIT_FRACTIONS[1]))
    n_test = max(1, round(n * SPLIT_FRACTIONS[2]))
    n_train = n - n_val - n_test
    if n_train < 1:
        raise ValueError(f"{n} reviews are too few to split into train / val / test")
    return perm[:n_train], perm[n_train : n_train + n_val], perm[n_train + n_val :]


# ------------------------------------------------------------------------------------------- tokenizing
def tokenize_reviews(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """Token ids per review, truncated to ``max_length`` (with the tokenizer's [CLS]/[SEP] or <s>/</s>)."""
    return tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]


def sft_prompt_parts(tokenizer) -> tuple[list[int], list[int]]:
    """Token ids before and after the review in the SFT prompt.

    With a chat template (Qwen2-Instruct's), the prompt is a system message and a user message asking
    for the sentiment, followed by the assistant header; otherwise a plain "question / review / answer:"
    layout. Splitting the template around the review lets a long review be truncated without cutting off
    the question or the assistant header.
    """
    marker = "\x00REVIEW\x00"
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"{SFT_QUESTION}\n\n{marker}"},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = f"{SFT_QUESTION}\n\n{marker}\n\nanswer:"
    head, tail = text.split(marker)
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(head), encode(tail)


def tokenize_sft(
    tokenizer, texts: list[str], labels: list[int], max_length: int
) -> list[tuple[list[int], list[int]]]:
    """Reviews as (prompt, completion) token-id pairs: the completion is "positive" or "negative" (+ EOS)."""
    head, tail = sft_prompt_parts(tokenizer)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    answers = [tokenizer(a, add_special_tokens=False)["input_ids"] + eos for a in SFT_ANSWERS]
    reviews = tokenizer(texts, add_special_tokens=False)["input_ids"]
    pairs = []
    for review, label in zip(reviews, labels, strict=True):
        completion = answers[label]
        budget = max(0, max_length - len(head) - len(tail) - len(completion))
        pairs.append((head + review[:budget] + tail, completion))
    return pairs


# ---------------------------------------------------------------------------------------------- choice
def load(
    choice: str,
    data_dir: str,
    max_length: int,
    ids,
    tokenizer_factory: Callable[[], Any],
    task: str = "classification",
    seed: int = 0,
) -> TextSplits:
    """--data auto|imdb|synthetic for a ``task`` of "classification" or "causal_lm" (IMDb as SFT).

    ``tokenizer_factory()`` returns the tokenizer or None; it is called only when real text was found.
    """
    if choice != "synthetic":
        found = find_reviews(data_dir)
        if found is None:
            if choice == "imdb":
                raise UsageError(
                    f"--data imdb: no aclImdb/ or imdb.csv under {data_dir}, and neither huggingface.co"
                    " (with the datasets package) nor ai.stanford.edu is reachable"
                )
            notice(
                "[data] IMDb not found and offline: using the synthetic token-id stand-in (IMDb-like lengths)"
            )
        else:
            tokenizer = tokenizer_factory()
            if tokenizer is not None:
                where, read = found
                return _real(where, read, tokenizer, max_length, task, seed)
            if choice == "imdb":
                raise UsageError(
                    f"--data imdb: IMDb found ({found[0]}) but no tokenizer: the model's is not cached and"
                    " the hub is unreachable; pass --tokenizer DIR|vocab.txt"
                )
            notice("[data] IMDb found but no tokenizer offline: using the synthetic token-id stand-in")
    return synthetic(max_length, ids, task, seed)


def _real(where: str, read: Callable, tokenizer, max_length: int, task: str, seed: int) -> TextSplits:
    texts, labels = read()
    notice(f"[data] IMDb: {len(texts)} reviews from {where}, tokenizing (max length {max_length})")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if task == "classification":
        token_ids = tokenize_reviews(tokenizer, texts, max_length)

        def make(idx):
            return PaddedReviews([token_ids[i] for i in idx], [labels[i] for i in idx], max_length, pad_id)

    else:
        pairs = tokenize_sft(tokenizer, texts, labels, max_length)

        def make(idx):
            return SFTSamples([pairs[i] for i in idx], max_length, pad_id)

    train, val, test = (make(idx) for idx in split_indices(len(texts), seed))
    detail = f"IMDb ({where}), tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}"
    return TextSplits(train, val, test, source="imdb", detail=detail, vocab_size=len(tokenizer))


# ------------------------------------------------------------------------------------------- batch_fns
def sequence_classification(model, batch):
    """batch_fn for ``fabric_memory_recipes.training.loop``: the Hugging Face classifier computes the cross-entropy itself."""
    input_ids, attention_mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    return out.loss, out.logits, labels


def sequence_classification_capturable(model, batch):
    """:func:`sequence_classification` with a 4-D padding mask (``attention_masks.mask_4d``), which a CUDA
    graph can capture: the after recipes' fast mode."""
    input_ids, attention_mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=mask_4d(model, attention_mask, False), labels=labels)
    return out.loss, out.logits, labels


def causal_lm(model, batch, train_accuracy: bool = True):
    """batch_fn for ``fabric_memory_recipes.training.loop``: next-token loss on completion tokens; accuracy on
    the same tokens, as predicted ids (the logits of a 150k vocabulary would be copied for the metric). Their
    selection waits for the forward pass, and its size is data's, which no CUDA graph captures:
    ``train_accuracy=False`` (fast mode's graph) returns the loss alone in training, as the fused loss does."""
    input_ids, attention_mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    if not train_accuracy and torch.is_grad_enabled():
        return out.loss, None, None
    predicted = out.logits[:, :-1].argmax(dim=-1)
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    return out.loss, predicted[keep], targets[keep]


def load_for(cfg: TextConfig, spec: Any, task: str = "classification") -> TextSplits:
    """A bonus recipe's data: :func:`load` with this model's token ids and tokenizer (``spec``: a
    ``training.hf_models.Spec``), from the flags (--data, --data-dir, --max-length, --tokenizer, --seed).
    One call per recipe, as ``fabric_memory_recipes.training.data.load`` is for the ladder."""
    return load(
        cfg.data,
        cfg.data_dir,
        cfg.max_length,
        spec.ids,
        lambda: spec.tokenizer(cfg.tokenizer),
        task=task,
        seed=cfg.seed,
    )

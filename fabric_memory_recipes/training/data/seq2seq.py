"""Sequence-to-sequence data for your model's encoder-decoders (T5, mT5, BART): a source read by the
encoder and a target the decoder learns to write, offline.

``--data auto`` takes real text pairs when ``--data-dir`` is a CSV of them (columns ``source`` and
``target``) or a folder holding ``pairs.csv``, else the synthetic stand-in; ``--data pairs`` insists on
the CSV, ``--data synthetic`` on the stand-in. Pairs are split 70 / 10 / 20 % with a fixed permutation
(as IMDb's reviews are, training/data/text.py).

Tokens: the model's tokenizer when one is at hand offline (``--tokenizer``, or beside a local config),
else :class:`ByteTokenizer`: each UTF-8 byte one token, after the model's special ids (as ByT5 does),
which any vocabulary of at least 259 ids holds. The source is padded to ``--seq-len``, the target to
``--target-len`` with ``IGNORE_INDEX`` (the model makes its decoder input by shifting the target right, and
the shift turns ``IGNORE_INDEX`` into the pad id).

The synthetic stand-in (:class:`SyntheticPairs`) is learnable through the cross-attention: a source holds
one topic token among random tokens, and the target is a chain of answer tokens that starts at the
topic's answer and follows a fixed successor table, so the first target token needs the source and the
later ones the target so far (chance: one in :data:`ANSWER_TOKENS`).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.console import notice
from fabric_memory_recipes.training.data.text import split_indices
from fabric_memory_recipes.training.data.text_samples import (
    IGNORE_INDEX,
    SPLIT_SIZES,
    TextSplits,
    TokenIds,
    pad,
    review_length,
)

PAIRS_FILE = "pairs.csv"
COLUMNS = ("source", "target")
ANSWER_TOKENS = 64  # the synthetic targets' vocabulary
TOPICS = 16  # the synthetic sources' topic tokens (each starts its own chain)
TOPIC_RATE = 0.2  # the share of a synthetic source's tokens that are its topic token
TARGET_MEDIAN = 24  # synthetic target length in tokens (lognormal, shrunk to --target-len)
BYTE_OFFSET = 3  # the byte tokenizer's first id: after pad, eos and unk (ByT5's layout)


class ByteTokenizer:
    """Text as UTF-8 bytes, each byte the id ``offset + byte``; ids below ``offset`` are the model's special
    tokens. ``len()`` is the vocabulary it needs."""

    def __init__(self, offset: int = BYTE_OFFSET) -> None:
        self.offset = offset

    def __len__(self) -> int:
        return self.offset + 256

    def encode(self, text: str) -> list[int]:
        return [self.offset + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256).decode(
            "utf-8", "replace"
        )


def byte_offset(config: Any) -> int:
    """The byte tokenizer's first id for ``config``: after its small special ids (pad, eos, bos, the
    decoder's start), at least :data:`BYTE_OFFSET`."""
    specials = [
        getattr(config, f, None)
        for f in ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id", "unk_token_id")
    ]
    small = [s for s in specials if isinstance(s, int) and 0 <= s < 64]
    return max(BYTE_OFFSET, 1 + max(small, default=0))


def example(
    source: list[int], target: list[int], seq_len: int, target_len: int, pad_id: int, eos: int | None
):
    """One pair as ``(input_ids, attention_mask, labels)``: the source padded to ``seq_len``, the target (with
    its end token) to ``target_len`` with :data:`IGNORE_INDEX`. Too-long texts lose their end."""
    input_ids, mask = pad(list(source)[:seq_len], seq_len, pad_id)
    ids = (list(target) + ([eos] if eos is not None else []))[:target_len]
    labels = torch.full((target_len,), IGNORE_INDEX, dtype=torch.long)
    labels[: len(ids)] = torch.tensor(ids, dtype=torch.long)
    return input_ids, mask, labels


class Pairs:
    """Tokenized ``(source, target)`` pairs as a torch Dataset of :func:`example`."""

    def __init__(
        self,
        pairs: list[tuple[list[int], list[int]]],
        seq_len: int,
        target_len: int,
        ids: TokenIds,
        eos: int | None,
    ) -> None:
        self.pairs, self.seq_len, self.target_len, self.ids, self.eos = pairs, seq_len, target_len, ids, eos

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        source, target = self.pairs[i]
        return example(source, target, self.seq_len, self.target_len, self.ids.pad, self.eos)


class SyntheticPairs:
    """The stand-in: made per sample on demand from ``(seed, split, i)``; the task (topics, answers,
    successors) is the same in every split."""

    def __init__(
        self,
        n: int,
        seq_len: int,
        target_len: int,
        ids: TokenIds,
        eos: int | None,
        seed: int = 0,
        split: int = 0,
    ) -> None:
        self.n, self.seq_len, self.target_len, self.ids, self.eos = n, seq_len, target_len, ids, eos
        self.seed, self.split = seed, split
        rng = np.random.default_rng(seed)
        regular = rng.permutation(np.arange(ids.first_regular, ids.vocab_size))
        k = min(ANSWER_TOKENS, len(regular) // 3)
        topics = min(TOPICS, k)
        self.answers, self.topics, self.words = regular[:k], regular[k : k + topics], regular[k + topics :]
        self.successor = rng.permutation(k)  # answers[j] is followed by answers[successor[j]]
        self.start = rng.choice(k, size=topics, replace=False)  # topic t's chain starts at answers[start[t]]

    def __len__(self) -> int:
        return self.n

    def sample(self, i: int) -> tuple[list[int], list[int]]:
        rng = np.random.default_rng((self.seed, self.split, i))
        topic = int(rng.integers(len(self.topics)))
        source = rng.choice(self.words, size=review_length(rng, self.seq_len))
        source[rng.random(len(source)) < TOPIC_RATE] = self.topics[topic]
        source[0] = self.topics[topic]  # at least once
        n = max(
            2, min(int(rng.lognormal(np.log(TARGET_MEDIAN), 0.5)), self.target_len - (self.eos is not None))
        )
        j, target = int(self.start[topic]), []
        for _ in range(n):
            target.append(int(self.answers[j]))
            j = int(self.successor[j])
        return source.tolist(), target

    def __getitem__(self, i: int):
        source, target = self.sample(i)
        return example(source, target, self.seq_len, self.target_len, self.ids.pad, self.eos)


def find_pairs(data_dir: str) -> str | None:
    """The CSV of pairs ``--data-dir`` names or holds, or None."""
    if os.path.isfile(data_dir) and data_dir.endswith(".csv"):
        return data_dir
    path = os.path.join(data_dir, PAIRS_FILE)
    return path if os.path.isfile(path) else None


def read_pairs(path: str) -> list[tuple[str, str]]:
    """``(source, target)`` texts from a CSV with a header naming ``source`` and ``target``; one line
    (:class:`UsageError`) for anything else."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if not set(COLUMNS) <= set(reader.fieldnames or []):
                raise UsageError(
                    f"--data-dir {path}: needs the columns source and target, has {reader.fieldnames}"
                )
            rows = [(row["source"] or "", row["target"] or "") for row in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UsageError(f"--data-dir {path}: not a readable CSV ({type(e).__name__}: {e})") from None
    rows = [(s, t) for s, t in rows if s.strip() and t.strip()]
    if len(rows) < 3:
        raise UsageError(
            f"--data-dir {path}: {len(rows)} pairs with text on both sides; train, validation and"
            " test need at least 3"
        )
    return rows


def encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """Text to ids without special tokens, for a Hugging Face tokenizer or :class:`ByteTokenizer`."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def load(
    choice: str,
    data_dir: str,
    seq_len: int,
    target_len: int,
    ids: TokenIds,
    eos: int | None,
    tokenizer_factory: Callable[[], Any],
    seed: int = 0,
) -> TextSplits:
    """``--data auto|pairs|synthetic`` for an encoder-decoder. ``tokenizer_factory()`` gives the tokenizer
    for real pairs (a Hugging Face tokenizer or :class:`ByteTokenizer`); it is called only when pairs were
    found."""
    path = None if choice == "synthetic" else find_pairs(data_dir)
    if path is None and choice == "pairs":
        raise UsageError(
            f"--data pairs: --data-dir {data_dir} is neither a CSV nor a folder holding {PAIRS_FILE}"
            " (columns source,target)"
        )
    if path is None:
        if choice == "auto":
            notice(
                f"[data] no {PAIRS_FILE} under {data_dir}: using the synthetic sequence-to-sequence stand-in"
            )
        parts = [SyntheticPairs(n, seq_len, target_len, ids, eos, seed, k) for k, n in enumerate(SPLIT_SIZES)]
        detail = (
            f"synthetic pairs: a topic token in the source sets the target's chain of answer tokens;"
            f" source padded to {seq_len}, target to {target_len}"
        )
        return TextSplits(*parts, source="synthetic", detail=detail)
    texts = read_pairs(path)
    tokenizer = tokenizer_factory()
    encode = encoder(tokenizer)
    pairs = [(encode(s), encode(t)) for s, t in texts]
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    notice(f"[data] {len(pairs)} text pairs from {path}, tokenizer {name}")
    train, val, test = (
        Pairs([pairs[i] for i in idx], seq_len, target_len, ids, eos)
        for idx in split_indices(len(pairs), seed)
    )
    return TextSplits(
        train,
        val,
        test,
        source="pairs",
        detail=f"text pairs ({path}), tokenizer {name}",
        vocab_size=len(tokenizer),
    )


def seq2seq_lm(model, batch):
    """batch_fn for ``fabric_memory_recipes.training.loop``: the model's own loss on the target tokens (it
    shifts the target right for the decoder's input); the predicted ids of those tokens for the accuracy."""
    input_ids, attention_mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    keep = labels != IGNORE_INDEX
    return out.loss, out.logits.argmax(dim=-1)[keep], labels[keep]

"""Text samples of fixed length for the bonus recipes: padded reviews, supervised fine-tuning examples
(loss on the completion only), and the synthetic stand-ins used when IMDb or a tokenizer cannot be had.

The synthetic stand-in is token ids, made per sample on demand (no big arrays): review lengths follow
IMDb's (median ~230 tokens, long tail), truncated to ``--max-length``; a classification label is
learnable from label-specific marker tokens sprinkled into the review; a causal-LM completion follows
a fixed rule from the prompt, so next-token accuracy on it can rise far above chance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

NUM_LABELS = 2
SPLIT_SIZES = (35_000, 5_000, 10_000)  # the article: 50k labelled reviews -> train / val / test
IMDB_MEDIAN_TOKENS = 230  # WordPiece tokens per review, roughly (mean ~300, 99th percentile ~1200)
IMDB_LENGTH_SIGMA = 0.7  # lognormal spread: ~1 in 8 past 512 tokens, ~1 in 1000 past 2048
MIN_REVIEW_TOKENS = 10
IGNORE_INDEX = -100  # label value that cross-entropy (and Hugging Face's causal-LM loss) skips
# Synthetic SFT: prompt and completion lengths of a chat fine-tuning set. The bonus LLM recipe's set-up
# (docs/bonus_llm_finetune.md) fine-tunes on short chat pairs; these medians are of that order (an
# assumption, not a measurement).
SFT_PROMPT_MEDIAN = 120
SFT_COMPLETION_MEDIAN = 200


@dataclass(frozen=True)
class TokenIds:
    """The special token ids a synthetic stand-in needs, and where ordinary tokens start."""

    pad: int
    cls: int | None  # prepended to a classifier's input (None: a causal LM has no [CLS])
    sep: int | None  # appended to a classifier's input
    first_regular: int  # ids below this are special, unused or single characters
    vocab_size: int


SFT_SIGMA = 0.5
SFT_ANSWER_TOKENS = 256  # synthetic SFT: the completions' vocabulary (chance accuracy 1/256)
MARKERS_PER_LABEL = 8  # synthetic reviews: "positive"/"negative" words per label
MARKER_RATE = 0.2  # synthetic reviews: the share of a review's tokens that are its label's markers


@dataclass
class TextSplits:
    """Three torch Datasets of fixed-length samples ``(input_ids, attention_mask, labels)``."""

    train: Any
    val: Any
    test: Any
    source: str  # "imdb" or "synthetic"
    detail: str  # where the text came from / how the stand-in was made
    vocab_size: int | None = None  # the tokenizer's size (real text), to fit a random-init embedding

    def datasets(self) -> tuple[Any, Any, Any]:
        return self.train, self.val, self.test


def pad(ids: list[int], max_length: int, pad_id: int) -> tuple[Any, Any]:
    ids = list(ids)[:max_length]
    n = len(ids)
    input_ids = torch.full((max_length,), pad_id, dtype=torch.long)
    input_ids[:n] = torch.tensor(ids, dtype=torch.long)
    mask = torch.zeros(max_length, dtype=torch.long)
    mask[:n] = 1
    return input_ids, mask


class PaddedReviews:
    """Tokenized reviews and labels as a torch Dataset of ``(input_ids, attention_mask, label)``."""

    def __init__(self, token_ids: list[list[int]], labels: list[int], max_length: int, pad_id: int) -> None:
        self.token_ids, self.labels = token_ids, labels
        self.max_length, self.pad_id = max_length, pad_id

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        input_ids, mask = pad(self.token_ids[i], self.max_length, self.pad_id)
        return input_ids, mask, torch.tensor(self.labels[i], dtype=torch.long)


# -------------------------------------------------------------------------------------- synthetic text
def review_length(rng: np.random.Generator, max_length: int) -> int:
    """A review length in tokens drawn from an IMDb-like lognormal, truncated to ``max_length``."""
    n = int(round(rng.lognormal(np.log(IMDB_MEDIAN_TOKENS), IMDB_LENGTH_SIGMA)))
    return max(MIN_REVIEW_TOKENS, min(n, max_length))


class SyntheticReviews:
    """A stand-in for tokenized IMDb reviews whose sentiment is learnable.

    Sample ``i`` is made on demand from ``(seed, split, i)``: a label, an IMDb-like length, uniform
    random ordinary tokens, and about ``MARKER_RATE`` of them replaced by tokens from a small set that
    belongs to the label (a few "positive" and "negative" words). Memory and speed depend only on the
    padded shape, so the measurements hold; accuracy on it only shows that training works.
    """

    def __init__(self, n: int, max_length: int, ids: TokenIds, seed: int = 0, split: int = 0) -> None:
        self.n, self.max_length, self.ids, self.seed, self.split = n, max_length, ids, seed, split
        rng = np.random.default_rng(seed)  # the task (which tokens are markers) is the same in every split
        chosen = rng.choice(
            np.arange(ids.first_regular, ids.vocab_size), size=NUM_LABELS * MARKERS_PER_LABEL, replace=False
        )
        self.markers = chosen.reshape(NUM_LABELS, MARKERS_PER_LABEL)

    def __len__(self) -> int:
        return self.n

    def sample(self, i: int) -> tuple[list[int], int]:
        """Token ids (with [CLS]/[SEP] when the model has them) and the label of sample ``i``."""
        rng = np.random.default_rng((self.seed, self.split, i))
        label = int(rng.integers(NUM_LABELS))
        specials = (self.ids.cls is not None) + (self.ids.sep is not None)
        n_body = review_length(rng, self.max_length) - specials
        body = rng.integers(self.ids.first_regular, self.ids.vocab_size, size=n_body)
        marked = rng.random(n_body) < MARKER_RATE
        body[marked] = rng.choice(self.markers[label], size=int(marked.sum()))
        ids = ([self.ids.cls] if self.ids.cls is not None else []) + body.tolist()
        ids += [self.ids.sep] if self.ids.sep is not None else []
        return ids, label

    def __getitem__(self, i: int):
        ids, label = self.sample(i)
        input_ids, mask = pad(ids, self.max_length, self.ids.pad)
        return input_ids, mask, torch.tensor(label, dtype=torch.long)


# ---------------------------------------------------------------------------------------- causal-LM SFT
def sft_example(
    prompt_ids: list[int], completion_ids: list[int], max_length: int, pad_id: int
) -> tuple[Any, Any, Any]:
    """One supervised fine-tuning sample: ``(input_ids, attention_mask, labels)``, each ``max_length`` long.

    The model reads prompt + completion; the loss is taken on the completion only: ``labels`` is
    ``IGNORE_INDEX`` (-100) on every prompt token and on the padding, and the token id elsewhere.
    (Hugging Face's causal-LM loss shifts the labels by one itself.) Too-long samples lose their end.
    """
    ids = (list(prompt_ids) + list(completion_ids))[:max_length]
    input_ids, mask = pad(ids, max_length, pad_id)
    labels = torch.full((max_length,), IGNORE_INDEX, dtype=torch.long)
    start, stop = min(len(prompt_ids), max_length), len(ids)
    labels[start:stop] = input_ids[start:stop]
    return input_ids, mask, labels


class SFTSamples:
    """Pre-tokenized ``(prompt_ids, completion_ids)`` pairs as a Dataset of :func:`sft_example`."""

    def __init__(self, pairs: list[tuple[list[int], list[int]]], max_length: int, pad_id: int) -> None:
        self.pairs, self.max_length, self.pad_id = pairs, max_length, pad_id

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        prompt, completion = self.pairs[i]
        return sft_example(prompt, completion, self.max_length, self.pad_id)


class SyntheticSFT:
    """A stand-in for a chat fine-tuning set: random prompts and completions that follow a fixed rule.

    The completion vocabulary is ``SFT_ANSWER_TOKENS`` ordinary tokens (disjoint from the prompt's); its first
    token is set by the prompt's last token and every next token by the one before (a fixed random
    successor table), so next-token accuracy on completions can approach 1 while chance is
    1 / SFT_ANSWER_TOKENS. Prompt and completion lengths are lognormal (medians ``SFT_PROMPT_MEDIAN`` and
    ``SFT_COMPLETION_MEDIAN``) and shrink together to fit ``max_length``.
    """

    def __init__(self, n: int, max_length: int, ids: TokenIds, seed: int = 0, split: int = 0) -> None:
        self.n, self.max_length, self.ids, self.seed, self.split = n, max_length, ids, seed, split
        rng = np.random.default_rng(seed)
        regular = np.arange(ids.first_regular, ids.vocab_size)
        k = min(SFT_ANSWER_TOKENS, len(regular) // 2)
        chosen = rng.permutation(regular)
        self.answers, self.prompt_vocab = chosen[:k], np.sort(chosen[k:])
        self.successor = rng.permutation(k)  # answers[j] is followed by answers[successor[j]]

    def __len__(self) -> int:
        return self.n

    def lengths(self, rng: np.random.Generator) -> tuple[int, int]:
        p = rng.lognormal(np.log(SFT_PROMPT_MEDIAN), SFT_SIGMA)
        c = rng.lognormal(np.log(SFT_COMPLETION_MEDIAN), SFT_SIGMA)
        scale = min(1.0, self.max_length / (p + c))
        p = max(1, int(p * scale))
        return p, max(2, min(int(c * scale), self.max_length - p))

    def sample(self, i: int) -> tuple[list[int], list[int]]:
        rng = np.random.default_rng((self.seed, self.split, i))
        n_prompt, n_completion = self.lengths(rng)
        prompt = rng.choice(self.prompt_vocab, size=n_prompt)
        j = int(prompt[-1]) % len(self.answers)
        completion = []
        for _ in range(n_completion):
            completion.append(int(self.answers[j]))
            j = int(self.successor[j])
        return prompt.tolist(), completion

    def __getitem__(self, i: int):
        prompt, completion = self.sample(i)
        return sft_example(prompt, completion, self.max_length, self.ids.pad)


def synthetic(max_length: int, ids: TokenIds, task: str = "classification", seed: int = 0) -> TextSplits:
    """The stand-in splits (35k / 5k / 10k samples, made on demand)."""
    make = SyntheticReviews if task == "classification" else SyntheticSFT
    parts = [make(n, max_length, ids, seed=seed, split=k) for k, n in enumerate(SPLIT_SIZES)]
    what = "marker tokens set the label" if task == "classification" else "completions follow a fixed rule"
    detail = f"synthetic token ids, IMDb-like lengths padded to {max_length}, {what}"
    return TextSplits(*parts, source="synthetic", detail=detail)

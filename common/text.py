"""IMDb for the bonus recipes: real reviews tokenized with the model's tokenizer, or a synthetic stand-in.

Real first (DESIGN.md principle 4). ``--data auto|imdb`` looks for IMDb in this order:

1. ``--data-dir`` is a CSV file, or holds ``imdb.csv`` (columns ``text``/``review`` and ``label``/
   ``sentiment``; labels 0/1 or negative/positive);
2. ``--data-dir`` holds the original archive unpacked: ``aclImdb/{train,test}/{pos,neg}/*.txt``;
3. ``datasets.load_dataset("imdb")`` when the ``datasets`` package is installed and the hub is online
   (``hf_models.hub_online``: the same decision as for the weights, HF_HUB_OFFLINE honoured);
4. the archive from ai.stanford.edu, unpacked into ``--data-dir``, when that host is reachable.

All 50,000 labelled reviews are pooled and split 35k / 5k / 10k (train / val / test) with a fixed
permutation, as the article's scripts did. Real text also needs a tokenizer: the model's own from the hub,
or ``--tokenizer`` (a directory, or a WordPiece ``vocab.txt``). Without data or tokenizer, ``--data auto``
falls back to the synthetic stand-in with one printed line; ``--data imdb`` is an error (exit 2).

The synthetic stand-in is token ids, made per sample on demand (no big arrays): review lengths follow
IMDb's (median ~230 tokens, long tail), truncated to ``--max-length``; a classification label is
learnable from label-specific marker tokens sprinkled into the review; a causal-LM completion follows
a fixed rule from the prompt, so next-token accuracy on it can rise far above chance.

Every sequence is padded to ``--max-length``. The article's scripts padded the whole dataset to its
longest review (``padding=True`` over one batch of everything), i.e. to the truncation length; fixed
shapes also make the peak memory a property of the configuration rather than of which batches were
drawn. ``datasets`` is imported only on the path that uses it (the GPU machines do not have it).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from common import cli
from common.hf_models import TokenIds, hub_online

DATA_CHOICES = ("auto", "imdb", "synthetic")
HELP = {  # cli.HELP for the text recipes: the shared flags whose meaning is IMDb's and the hub models'
    "data": "auto: IMDb when present or downloadable, else a synthetic token-id stand-in",
    "data_dir": "a folder holding aclImdb/ or imdb.csv (downloads go here), or a CSV file",
    "model": "a hub name (full size) or a *-tiny config (CPU/tests)",
}
NUM_LABELS = 2
SPLIT_SIZES = (35_000, 5_000, 10_000)  # the article: 50k labelled reviews -> train / val / test
SPLIT_FRACTIONS = (0.7, 0.1, 0.2)  # the same proportions for a smaller CSV or folder
IMDB_MEDIAN_TOKENS = 230  # WordPiece tokens per review, roughly (mean ~300, 99th percentile ~1200)
IMDB_LENGTH_SIGMA = 0.7  # lognormal spread: ~1 in 8 past 512 tokens, ~1 in 1000 past 2048
MIN_REVIEW_TOKENS = 10
IGNORE_INDEX = -100  # label value that cross-entropy (and Hugging Face's causal-LM loss) skips
ACLIMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
# Synthetic SFT: prompt and completion lengths of a chat fine-tuning set (seed 001 used 100 UltraFeedback
# prompt/completion pairs; these medians are of that order, not measured from it).
SFT_PROMPT_MEDIAN = 120
SFT_COMPLETION_MEDIAN = 200
SFT_SIGMA = 0.5
SFT_QUESTION = "Is the sentiment of this movie review positive or negative?"
SFT_ANSWERS = ("negative", "positive")
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


# ------------------------------------------------------------------------------------------------ flags
def add_flags(parser) -> None:
    """The text recipes' own flags, ``--max-length`` and ``--tokenizer``. Their ``--data`` choices and
    help come with ``cli.run(..., data_choices=DATA_CHOICES, help_overrides=HELP)``."""
    g = parser.add_argument_group("text")
    g.add_argument(
        "--max-length",
        type=cli.at_least(8),
        help="tokens per sequence: reviews are truncated to it and padded to it",
    )
    g.add_argument(
        "--tokenizer",
        help="tokenizer for real text: a directory or a WordPiece vocab.txt (default: the model's own)",
    )


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
    from datasets import load_dataset

    ds = load_dataset("imdb")
    texts, labels = [], []
    for split in ("train", "test"):  # "unsupervised" has no labels
        texts += list(ds[split]["text"])
        labels += [int(v) for v in ds[split]["label"]]
    return texts, labels


def _download_aclimdb(data_dir: str) -> str:
    import tarfile
    import urllib.request

    from common.net import note

    os.makedirs(data_dir, exist_ok=True)
    archive = os.path.join(data_dir, os.path.basename(ACLIMDB_URL))
    note(f"[data] downloading {ACLIMDB_URL} (80 MB) into {data_dir}")
    urllib.request.urlretrieve(ACLIMDB_URL, archive)
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12: refuse paths outside data_dir
            tar.extractall(data_dir, filter="data")
        else:
            tar.extractall(data_dir)  # noqa: S202 - a fixed, well-known archive
    return os.path.join(data_dir, "aclImdb")


def find_reviews(data_dir: str) -> tuple[str, Callable[[], tuple[list[str], list[int]]]] | None:
    """Where real IMDb can be read from (a description and a reader), or None."""
    from common.net import reachable

    if os.path.isfile(data_dir) and data_dir.endswith(".csv"):
        return f"csv {data_dir}", lambda: read_csv(data_dir)
    csv_path = os.path.join(data_dir, "imdb.csv")
    if os.path.isfile(csv_path):
        return f"csv {csv_path}", lambda: read_csv(csv_path)
    folder = os.path.join(data_dir, "aclImdb")
    if os.path.isdir(folder):
        return f"aclImdb folder {folder}", lambda: read_aclimdb(folder)
    import importlib.util

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


def _pad(ids: list[int], max_length: int, pad_id: int) -> tuple[Any, Any]:
    import torch

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
        import torch

        input_ids, mask = _pad(self.token_ids[i], self.max_length, self.pad_id)
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
        import torch

        ids, label = self.sample(i)
        input_ids, mask = _pad(ids, self.max_length, self.ids.pad)
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
    import torch

    ids = (list(prompt_ids) + list(completion_ids))[:max_length]
    input_ids, mask = _pad(ids, max_length, pad_id)
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
    ids: TokenIds,
    tokenizer_factory: Callable[[], Any],
    task: str = "classification",
    seed: int = 0,
) -> TextSplits:
    """--data auto|imdb|synthetic for a ``task`` of "classification" or "causal_lm" (IMDb as SFT).

    ``tokenizer_factory()`` returns the tokenizer or None; it is called only when real text was found.
    """
    from common.cli import UsageError
    from common.net import note

    if choice != "synthetic":
        found = find_reviews(data_dir)
        if found is None:
            if choice == "imdb":
                raise UsageError(
                    f"--data imdb: no aclImdb/ or imdb.csv under {data_dir}, and neither huggingface.co"
                    " (with the datasets package) nor ai.stanford.edu is reachable"
                )
            note(
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
            note("[data] IMDb found but no tokenizer offline: using the synthetic token-id stand-in")
    return synthetic(max_length, ids, task, seed)


def synthetic(max_length: int, ids: TokenIds, task: str = "classification", seed: int = 0) -> TextSplits:
    """The stand-in splits (35k / 5k / 10k samples, made on demand)."""
    make = SyntheticReviews if task == "classification" else SyntheticSFT
    parts = [make(n, max_length, ids, seed=seed, split=k) for k, n in enumerate(SPLIT_SIZES)]
    what = "marker tokens set the label" if task == "classification" else "completions follow a fixed rule"
    detail = f"synthetic token ids, IMDb-like lengths padded to {max_length}, {what}"
    return TextSplits(*parts, source="synthetic", detail=detail)


def _real(where: str, read: Callable, tokenizer, max_length: int, task: str, seed: int) -> TextSplits:
    from common.net import note

    texts, labels = read()
    note(f"[data] IMDb: {len(texts)} reviews from {where}, tokenizing (max length {max_length})")
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


# --------------------------------------------------------------------------------------------- loaders
def loaders(splits: TextSplits, *args: Any, **kwargs: Any):
    """Train (shuffled, whole micro-batches only) and val/test DataLoaders, sharded per rank when
    several processes run: ``common.data.dataloaders`` (same further arguments), the rules the images
    follow."""
    from common.data import dataloaders

    return dataloaders(splits.train, splits.val, splits.test, *args, **kwargs)


# ------------------------------------------------------------------------------------------- batch_fns
def sequence_classification(model, batch):
    """batch_fn for ``common.loop``: the Hugging Face classifier computes the cross-entropy itself."""
    input_ids, attention_mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    return out.loss, out.logits, labels


def causal_lm(model, batch):
    """batch_fn for ``common.loop``: next-token loss on completion tokens; accuracy on the same tokens.

    Returns the predicted ids (argmax, a small int tensor) rather than the logits, which at a 150k
    vocabulary would be copied for the metric. Selecting the completion tokens makes the host wait for
    the forward pass once per micro-batch; negligible next to a forward pass of a 0.5B model.
    """
    input_ids, attention_mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    predicted = out.logits[:, :-1].argmax(dim=-1)
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    return out.loss, predicted[keep], targets[keep]

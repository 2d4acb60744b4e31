"""Tiny models, data and files the tests make: a two-layer network on random features (the loop's
tests), CIFAR-10's python pickles written to a folder (the data loaders' tests), the configs of two
tiny Hugging Face models (your model's tests) and a two-block Swin-V2 (checkpointing's tests)."""

from __future__ import annotations

import pickle

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchvision.models import swin_transformer

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.measurement.results import RunResults

IN, OUT = 12, 10
# Two Hugging Face configs your model's tests build (hf:<folder>): a 2-layer Llama causal LM of width 64, its
# embeddings tied, and a 2-layer BERT (BertForMaskedLM: a sequence classifier for the runner) without dropout.
HF_BERT = dict(
    model_type="bert",
    architectures=["BertForMaskedLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=1000,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


QWEN2_BASE = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    tie_word_embeddings=True,
)


def causal_lm_config(**overrides) -> dict:
    """A small Qwen2-shaped causal LM's config (hf:<folder>), embeddings tied: 2 layers of width 64, 4 heads
    over 2 key-value heads, a 1000-token vocabulary; ``overrides`` change any field."""
    return {**QWEN2_BASE, **overrides}


def make_log() -> RunResults:
    return RunResults(RunConfig(recipe="test_loop", batch_size=8, accumulation_steps=2, results_dir="unused"))


def settings(**flags) -> RunConfig:
    """What the loop reads from a run's configuration: accumulation, epochs, max steps, logging, ..."""
    return RunConfig(recipe="test_loop", **flags)


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))


def tiny_swin_v2(seed: int = 0) -> nn.Module:
    """One stage of two Swin-V2 blocks (the second's windows shifted) on 16 x 16 images, 3 classes: the blocks of
    torchvision's swin_v2_t, whose position-bias MLP runs ``ReLU(inplace=True)`` on a linear layer's output."""
    torch.manual_seed(seed)
    return swin_transformer.SwinTransformer(
        patch_size=[4, 4],
        embed_dim=16,
        depths=[2],
        num_heads=[2],
        window_size=[2, 2],
        stochastic_depth_prob=0.0,
        num_classes=3,
        block=swin_transformer.SwinTransformerBlockV2,
        downsample_layer=swin_transformer.PatchMergingV2,
    )


def tiny_data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g)


def batch_fn(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), logits, y


def loader(x, y, micro: int) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=micro, shuffle=False)


# ------------------------------------------------------------------------------------ CIFAR-10 files
PER_BATCH = 60
N_TRAIN_FILES = 2
N_TEST = 30


def _cifar_rows(n: int, first_id: int, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """n rows of CIFAR-10's layout: 3072 bytes = 1024 red, 1024 green, 1024 blue, each row-major 32x32.
    Every image carries a unique id in its top-left pixel (red = id % 256, green = id // 256)."""
    rows = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    ids = np.arange(first_id, first_id + n)
    rows[:, 0] = ids % 256  # channel 0, row 0, col 0
    rows[:, 1024] = ids // 256  # channel 1, row 0, col 0
    labels = [int(v) for v in (ids * 7) % 10]  # a label derived from the id, checkable after shuffling
    return rows, labels


def write_cifar(root, n_train_files: int = N_TRAIN_FILES, per_batch: int = PER_BATCH, n_test: int = N_TEST):
    """Write <root>/cifar-10-batches-py/data_batch_1..n and test_batch as CIFAR-10's python pickles."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(42)
    raw = {}
    for i in range(1, n_train_files + 1):
        rows, labels = _cifar_rows(per_batch, (i - 1) * per_batch, rng)
        entry = {b"batch_label": f"training batch {i} of 5".encode(), b"labels": labels, b"data": rows}
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump(entry, f, protocol=2)
        raw[f"data_batch_{i}"] = (rows, labels)
    rows, labels = _cifar_rows(n_test, 10_000, rng)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(
            {b"batch_label": b"testing batch 1 of 1", b"labels": labels, b"data": rows}, f, protocol=2
        )
    raw["test_batch"] = (rows, labels)
    return raw


HF_LLAMA = causal_lm_config(model_type="llama", architectures=["LlamaForCausalLM"])

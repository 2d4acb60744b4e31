"""CIFAR-10 and scikit-learn's digits (real) and a learnable synthetic stand-in, kept as uint8 on the host.

Why uint8 on the host: the reference scripts resized every image to 224x224 on the CPU in the
DataLoader, which made the small-batch rungs wait on the CPU. Here a batch travels as 3 KB per image and
:func:`to_model_input` resizes and normalises it on the accelerator, where it costs microseconds.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchvision.datasets import CIFAR10

from fabric_memory_recipes import paths
from fabric_memory_recipes.config import RunConfig, UsageError
from fabric_memory_recipes.console import notice
from fabric_memory_recipes.faults import BadInput
from fabric_memory_recipes.training.data import digits
from fabric_memory_recipes.training.data.network import reachable

# batch_fn(model, batch) -> (loss, logits, targets): how a batch becomes a loss; the loop is model-agnostic.
BatchFn = Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

NUM_CLASSES = 10
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_FILE = "test_batch"
CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR_MD5 = "c58f30108f718f92721af3b95e74349a"  # published with the archive (and checked by torchvision)
SPLIT_SIZES = (45_000, 5_000, 10_000)  # train / val / test, as in the article


@dataclass
class Splits:
    """Three splits of uint8 images (N, H, W, C) and int64 labels (N,), plus where they came from.

    CIFAR-10 and the synthetic stand-in are (N, 32, 32, 3); digits are (N, 8, 8, 1).
    """

    train: tuple[np.ndarray, np.ndarray]
    val: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]
    source: str  # "cifar10", "digits" or "synthetic"

    @property
    def real(self) -> bool:
        """Real images: accuracy on them is a measurement; on the synthetic stand-in it is not."""
        return self.source != "synthetic"

    def datasets(self) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        """train / val / test as torch Datasets of (uint8 images, int64 labels), sharing the arrays."""
        return tuple(
            TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
            for x, y in (self.train, self.val, self.test)
        )


# ---------------------------------------------------------------------------------------------- real data
def read_cifar10_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Read one file of CIFAR-10's python format: a pickled dict with b'data' (N, 3072, channel-major
    uint8) and b'labels'. Returns images as (N, 32, 32, 3) uint8 and labels as int64.

    A file that is truncated or not such a batch raises ``BadInput`` naming it (one line, exit 2)."""
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="bytes")
        data = entry.get(b"data", entry.get("data"))
        labels = entry.get(b"labels", entry.get("labels"))
        if data is None or labels is None:
            raise ValueError("no data/labels keys")
        images = np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BadInput(
            f"{path}: not a readable CIFAR-10 batch file ({reason}); restore it, or delete"
            f" {os.path.dirname(path)} to extract or download CIFAR-10 again"
        ) from None
    return np.ascontiguousarray(images), np.asarray(labels, dtype=np.int64)


def cifar10_present(data_dir: str) -> bool:
    folder = os.path.join(data_dir, CIFAR_FOLDER)
    return os.path.exists(os.path.join(folder, CIFAR_TEST_FILE)) and os.path.exists(
        os.path.join(folder, CIFAR_TRAIN_FILES[0])
    )


def read_cifar10(data_dir: str, seed: int = 0) -> Splits:
    """Read the train batches that exist and the test batch; split train into train/val (45k/5k for
    the full set, 90%/10% for a partial one) with a fixed permutation so every rung sees the same."""
    folder = os.path.join(data_dir, CIFAR_FOLDER)
    parts = [
        read_cifar10_batch(os.path.join(folder, f))
        for f in CIFAR_TRAIN_FILES
        if os.path.exists(os.path.join(folder, f))
    ]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    n_val = SPLIT_SIZES[1] if len(x) == sum(SPLIT_SIZES[:2]) else max(1, len(x) // 10)
    perm = np.random.default_rng(seed).permutation(len(x))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    test = read_cifar10_batch(os.path.join(folder, CIFAR_TEST_FILE))
    return Splits((x[train_idx], y[train_idx]), (x[val_idx], y[val_idx]), test, "cifar10")


def download_cifar10(data_dir: str) -> None:
    """Fetch and verify the archive with torchvision (the reading is ours, see read_cifar10)."""
    CIFAR10(root=data_dir, train=True, download=True)


def extract_cifar10_archive(data_dir: str) -> None:
    """Extract ``<data_dir>/cifar-10-python.tar.gz`` (placed there by hand, e.g. on an offline machine)
    after checking it against the published MD5. Only regular files inside ``cifar-10-batches-py/`` are
    extracted, into a temporary folder first; files already in place are kept. A wrong checksum or a
    damaged archive raises ``BadInput`` naming the archive."""
    archive = os.path.join(data_dir, CIFAR_ARCHIVE)
    md5 = hashlib.md5(usedforsecurity=False)
    with open(archive, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            md5.update(chunk)
    if md5.hexdigest() != CIFAR_MD5:
        raise BadInput(
            f"{archive}: MD5 {md5.hexdigest()} is not the published {CIFAR_MD5}: the archive is incomplete"
            " or another file; replace it (or delete it, and the next run online downloads it)"
        )
    target = os.path.join(data_dir, CIFAR_FOLDER)
    scratch = tempfile.mkdtemp(prefix=".extract-", dir=data_dir)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.isfile() and m.name.startswith(CIFAR_FOLDER + "/") and ".." not in m.name.split("/")
            ]
            if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: also refuses odd modes
                tar.extractall(scratch, members=members, filter="data")
            else:
                tar.extractall(scratch, members=members)
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(os.path.join(scratch, CIFAR_FOLDER)):
            if not os.path.exists(os.path.join(target, name)):
                os.replace(os.path.join(scratch, CIFAR_FOLDER, name), os.path.join(target, name))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BadInput(f"{archive}: cannot be extracted ({e})") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ----------------------------------------------------------------------------------------- synthetic data
def synthetic(sizes: tuple[int, int, int] = SPLIT_SIZES, seed: int = 0, noise: float = 48.0) -> Splits:
    """A stand-in with CIFAR-10's shapes whose classes are learnable.

    Each class has a template: a random 4x4 colour pattern blown up to 32x32. A sample is its class
    template plus Gaussian pixel noise. Memory and speed do not depend on pixel values, so a rung's
    measurements hold; accuracy on this data only shows that the rung still learns.
    """
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(40, 215, size=(NUM_CLASSES, 4, 4, 3))
    templates = coarse.repeat(8, axis=1).repeat(8, axis=2).astype(np.float32)  # (10, 32, 32, 3)

    def make(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, NUM_CLASSES, size=n)
        x = np.empty((n, 32, 32, 3), dtype=np.uint8)
        for start in range(0, n, 5000):  # chunks keep the float temporaries small
            stop = min(n, start + 5000)
            noisy = (
                templates[y[start:stop]]
                + rng.standard_normal((stop - start, 32, 32, 3), dtype=np.float32) * noise
            )
            x[start:stop] = np.clip(noisy, 0, 255)
        return x, y.astype(np.int64)

    return Splits(make(sizes[0]), make(sizes[1]), make(sizes[2]), "synthetic")


SYNTHETIC_CACHE = "synthetic-v1-seed0.npz"  # the default stand-in (SPLIT_SIZES, seed 0), made once


def synthetic_cached(data_dir: str) -> Splits:
    """:func:`synthetic` with its defaults, kept in ``data_dir`` after the first run.

    Drawing 184 M Gaussian samples takes seconds per process, and a benchmark call starts dozens of
    processes. The file (184 MB) is written atomically; one that cannot be read is made again, and a
    folder that cannot be written to only costs the seconds."""
    path = os.path.join(data_dir, SYNTHETIC_CACHE)
    try:
        with np.load(path) as f:
            parts = [(f[f"x{i}"], f[f"y{i}"]) for i in range(3)]
        if [len(x) for x, _ in parts] == list(SPLIT_SIZES):
            return Splits(*parts, "synthetic")
    except (OSError, ValueError, KeyError, EOFError):
        pass  # absent or unreadable: make it
    splits = synthetic()
    arrays = {
        f"{k}{i}": part[j]
        for i, part in enumerate((splits.train, splits.val, splits.test))
        for j, k in enumerate("xy")
    }
    try:
        os.makedirs(data_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=data_dir)
        os.fchmod(fd, paths.shared_mode())  # mkstemp makes 0600: other users and jobs read the cache too
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)
    return splits


# ------------------------------------------------------------------------------------------------ choice
def load_digits() -> Splits:
    """scikit-learn's bundled digits: fixed stratified splits of real 8x8 images (fabric_memory_recipes/training/data/digits.py)."""
    (train, val, test), _ = digits.splits()
    return Splits(train, val, test, "digits")


def load(choice: str, data_dir: str = "data") -> Splits:
    """--data auto|cifar10|digits|synthetic. ``auto`` uses CIFAR-10 if present or downloadable, else
    the real digits bundled with scikit-learn, with one printed line. ``cifar10`` offline is a
    UsageError (exit 2). ``synthetic`` is for memory and speed runs only: CIFAR-10's shapes and sizes,
    but its accuracy is not a score."""
    if choice == "synthetic":
        return synthetic_cached(data_dir)
    if not cifar10_present(data_dir) and os.path.exists(os.path.join(data_dir, CIFAR_ARCHIVE)):
        extract_cifar10_archive(data_dir)  # an archive placed by hand: verified, then extracted
    if choice == "digits":
        return load_digits()
    if not cifar10_present(data_dir):
        if reachable("www.cs.toronto.edu"):
            download_cifar10(data_dir)
        elif choice == "cifar10":
            raise UsageError(
                f"--data cifar10: not found under {data_dir}/{CIFAR_FOLDER} and the network is unreachable"
            )
        else:
            notice(
                "[data] CIFAR-10 not found and offline: using scikit-learn's bundled digits (real 8x8 images)"
            )
            return load_digits()
    return read_cifar10(data_dir)


def loaders(splits, cfg: RunConfig, fabric, shard: bool = False) -> tuple[DataLoader, DataLoader, DataLoader]:
    """A recipe's train / val / test DataLoaders over ``splits.datasets()``: micro-batches of
    ``cfg.micro_batch_size``, ``cfg.num_workers`` workers, pinned host memory on CUDA. ``shard``: every
    process reads its own shard (the sharded rungs); otherwise Fabric's ``setup_dataloaders`` adds a
    DistributedSampler when several processes run."""
    return build_loaders(
        splits.datasets(),
        cfg.micro_batch_size,
        cfg.micro_batch_size,
        cfg.num_workers,
        pin_memory=fabric.device.type == "cuda",
        world_size=fabric.world_size if shard else 1,
        rank=fabric.global_rank if shard else 0,
        seed=cfg.seed,
    )


def build_loaders(
    datasets,
    micro_batch_size: int,
    eval_batch_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    world_size: int = 1,
    rank: int = 0,
    seed: int = 0,
) -> tuple[DataLoader, DataLoader, DataLoader]:
    """Train (shuffled, whole micro-batches only) and val/test DataLoaders over (train, val, test) Datasets.

    ``drop_last=True`` on train keeps every micro-batch the same size, so averaging the loss over the
    micro-batches of an accumulation group equals the loss of the big batch.
    With several processes each rank reads its own shard through a ``DistributedSampler``: on train
    with ``drop_last=True`` (disjoint shards, no sample repeated); on val/test without it, so every
    sample is seen and all ranks run the same number of batches (sharded models need every rank in
    every forward). The sampler pads only when a split does not divide by the world size.
    Fabric's ``setup_dataloaders`` keeps a DistributedSampler it is given.
    """
    train_ds, val_ds, test_ds = datasets
    common = dict(num_workers=num_workers, pin_memory=pin_memory, persistent_workers=num_workers > 0)
    if world_size > 1:

        def shard(d, shuffle, drop_last):
            return DistributedSampler(d, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)

        train = DataLoader(
            train_ds, micro_batch_size, sampler=shard(train_ds, True, True), drop_last=True, **common
        )
        val = DataLoader(val_ds, eval_batch_size, sampler=shard(val_ds, False, False), **common)
        test = DataLoader(test_ds, eval_batch_size, sampler=shard(test_ds, False, False), **common)
        return train, val, test
    train = DataLoader(train_ds, batch_size=micro_batch_size, shuffle=True, drop_last=True, **common)
    val = DataLoader(val_ds, batch_size=eval_batch_size, shuffle=False, **common)
    test = DataLoader(test_ds, batch_size=eval_batch_size, shuffle=False, **common)
    return train, val, test


def image_classification(image_size: int) -> BatchFn:
    """The ladder's batch_fn: uint8 images on the device -> resize/normalise on the device -> logits
    -> cross-entropy."""

    def batch_fn(model, batch):
        images, targets = batch
        logits = model(to_model_input(images, image_size))
        return F.cross_entropy(logits, targets), logits, targets

    return batch_fn


def to_model_input(images, image_size: int):
    """uint8 (N, H, W, C) on the device -> normalised float (N, 3, S, S), resized on the device.

    Called inside the training loop on a batch Fabric has already moved, so the 224x224 float images
    only ever exist on the accelerator (196x the bytes of the uint8 originals). A one-channel batch
    (digits) is resized as one channel and then repeated to three (a view, no copy).
    """
    x = images.permute(0, 3, 1, 2).float().div_(255.0)
    if x.shape[-1] != image_size:
        x = F.interpolate(
            x, size=(image_size, image_size), mode="bilinear", align_corners=False, antialias=False
        )
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    mean, std = _normalisation(x.device)
    return (x - mean) / std


@functools.cache
def _normalisation(device):
    """Mean/std tensors made once per device: building them every step would copy from the host and
    synchronise the GPU each time."""
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)
    return mean, std

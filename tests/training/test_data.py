"""fabric_memory_recipes.training.data: the CIFAR-10 reader against files in CIFAR-10's on-disk format, the digits splits, the
offline fallback, the synthetic stand-in, the device-side input transform and the loaders."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from fabric_memory_recipes.training import data
from fabric_memory_recipes.training.cli import UsageError
from fabric_memory_recipes.training.data import digits, network
from tests.tiny import N_TEST, N_TRAIN_FILES, PER_BATCH, write_cifar


def _image_id(images: np.ndarray) -> np.ndarray:
    """The id written into pixel (row 0, col 0) channels 0 and 1 (see write_cifar)."""
    return images[:, 0, 0, 0].astype(np.int64) + 256 * images[:, 0, 0, 1].astype(np.int64)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("FMR_OFFLINE", "1")
    network.reachable.cache_clear()
    yield
    network.reachable.cache_clear()


# ------------------------------------------------------------------------------------------ real reader
def test_read_batch_pixel_layout_round_trips(tmp_path):
    raw = write_cifar(tmp_path)
    rows, labels = raw["data_batch_1"]
    images, y = data.read_cifar10_batch(str(tmp_path / "cifar-10-batches-py" / "data_batch_1"))
    assert images.shape == (PER_BATCH, 32, 32, 3) and images.dtype == np.uint8
    assert y.dtype == np.int64 and y.tolist() == labels
    # Known pixels, by CIFAR-10's definition: byte c*1024 + r*32 + w of a row is channel c at (r, w).
    rng = np.random.default_rng(0)
    for _ in range(500):
        n, c, r, w = rng.integers(0, PER_BATCH), rng.integers(0, 3), rng.integers(0, 32), rng.integers(0, 32)
        assert images[n, r, w, c] == rows[n, c * 1024 + r * 32 + w], (n, c, r, w)
    # A hand-picked one that distinguishes row/column/channel orders.
    assert images[5, 3, 17, 2] == rows[5, 2 * 1024 + 3 * 32 + 17]
    assert images[5, 17, 3, 1] == rows[5, 1 * 1024 + 17 * 32 + 3]
    assert images.flags.c_contiguous


def test_read_cifar10_splits(tmp_path):
    raw = write_cifar(tmp_path)
    s = data.read_cifar10(str(tmp_path))
    assert s.source == "cifar10"
    n = N_TRAIN_FILES * PER_BATCH
    (xtr, ytr), (xva, yva), (xte, yte) = s.train, s.val, s.test
    assert len(xva) == n // 10 and len(xtr) == n - n // 10  # 90% / 10% for a partial set
    assert len(ytr) == len(xtr) and len(yva) == len(xva)
    ids_tr, ids_va = _image_id(xtr), _image_id(xva)
    assert not set(ids_tr) & set(ids_va), "train and val must be disjoint"
    assert sorted(set(ids_tr) | set(ids_va)) == list(range(n)), "together they are every training image"
    # labels travel with their images through the shuffle
    assert (ytr == (ids_tr * 7) % 10).all() and (yva == (ids_va * 7) % 10).all()
    # the test split is test_batch, unshuffled
    rows, labels = raw["test_batch"]
    assert xte.shape == (N_TEST, 32, 32, 3) and yte.tolist() == labels
    assert (xte.transpose(0, 3, 1, 2).reshape(N_TEST, 3072) == rows).all()
    # the split is fixed (every rung sees the same one)
    again = data.read_cifar10(str(tmp_path))
    assert (again.val[0] == xva).all() and (again.train[1] == ytr).all()


def test_full_size_split_is_45k_5k(tmp_path, monkeypatch):
    """With all 50,000 training images the split is the article's 45k/5k (files faked by the reader)."""
    write_cifar(tmp_path, n_train_files=1, per_batch=10)
    big = (np.zeros((10_000, 32, 32, 3), np.uint8), np.zeros(10_000, np.int64))
    real = data.read_cifar10_batch
    monkeypatch.setattr(data, "read_cifar10_batch", lambda p: real(p) if p.endswith("test_batch") else big)
    for i in range(2, 6):  # the reader reads the train files that exist
        (tmp_path / "cifar-10-batches-py" / f"data_batch_{i}").write_bytes(b"")
    s = data.read_cifar10(str(tmp_path))
    assert (len(s.train[0]), len(s.val[0])) == (45_000, 5_000)


def test_load_auto_uses_cifar_files_when_present(tmp_path, offline, capsys):
    write_cifar(tmp_path)
    for choice in ("auto", "cifar10"):
        s = data.load(choice, str(tmp_path))
        assert s.source == "cifar10"
        assert len(s.train[0]) + len(s.val[0]) == N_TRAIN_FILES * PER_BATCH
    assert "synthetic" not in capsys.readouterr().out


def test_load_auto_offline_falls_back_to_digits_with_one_line(tmp_path, offline, capsys):
    s = data.load("auto", str(tmp_path / "nothing-here"))
    assert s.source == "digits" and s.real
    assert len(s.train[0]) + len(s.val[0]) + len(s.test[0]) == 1797
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("[data]") and "digits" in lines[0], lines
    assert not (tmp_path / "nothing-here").exists(), "nothing downloaded or written"
    assert data.load("synthetic").source == "synthetic" and not data.load("synthetic").real


# ---------------------------------------------------------------------------------------------- digits
DIGITS_SPLIT = "c94204e8f281"  # fabric_memory_recipes.training.data.digits.split_fingerprint of the fixed split: a change shows here


def test_digits_splits_are_stratified_fixed_and_disjoint():
    x, y = digits.raw()
    assert x.shape == (1797, 8, 8, 1) and x.dtype == np.uint8 and x.max() == 255 and x.min() == 0
    idx = digits.split_indices(y)
    together = np.concatenate(idx)
    assert len(together) == len(set(together.tolist())) == len(y), "disjoint, and every image in one split"
    totals = np.bincount(y, minlength=10)
    for part, fraction in zip(idx, (0.7, 0.1, 0.2), strict=True):
        counts = np.bincount(y[part], minlength=10)
        assert np.all(np.abs(counts - fraction * totals) <= 1), (fraction, counts)  # stratified
    np.random.seed(7)  # the global NumPy state plays no part
    assert all(np.array_equal(a, b) for a, b in zip(idx, digits.split_indices(y), strict=True))
    assert digits.split_fingerprint(idx) == DIGITS_SPLIT
    # no test or validation image is also a training image (not even an identical copy)
    flat = x.reshape(len(x), -1)
    train = {row.tobytes() for row in flat[idx[0]]}
    assert not any(row.tobytes() in train for row in flat[np.concatenate(idx[1:])])
    s = data.load("digits")
    assert s.source == "digits"
    for (images, labels), part in zip((s.train, s.val, s.test), idx, strict=True):
        assert np.array_equal(images, x[part]) and np.array_equal(labels, y[part])
    assert f"split {DIGITS_SPLIT}" in digits.splits()[1]


def test_load_cifar10_offline_without_files_is_a_usage_error(tmp_path, offline):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="cifar10"):
        data.load("cifar10", str(tmp_path / "empty"))
    assert not (tmp_path / "empty" / "cifar-10-batches-py").exists()


def test_cifar10_present_needs_train_and_test(tmp_path):
    assert not data.cifar10_present(str(tmp_path))
    write_cifar(tmp_path, n_train_files=1)
    assert data.cifar10_present(str(tmp_path))
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    assert not data.cifar10_present(str(tmp_path))


# ------------------------------------------------------------------------------------------- synthetic
def test_synthetic_shapes_dtypes_classes():
    sizes = (300, 120, 150)
    s = data.synthetic(sizes=sizes, seed=3)
    assert s.source == "synthetic"
    for (x, y), n in zip((s.train, s.val, s.test), sizes, strict=True):
        assert x.shape == (n, 32, 32, 3) and x.dtype == np.uint8
        assert y.shape == (n,) and y.dtype == np.int64
        assert set(np.unique(y).tolist()) == set(range(data.NUM_CLASSES)), "every class appears"
    assert s.train[0].std() > 10, "images are not constant"


def test_the_synthetic_cache_is_readable_by_others_as_any_file(tmp_path, monkeypatch):
    """It was written with mkstemp's 0600: another user or job sharing --data-dir could not read it."""
    monkeypatch.setattr(
        data,
        "synthetic",
        lambda: data.Splits(*[(np.zeros((2, 3, 4, 4), np.float32), np.zeros(2, np.int64))] * 3, "synthetic"),
    )
    before = os.umask(0o022)
    try:
        data.synthetic_cached(str(tmp_path))
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / data.SYNTHETIC_CACHE).stat().st_mode) == 0o644


def test_synthetic_is_deterministic():
    a, b = data.synthetic(sizes=(64, 32, 32), seed=5), data.synthetic(sizes=(64, 32, 32), seed=5)
    for pa, pb in zip((a.train, a.val, a.test), (b.train, b.val, b.test), strict=True):
        assert np.array_equal(pa[0], pb[0]) and np.array_equal(pa[1], pb[1])
    c = data.synthetic(sizes=(64, 32, 32), seed=6)
    assert not np.array_equal(a.train[0], c.train[0])


def test_synthetic_classes_are_separable():
    """Same-class images are closer to their class mean than to other classes' (the data is learnable)."""
    s = data.synthetic(sizes=(2000, 500, 10), seed=0)
    x, y = s.train[0].reshape(2000, -1).astype(np.float32), s.train[1]
    means = np.stack([x[y == c].mean(0) for c in range(data.NUM_CLASSES)])
    xv, yv = s.val[0].reshape(500, -1).astype(np.float32), s.val[1]
    nearest = ((xv[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (nearest == yv).mean() > 0.9


# -------------------------------------------------------------------------------------- to_model_input
def test_to_model_input_normalises_channel_first():
    imgs = torch.zeros(2, 32, 32, 3, dtype=torch.uint8)
    imgs[0, 4, 9] = torch.tensor([255, 0, 51], dtype=torch.uint8)
    imgs[1] = 128
    out = data.to_model_input(imgs, 32)
    assert out.shape == (2, 3, 32, 32) and out.dtype == torch.float32
    mean, std = data.IMAGENET_MEAN, data.IMAGENET_STD
    for c, v in enumerate((255, 0, 51)):
        assert out[0, c, 4, 9].item() == pytest.approx((v / 255 - mean[c]) / std[c], abs=1e-6)
        assert out[0, c, 0, 0].item() == pytest.approx((0 - mean[c]) / std[c], abs=1e-6)
        assert out[1, c].flatten().tolist() == pytest.approx(
            [(128 / 255 - mean[c]) / std[c]] * 1024, abs=1e-6
        )
    assert imgs[0, 4, 9].tolist() == [255, 0, 51], "input untouched"


@pytest.mark.parametrize("size", [16, 48, 224])
def test_to_model_input_resizes(size):
    imgs = torch.zeros(3, 32, 32, 3, dtype=torch.uint8)
    imgs[:, :, :, 0] = 200  # constant red plane: any resize keeps it constant
    imgs[:, :, 16:, 1] = 255  # right half green
    out = data.to_model_input(imgs, size)
    assert out.shape == (3, 3, size, size) and out.dtype == torch.float32
    red = (200 / 255 - data.IMAGENET_MEAN[0]) / data.IMAGENET_STD[0]
    assert torch.allclose(out[:, 0], torch.full_like(out[:, 0], red), atol=1e-5)
    g_lo = (0 - data.IMAGENET_MEAN[1]) / data.IMAGENET_STD[1]
    g_hi = (1 - data.IMAGENET_MEAN[1]) / data.IMAGENET_STD[1]
    assert out[0, 1, 0, 0].item() == pytest.approx(g_lo, abs=1e-5)  # left edge: no green
    assert out[0, 1, 0, size - 1].item() == pytest.approx(g_hi, abs=1e-5)  # right edge: full green


def test_to_model_input_makes_three_channels_of_a_one_channel_batch():
    imgs = torch.zeros(2, 8, 8, 1, dtype=torch.uint8)
    imgs[0, :, 4:] = 255  # right half white
    out = data.to_model_input(imgs, 32)
    assert out.shape == (2, 3, 32, 32) and out.dtype == torch.float32
    mean = torch.tensor(data.IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(data.IMAGENET_STD).view(1, 3, 1, 1)
    grey = out * std + mean  # undo the per-channel normalisation: the three channels are one image
    assert torch.allclose(grey[:, 0], grey[:, 1], atol=1e-6)
    assert torch.allclose(grey[:, 0], grey[:, 2], atol=1e-6)
    assert grey[0, 0, 0, 0].item() == pytest.approx(0.0, abs=1e-6)
    assert grey[0, 0, 0, 31].item() == pytest.approx(1.0, abs=1e-6)
    assert grey[1].abs().max().item() < 1e-6


# --------------------------------------------------------------------------------------------- loaders
def test_loaders_drop_last_only_on_train():
    s = data.synthetic(sizes=(100, 50, 45), seed=0)
    train, val, test = data.build_loaders(s.datasets(), micro_batch_size=32, eval_batch_size=20)
    assert len(train) == 3 and train.drop_last
    sizes = [len(b[0]) for b in train]
    assert sizes == [32, 32, 32]
    assert [len(b[0]) for b in val] == [20, 20, 10]
    assert [len(b[0]) for b in test] == [20, 20, 5]
    x, y = next(iter(train))
    assert x.dtype == torch.uint8 and x.shape == (32, 32, 32, 3) and y.dtype == torch.int64
    # val/test are not shuffled: the first batch is the first 20 samples
    xv, yv = next(iter(val))
    assert torch.equal(xv, torch.from_numpy(s.val[0][:20])) and torch.equal(
        yv, torch.from_numpy(s.val[1][:20])
    )
    # train is shuffled: two epochs see different orders
    torch.manual_seed(0)
    e1 = torch.cat([b[1] for b in train])
    e2 = torch.cat([b[1] for b in train])
    assert not torch.equal(e1, e2)


def test_loaders_shard_across_ranks():
    """With several processes: train shards are disjoint whole micro-batches; val/test see every sample,
    and every rank runs the same number of batches (sharded models need all ranks in every forward)."""
    s = data.synthetic(sizes=(103, 41, 40), seed=0)
    s.train = (s.train[0], np.arange(103, dtype=np.int64))  # labels as sample ids, to follow each sample
    s.val = (s.val[0], np.arange(41, dtype=np.int64))
    per_rank = [data.build_loaders(s.datasets(), 8, 10, world_size=2, rank=r, seed=1) for r in (0, 1)]
    train_ids = [torch.cat([b[1] for b in loaders[0]]).tolist() for loaders in per_rank]
    assert all(len(b[1]) == 8 for loaders in per_rank for b in loaders[0]), "whole micro-batches only"
    assert len(per_rank[0][0]) == len(per_rank[1][0]) == 103 // 2 // 8
    assert not set(train_ids[0]) & set(train_ids[1]), "ranks train on disjoint samples"
    val_ids = [torch.cat([b[1] for b in loaders[1]]).tolist() for loaders in per_rank]
    assert set(val_ids[0]) | set(val_ids[1]) == set(range(41)), "every validation sample is evaluated"
    assert len(per_rank[0][1]) == len(per_rank[1][1]) and len(per_rank[0][2]) == len(per_rank[1][2])


def test_synthetic_is_made_once_per_data_dir(tmp_path, monkeypatch):
    """The default stand-in is kept in the data folder: the second load reads the same arrays back, a
    damaged file is made again, and a folder that cannot be written only costs the time."""
    made = []
    small = (64, 16, 16)
    real = data.synthetic
    monkeypatch.setattr(data, "SPLIT_SIZES", small)
    monkeypatch.setattr(data, "synthetic", lambda: made.append(1) or real(sizes=small))
    first = data.load("synthetic", str(tmp_path))
    second = data.load("synthetic", str(tmp_path))
    assert len(made) == 1 and second.source == "synthetic"
    for a, b in zip(
        (first.train, first.val, first.test), (second.train, second.val, second.test), strict=True
    ):
        assert (a[0] == b[0]).all() and (a[1] == b[1]).all() and a[0].dtype == b[0].dtype
    (tmp_path / data.SYNTHETIC_CACHE).write_bytes(b"not an npz")
    third = data.load("synthetic", str(tmp_path))
    assert len(made) == 2 and (third.train[0] == first.train[0]).all()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert data.load("synthetic", str(blocked / "data")).train[0].shape == (64, 32, 32, 3)

"""scikit-learn's bundled handwritten digits: the real data set that works offline.

``sklearn.datasets.load_digits`` ships 1,797 real 8x8 greyscale images of the digits 0-9 (about 180 per
class, written by 43 people; values 0-16) inside the scikit-learn package, so it needs no network. It is
what this project measures accuracy on when CIFAR-10 cannot be downloaded (``--data digits``, and
``--data auto`` offline).

The images stay uint8 on the host, one channel, 8x8 (64 bytes each): :func:`fabric_memory_recipes.training.data.to_model_input`
repeats the channel to three and resizes to the model's input on the device, as it does for CIFAR-10.

The split is fixed and stratified: per class, a permutation drawn from ``numpy.random.default_rng(0)``
(PCG64: the same stream on every machine and NumPy version) puts 20% of the class in test, 10% in
validation and the rest in train. It does not depend on ``--seed``, so every rung and every seed sees
the same three disjoint splits; :func:`split_fingerprint` identifies them in the results JSON.
"""

from __future__ import annotations

import hashlib

import numpy as np

SPLIT_SEED = 0
TEST_FRACTION = 0.2
VAL_FRACTION = 0.1
MAX_VALUE = 16  # load_digits' pixel values are 0..16


def raw() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 images as uint8 (N, 8, 8, 1), 0-255, and their int64 labels, in scikit-learn's order."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.rint(bunch.images * (255.0 / MAX_VALUE)).astype(np.uint8)[..., None]
    return np.ascontiguousarray(images), bunch.target.astype(np.int64)


def split_indices(labels: np.ndarray, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices of train / val / test: stratified (each class split 70/10/20), fixed by ``seed``, disjoint."""
    rng = np.random.default_rng(seed)
    parts: tuple[list, list, list] = ([], [], [])
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(TEST_FRACTION * len(members)))
        n_val = int(round(VAL_FRACTION * len(members)))
        parts[2].append(members[:n_test])
        parts[1].append(members[n_test : n_test + n_val])
        parts[0].append(members[n_test + n_val :])
    return tuple(np.sort(np.concatenate(p)) for p in parts)  # type: ignore[return-value]


def split_fingerprint(indices: tuple[np.ndarray, ...]) -> str:
    """A short hash of the three index lists: equal on two machines means the same split."""
    h = hashlib.sha256()
    for part in indices:
        h.update(np.asarray(part, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:12]


def splits() -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
    """[(images, labels) of train, val, test] and a one-line description of them for the results JSON
    (``fabric_memory_recipes.training.data.load`` wraps them in its ``Splits``; this module imports nothing of the project)."""
    x, y = raw()
    idx = split_indices(y)
    sizes = "/".join(str(len(i)) for i in idx)
    detail = (
        f"sklearn load_digits: {len(y)} real 8x8 images, train/val/test {sizes} stratified"
        f" (split {split_fingerprint(idx)})"
    )
    return [(x[i], y[i]) for i in idx], detail

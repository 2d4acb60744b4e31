"""What fabric_memory_recipes.tools.compare.runner swaps while one of the article's scripts runs: what needs the
network (CIFAR-10's files, pretrained weights) and modules that may be missing (``watermark``, ``pandas``);
for the multi-GPU scripts, when asked, the number of processes their ``Fabric(devices=4)`` expects (the
processes torchrun started) and ``FSDPStrategy``'s ``cpu_offload``. :func:`substitutions` installs them,
with the step recorder's hooks, and undoes them on exit."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any
from unittest import mock

import lightning.fabric
import numpy as np
import torchvision
import torchvision.datasets.cifar
import torchvision.models.vision_transformer as vision_transformer
from lightning.fabric.strategies import FSDPStrategy
from torch.optim.optimizer import register_optimizer_step_post_hook
from torchvision.models._utils import _ovewrite_named_param

from fabric_memory_recipes.tools.compare.recorder import StepRecorder

CIFAR10_SIZES = {True: 50_000, False: 10_000}  # train, test
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
DATA_NOTE = (
    "torchvision.datasets.CIFAR10 -> deterministic random 32x32 RGB images and random labels "
    "(50,000 train / 10,000 test) through CIFAR-10's own __getitem__ and the script's transforms"
)
STUB_MODULES = {
    "watermark": "watermark (not installed) -> a stand-in whose watermark() prints versions",
    "pandas": "pandas (not installed) -> a stand-in; local_utilities uses it only for IMDb",
}
# ViT architecture parameters that --vit-arch may override (a tiny ViT for CPU tests)
ARCH_KEYS = ("image_size", "patch_size", "num_layers", "num_heads", "hidden_dim", "mlp_dim")


# ------------------------------------------------------------------------------------------- the data
_ARRAYS: dict[bool, tuple[np.ndarray, list[int]]] = {}


def random_cifar10_arrays(train: bool) -> tuple[np.ndarray, list[int]]:
    """CIFAR-10's arrays with random values: uint8 (N, 32, 32, 3) as CIFAR10.data holds them (a
    transposed view of (N, 3, 32, 32)), and N labels in 0..9. Seeded by the split; shared by every
    dataset of that split in the process, like the files on disk are."""
    if train not in _ARRAYS:
        n = CIFAR10_SIZES[train]
        rng = np.random.default_rng(0 if train else 1)
        data = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8).transpose((0, 2, 3, 1))
        _ARRAYS[train] = (data, rng.integers(0, 10, size=n).tolist())
    return _ARRAYS[train]


class RandomCIFAR10(torchvision.datasets.cifar.CIFAR10):
    """torchvision's CIFAR10 without its files: random contents, the class's own ``__getitem__``/``__len__``."""

    def __init__(self, root, train=True, transform=None, target_transform=None, download=False) -> None:
        torchvision.datasets.VisionDataset.__init__(
            self, root, transform=transform, target_transform=target_transform
        )
        self.train = train
        self.data, self.targets = random_cifar10_arrays(bool(train))
        self.classes = list(CIFAR10_CLASSES)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}


# ------------------------------------------------------------------------------------ substitutions
def _stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__doc__ = (
        f"Stand-in for {name}, installed by fabric_memory_recipes.tools.compare.runner because it is missing."
    )
    if name == "watermark":

        def watermark(packages: str = "", python: bool = False, **_: Any) -> str:
            lines = [f"Python implementation: {sys.implementation.name}"] if python else []
            for pkg in filter(None, (p.strip() for p in packages.split(","))):
                with contextlib.suppress(Exception):
                    lines.append(f"{pkg:9s}: {__import__(pkg).__version__}")
            return "\n".join(lines + ["(watermark stand-in: the package is not installed)"])

        module.watermark = watermark
    return module


def parse_arch(text: str | None) -> dict[str, int]:
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in ARCH_KEYS or not value.strip().isdigit():
            raise ValueError(
                f"--vit-arch takes KEY=INT pairs with KEY in {', '.join(ARCH_KEYS)}, got {item!r}"
            )
        out[key] = int(value)
    return out


def _keyword(cls: type, name: str, value: Any, notes: list[str], note: str) -> Any:
    """A patch of ``cls.__init__`` that calls it with ``name=value`` whatever the script passed (noted once)."""
    original = cls.__init__

    def init(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get(name, value) != value and note not in notes:
            notes.append(note + f" (the script asked for {kwargs[name]!r})")
        kwargs[name] = value
        original(self, *args, **kwargs)

    return mock.patch.object(cls, "__init__", init)


@contextlib.contextmanager
def substitutions(
    recorder: StepRecorder,
    arch: dict[str, int] | None = None,
    devices: int | None = None,
    cpu_offload: bool | None = None,
) -> Iterator[list[str]]:
    """Install the offline substitutions and the step hook; undo them on exit. Yields the list of notes
    (what was substituted), which grows while the script runs (a weights note once weights are asked for).
    ``devices``: every ``Fabric(...)`` gets ``devices=N``; ``cpu_offload``: every ``FSDPStrategy(...)``
    gets ``cpu_offload=...`` (None: as the script says)."""
    notes: list[str] = [DATA_NOTE]
    arch = dict(arch or {})
    original_builder = vision_transformer._vision_transformer

    def build(patch_size, num_layers, num_heads, hidden_dim, mlp_dim, weights, progress, **kwargs):
        if weights is not None:  # what torchvision does with weights, minus loading them
            _ovewrite_named_param(kwargs, "num_classes", len(weights.meta["categories"]))
            _ovewrite_named_param(kwargs, "image_size", weights.meta["min_size"][0])
            note = (
                f"pretrained weights {type(weights).__name__}.{weights.name} -> random init of the same "
                f"architecture (image_size {kwargs['image_size']}, {kwargs['num_classes']} classes, not loaded)"
            )
            if note not in notes:
                notes.append(note)
        shape = dict(patch_size=patch_size, num_layers=num_layers, num_heads=num_heads)
        shape.update(hidden_dim=hidden_dim, mlp_dim=mlp_dim)
        for key, value in arch.items():  # tests only: a tiny ViT instead of the real one
            (kwargs if key == "image_size" else shape)[key] = value
        model = original_builder(**shape, weights=None, progress=progress, **kwargs)
        model.register_forward_pre_hook(recorder.count_forward)
        recorder.counting = True
        return model

    if arch:
        notes.append(f"ViT architecture overridden (tests): {arch}")
    with contextlib.ExitStack() as stack:
        for owner in (torchvision.datasets, torchvision.datasets.cifar):
            stack.enter_context(mock.patch.object(owner, "CIFAR10", RandomCIFAR10))
        stack.enter_context(mock.patch.object(vision_transformer, "_vision_transformer", build))
        if devices is not None:
            note = f"Fabric(devices=...) -> devices={devices}, the processes torchrun started"
            stack.enter_context(_keyword(lightning.fabric.Fabric, "devices", devices, notes, note))
        if cpu_offload is not None:
            note = f"FSDPStrategy(cpu_offload=...) -> cpu_offload={cpu_offload}"
            stack.enter_context(_keyword(FSDPStrategy, "cpu_offload", cpu_offload, notes, note))
        for name, note in STUB_MODULES.items():
            if name not in sys.modules and importlib.util.find_spec(name) is None:
                stack.enter_context(_patched_module(name, _stub_module(name)))
                notes.append(note)
        handle = register_optimizer_step_post_hook(recorder.after_step)
        stack.callback(handle.remove)
        yield notes


@contextlib.contextmanager
def _patched_module(name: str, module: types.ModuleType) -> Iterator[None]:
    sys.modules[name] = module
    try:
        yield
    finally:
        if sys.modules.get(name) is module:
            del sys.modules[name]

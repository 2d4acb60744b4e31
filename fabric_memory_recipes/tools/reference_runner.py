"""Run one of the article's scripts offline and time its optimizer steps, without editing the script.

    python -m fabric_memory_recipes.tools.reference_runner SCRIPT --steps 25 --out run.json

SCRIPT is a training script from a checkout of the article's repository (rasbt/pytorch-memory-optim,
Apache-2.0), e.g. ``05_gradient-accum.py``. The script runs as ``__main__`` (runpy) in a temporary
working directory with its own folder first on ``sys.path`` (so ``from local_utilities import ...``
works), unchanged: its Fabric, precision, model, optimizer, loop, batch size, CPU transforms and
DataLoader (with its ``num_workers``) are its own. Only what needs the network is swapped:

* ``torchvision.datasets.CIFAR10`` -> the same class with random contents: deterministic random 32x32
  RGB uint8 images and random labels, 50,000 train / 10,000 test (CIFAR-10's sizes and layout), read
  through CIFAR-10's own ``__getitem__`` (PIL image -> the script's transforms).
* Pretrained weights -> random init of the same architecture: torchvision's ViT builders called with
  ``weights=...`` build the model those weights describe (image size, 1000 classes) without loading them.
  Memory and speed depend on shapes, not on values.
* ``watermark`` (and ``pandas``, which ``local_utilities`` imports only for its IMDb helpers) -> small
  stand-in modules, only when they are not installed.

Timing. A global optimizer step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``)
records a CUDA event after every optimizer step (``time.perf_counter`` when CUDA is not in use): no
synchronisation, no change to the work. After ``--steps`` steps it reads the peak memory and stops the
script by raising a private exception that this runner catches. Like the project's metrics logger
(``fabric_memory_recipes.measurement.results``), the first ``WARMUP_STEPS`` intervals between steps are left out and
``images_per_s = effective batch x world size / median interval``.

Batch size. A forward pre-hook on the model counts the images that go through it in training mode
between two optimizer steps, so the effective batch is what the script really feeds per step (micro-batch
x accumulation), whatever constants it uses; the most common count over the timed intervals is taken.
The script's upper-case integer constants (``BATCHSIZE``, ``ACCUMULATION_STEPS``, ...) are recorded next
to it as a cross-check; they are the fallback when nothing was counted (a model that torchvision's ViT
builders did not make): ``batch_source`` says which. A step that the fp16 GradScaler skips (non-finite gradients, usually while its
scale calibrates in the first steps) calls no ``optimizer.step``: its images and time fall into the next
interval (``images_per_interval`` in the JSON shows it).

Memory. ``torch.cuda.max_memory_reserved/allocated`` (GB = 1e9 bytes) from the start of the process to
the last timed step: model load included, like the project's whole-run peak. ``memory.warmup`` is the
peak up to the end of the warm-up steps, ``memory.steady`` the peak after it (the stats are reset in
between, which changes no allocation).

Several processes (the FSDP scripts): launch the runner with ``torchrun --nproc-per-node N -m
fabric_memory_recipes.tools.reference_runner ...``; rank 0 writes ``--out``, rank r > 0 writes ``<out>.rank<r>.json``.

Exit code: 0 ok, 1 the script failed or ended before ``--steps`` steps, 2 bad arguments, 3 CUDA out of
memory. The JSON is written in every case but 2.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import resource
import runpy
import statistics
import sys
import tempfile
import time
import traceback
import types
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
import torchvision.datasets.cifar
import torchvision.models.vision_transformer as vision_transformer
from torch.optim.optimizer import register_optimizer_step_post_hook
from torchvision.models._utils import _ovewrite_named_param

from fabric_memory_recipes.config import at_least
from fabric_memory_recipes.console import Parser, fail
from fabric_memory_recipes.measurement.results import environment
from fabric_memory_recipes.measurement.results_file import GB, WARMUP_STEPS, write_json_atomic

SCHEMA = "reference_run/1"
CIFAR10_SIZES = {True: 50_000, False: 10_000}  # train, test
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
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


class _StopRun(Exception):
    """Raised from the step hook once the requested steps are done: ends the script early."""


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


# -------------------------------------------------------------------------------------- the recorder
def _memory_now() -> dict[str, float]:
    if torch.cuda.is_initialized():
        return {
            "peak_reserved_gb": torch.cuda.max_memory_reserved() / GB,
            "peak_allocated_gb": torch.cuda.max_memory_allocated() / GB,
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_reserved_gb": rss / GB, "peak_allocated_gb": rss / GB}


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def script_constants(script: Path) -> dict[str, int]:
    """Upper-case integer globals of the running script (BATCHSIZE, ACCUMULATION_STEPS, ...), read from
    the frames on the stack; {} when the script defines none."""
    frame = sys._getframe()
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename) == str(script):
            return {
                k: v
                for k, v in frame.f_globals.items()
                if k.isupper() and isinstance(v, int) and not isinstance(v, bool)
            }
        frame = frame.f_back
    return {}


class StepRecorder:
    """Marks every optimizer step and counts the images between steps; stops the script after ``steps``."""

    def __init__(self, script: Path, steps: int, warmup: int = WARMUP_STEPS) -> None:
        self.script, self.steps, self.warmup = script, steps, warmup
        self.marks: list[Any] = []  # CUDA events or perf_counter values, one per optimizer step
        self.images: list[int] = []  # images through the model since the previous step, per step
        self.images_since = 0
        self.counting = False  # a model built by a patched builder counts its training-mode forwards
        self.cuda = False
        self.constants: dict[str, int] = {}
        self.memory_warmup: dict[str, float] | None = None
        self.memory_end: dict[str, float] | None = None
        self.memory_kind = "cpu_rss"

    def count_forward(self, module: torch.nn.Module, args: tuple) -> None:
        if module.training and args and hasattr(args[0], "shape") and len(args[0].shape) > 0:
            self.images_since += int(args[0].shape[0])

    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.counting and self.marks and self.images_since == 0:
            return  # another optimizer stepping in the same iteration (one optimizer per parameter)
        if not self.marks:
            self.cuda = torch.cuda.is_initialized()
            self.memory_kind = "cuda" if self.cuda else "cpu_rss"
            self.constants = script_constants(self.script)
        self.images.append(self.images_since)
        self.images_since = 0
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        done = len(self.marks)
        if done == self.warmup + 1 and done < self.steps:  # this mark starts the first timed interval
            self.memory_warmup = _memory_now()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()  # host-side counters only: no allocation changes
        if done >= self.steps:
            self.memory_end = _memory_now()
            raise _StopRun

    def intervals(self) -> list[float]:
        if len(self.marks) < 2:
            return []
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]

    def summary(self) -> dict[str, Any]:
        """Timing and memory as the results JSON records them."""
        rank, world = _world()
        intervals = self.intervals()
        skip = min(
            self.warmup, max(0, len(intervals) - 1)
        )  # as fabric_memory_recipes.measurement.results.RunResults.steady_intervals
        steady = intervals[skip:]
        per_interval = self.images[1:]  # images[k + 1] went through the model during interval k
        timed_images = per_interval[skip:]
        batch = Counter(timed_images).most_common(1)[0][0] if timed_images else None
        source = "counted" if self.counting else None
        if not self.counting and self.constants.get("BATCHSIZE"):  # a model the builders did not make
            batch, source = self.constants["BATCHSIZE"], "script constant BATCHSIZE"
        median = statistics.median(steady) if steady else None
        end = self.memory_end or _memory_now()
        warm = self.memory_warmup
        peak = {k: max(m[k] for m in (warm, end) if m) for k in ("peak_reserved_gb", "peak_allocated_gb")}
        return {
            "rank": rank,
            "world_size": world,
            "steps": len(self.marks),
            "warmup_steps": skip,
            "timed_intervals": len(steady),
            "median_step_s": median,
            "effective_batch": batch,
            "images_per_s": batch * world / median if batch and median else None,
            "batch_source": source,
            "script_constants": self.constants,
            "step_intervals_s": intervals,
            "images_per_interval": per_interval,
            **peak,
            "memory": {
                "kind": self.memory_kind,
                "unit": "GB",
                "warmup": warm,
                "steady": end if warm is not None else None,
            },
        }


# ------------------------------------------------------------------------------------ substitutions
def _stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__doc__ = f"Stand-in for {name}, installed by fabric_memory_recipes.tools.reference_runner because it is missing."
    if name == "watermark":

        def watermark(packages: str = "", python: bool = False, **_: Any) -> str:
            lines = [f"Python implementation: {sys.implementation.name}"] if python else []
            for pkg in filter(None, (p.strip() for p in packages.split(","))):
                with contextlib.suppress(Exception):
                    lines.append(f"{pkg:9s}: {__import__(pkg).__version__}")
            return "\n".join(lines + ["(watermark stand-in: the package is not installed)"])

        module.watermark = watermark
    return module


def _parse_arch(text: str | None) -> dict[str, int]:
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


@contextlib.contextmanager
def substitutions(recorder: StepRecorder, arch: dict[str, int] | None = None) -> Iterator[list[str]]:
    """Install the offline substitutions and the step hook; undo them on exit. Yields the list of notes
    (what was substituted), which grows while the script runs (a weights note once weights are asked for)."""
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
            stack.enter_context(_patched(owner, "CIFAR10", RandomCIFAR10))
        stack.enter_context(_patched(vision_transformer, "_vision_transformer", build))
        for name, note in STUB_MODULES.items():
            if name not in sys.modules and importlib.util.find_spec(name) is None:
                stack.enter_context(_patched_module(name, _stub_module(name)))
                notes.append(note)
        handle = register_optimizer_step_post_hook(recorder.after_step)
        stack.callback(handle.remove)
        yield notes


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


@contextlib.contextmanager
def _patched_module(name: str, module: types.ModuleType) -> Iterator[None]:
    sys.modules[name] = module
    try:
        yield
    finally:
        if sys.modules.get(name) is module:
            del sys.modules[name]


def run_script(script: Path, cwd: str) -> None:
    """``python SCRIPT`` in-process: __main__, argv [SCRIPT], its folder first on sys.path, in ``cwd``."""
    saved = os.getcwd(), sys.argv[:], sys.path[:]
    before = set(sys.modules)
    os.chdir(cwd)
    sys.argv = [str(script)]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        os.chdir(saved[0])
        sys.argv[:], sys.path[:] = saved[1], saved[2]
        for name in set(sys.modules) - before:  # the script's own helpers (local_utilities)
            path = getattr(sys.modules[name], "__file__", None) or ""
            if os.path.dirname(os.path.abspath(path)) == str(script.parent):
                del sys.modules[name]


# -------------------------------------------------------------------------------------------- main
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def rank_path(out: str, rank: int) -> str:
    return out if rank == 0 else f"{out[: -len('.json')] if out.endswith('.json') else out}.rank{rank}.json"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m fabric_memory_recipes.tools.reference_runner",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("script", help="one of the article's training scripts (e.g. 05_gradient-accum.py)")
    parser.add_argument("--steps", type=at_least(2), default=25, help="optimizer steps before stopping")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    parser.add_argument(
        "--vit-arch",
        default=os.environ.get("REFERENCE_RUNNER_VIT_ARCH"),
        help="tests: a tiny ViT instead, e.g. image_size=32,patch_size=8,num_layers=1 (env REFERENCE_RUNNER_VIT_ARCH)",
    )
    args = parser.parse_args(argv)
    script = Path(args.script).resolve()
    if not script.is_file():
        fail(f"no such script: {args.script}")
    try:
        arch = _parse_arch(args.vit_arch)
    except ValueError as e:
        fail(str(e))

    recorder = StepRecorder(script, args.steps)
    status, error = "ok", None
    start = time.perf_counter()
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="reference-run-") as cwd:
        with substitutions(recorder, arch) as notes:
            try:
                run_script(script, cwd)
                status = "error"
                error = f"the script ended after {len(recorder.marks)} of {args.steps} optimizer steps"
            except _StopRun:
                pass
            except torch.cuda.OutOfMemoryError as e:
                status, error = "oom", _first_line(e)
            except SystemExit as e:  # the script called sys.exit() before the last step
                status = "error"
                error = f"the script exited ({e.code}) after {len(recorder.marks)} of {args.steps} optimizer steps"
            except Exception as e:  # noqa: BLE001 - recorded, with the traceback on stderr
                traceback.print_exc()
                status, error = "error", _first_line(e)
    wall = time.perf_counter() - start
    payload = {
        "schema": SCHEMA,
        "script": script.name,
        "script_sha256": hashlib.sha256(script.read_bytes()).hexdigest(),
        "status": status,
        "error": error,
        "requested_steps": args.steps,
        **recorder.summary(),
        "substitutions": list(notes),
        "wall_s": wall,
        "provenance": {
            "gpu_name": torch.cuda.get_device_name() if recorder.cuda else None,
            **environment(),
        },
    }
    write_json_atomic(rank_path(args.out, payload["rank"]), payload)
    speed = payload["images_per_s"]
    print(
        f"reference_runner: {script.name}: {status}"
        + (f" ({error})" if error else "")
        + f", {payload['steps']} steps, peak reserved {payload['peak_reserved_gb'] or 0:.2f} GB, "
        + (f"{speed:.1f} img/s" if speed else "img/s n/a"),
        flush=True,
    )
    return {"ok": 0, "oom": 3}.get(status, 1)


if __name__ == "__main__":
    # Run as `fabric_memory_recipes.tools.reference_runner`, not `__main__`: the dataset class must be importable by that name
    # in DataLoader workers that are not forked (spawn/forkserver start methods).
    from fabric_memory_recipes.tools import reference_runner

    raise SystemExit(reference_runner.main())

"""The checkpoint file a run of your model writes (``--checkpoint-every N``: training/checkpoints.py), its
size on disk predicted from the model on the meta device: :func:`predict`.

What the file holds is what ``training/loop_plumbing.py`` hands to ``fabric.save``: the model's
``state_dict()`` (every weight, frozen or not, and the persistent buffers, in the precision's dtype: fp32
for the mixed precisions, bf16/fp16 for the true ones; with LoRA the frozen weights and the adapters), the
optimizer's ``state_dict()`` when the run has one optimizer (Adam/AdamW: two moments like each trainable
parameter and a step counter; SGD: nothing; the step in backward's per-parameter optimizers are not
saved), and the loop's counters and random states. The state is built here with meta tensors in that
layout, and its size is what ``torch.save`` writes for it: the pickle (measured by saving the meta state:
no data) plus, per storage, its zip record (a 30-byte local header, the name, padding that aligns the
data to 64 bytes, the data, a 16-byte data descriptor, a 46-byte central-directory entry with the name
again; zip64 fields past 4 GiB). Fabric saves through an in-memory buffer, so the records are named
``archive/...``.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import zipfile
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from fabric_memory_recipes.planning.plan import LOWBIT_BLOCK, LOWBIT_MIN_NUMEL, OPTIMIZER_STATE_FACTOR
from fabric_memory_recipes.planning.simulation.modelled import Precision
from fabric_memory_recipes.training.your_model import runner
from fabric_memory_recipes.training.your_model.runner import YourModelConfig

GB = 1e9
ALIGNMENT = 64  # torch.save aligns each storage's data in the archive
LOCAL_HEADER, CENTRAL_HEADER, DESCRIPTOR, ZIP64_LIMIT = 30, 46, 16, 0xFFFFFFFF
RNG_BYTES = torch.get_rng_state().numel()  # the CPU generator's state, saved twice (epoch and now)
CUDA_RNG_BYTES = 16  # one CUDA generator's state (seed and offset), one per visible GPU


@dataclasses.dataclass(frozen=True)
class SavedFile:
    """The predicted checkpoint file: its size in bytes and what it is made of."""

    total_bytes: int
    weights_bytes: int  # the model's state_dict: weights and persistent buffers
    optimizer_state_bytes: int  # the optimizer's tensors (none when it is not saved)
    format_bytes: int  # the pickle, the zip records, the random states and counters
    storages: int
    weights_dtype: str
    optimizer_saved: bool

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total_gb": round(self.total_bytes / GB, 6)}

    def line(self) -> str:
        """One line for the estimate's output."""
        state = (
            f" + optimizer state {self.optimizer_state_bytes / GB:.3f}"
            if self.optimizer_saved
            else " (no optimizer state: the step in backward's optimizers are not saved)"
        )
        return (
            f"{self.total_bytes / GB:.3f} GB: weights {self.weights_bytes / GB:.3f} ({self.weights_dtype}){state}"
            f" + {self.format_bytes / 1e6:.2f} MB of format, counters and random states"
        )


def _state_of(p: torch.Tensor, optimizer: str) -> dict[str, torch.Tensor]:
    """One trainable parameter's optimizer state after a step, as meta tensors."""
    if optimizer == "adamw8bit" and p.numel() >= LOWBIT_MIN_NUMEL and p.numel() % LOWBIT_BLOCK == 0:
        # torchao's 8-bit state per moment: uint8 codes, one fp32 scale per block, a 256-entry code map
        codes, scales = (p.shape, torch.uint8), ((p.numel() // LOWBIT_BLOCK,), torch.float32)
        return {"step": torch.empty((), device="meta")} | {
            name: [
                torch.empty(shape, dtype=dtype, device="meta")
                for shape, dtype in (codes, scales, ((256,), torch.float32))
            ]
            for name in ("exp_avg", "exp_avg_sq")
        }
    if not OPTIMIZER_STATE_FACTOR[optimizer]:
        return {}
    state = {"step": torch.empty((), device="meta")} if optimizer in ("adam", "adamw", "adamw8bit") else {}
    names = ("exp_avg", "exp_avg_sq") if state else ("momentum_buffer",)
    return state | {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n in names}


def _param_groups(cfg: YourModelConfig, n: int) -> list[dict]:
    """The optimizer's ``param_groups`` as its ``state_dict()`` has them: the run's optimizer, made over
    ``n`` one-element stand-ins (its hyperparameters are what the pickle holds)."""
    try:
        return runner.make_optimizer(
            cfg, [torch.zeros(1, requires_grad=True) for _ in range(n)]
        ).state_dict()["param_groups"]
    except Exception:  # an optimizer that cannot be made here (torchao missing): its parameter indices only
        return [{"params": list(range(n))}]


def checkpoint_state(model: torch.nn.Module, cfg: YourModelConfig, devices: int = 1) -> dict[str, Any]:
    """The object ``fabric.save`` writes for ``model`` under ``cfg``, with meta tensors (loop_plumbing.py)."""
    dtype = Precision(cfg.precision, cuda_policy=False).param_dtype
    saved = model.state_dict(keep_vars=True)
    # an OrderedDict with the state_dict's _metadata (each module's version), which is pickled too
    weights: collections.OrderedDict = collections.OrderedDict()
    tied: dict[int, torch.Tensor] = {}  # tied weights (one Parameter under two names) are one storage
    for k, t in saved.items():
        like = dtype if t.is_floating_point() else t.dtype
        weights[k] = tied.setdefault(id(t), torch.empty(t.shape, dtype=like, device="meta"))
    weights._metadata = saved._metadata
    state: dict[str, Any] = {"model": weights}
    if not cfg.optimizer_in_backward:
        trainable = [p for p in model.parameters() if p.requires_grad]
        like = [torch.empty(p.shape, dtype=dtype, device="meta") for p in trainable]
        state["optimizer"] = {
            "state": {i: _state_of(p, cfg.optimizer) for i, p in enumerate(like)},
            "param_groups": _param_groups(cfg, len(trainable)),
        }
    cuda = cfg.accelerator != "cpu"
    rng = lambda: torch.empty(RNG_BYTES, dtype=torch.uint8, device="meta")  # noqa: E731
    cuda_rng = [torch.empty(CUDA_RNG_BYTES, dtype=torch.uint8, device="meta") for _ in range(devices)]
    return state | {
        "step": 1,
        "epoch": 0,
        "batch_in_epoch": 1,
        "epoch_rng": rng(),
        "rng": rng(),
        "cuda_rng": cuda_rng if cuda else None,
        "optimizer_steps": 1,
        "micro_batches": 1,
    }


def _local_records(cursor: int, records: list[tuple[int, int]]) -> tuple[int, int]:
    """Where the storages' local records written from ``cursor`` end, and the zip64 fields their central
    directory entries add (torch's writer: each record's data aligned to :data:`ALIGNMENT`)."""
    central = 0
    for name, nbytes in records:  # (the name's length, the data's)
        big = nbytes >= ZIP64_LIMIT or cursor >= ZIP64_LIMIT
        start = (
            cursor
            + LOCAL_HEADER
            + name
            + 4
            + (4 + 8 * (2 * (nbytes >= ZIP64_LIMIT) + (cursor >= ZIP64_LIMIT)) if big else 0)
        )
        start += -start % ALIGNMENT
        cursor = start + nbytes + DESCRIPTOR + (8 if big else 0)
        central += 4 + 24 if big else 0
    return cursor, central


def archive_bytes(state: dict[str, Any]) -> tuple[int, list[torch.Tensor]]:
    """The size of ``torch.save(state)`` into a buffer, and its distinct storages (as tensors, in order).

    ``state`` is saved once with each tensor replaced by a one-element stand-in of its dtype and shape
    (``expand``): the pickle, every record's name and header, the central directory are the real file's;
    then each stand-in's record is replaced by the real size's, aligned as torch aligns it."""
    seen: dict[int, torch.Tensor] = {}
    stand_in: dict[int, torch.Tensor] = {}

    def swap(t: Any) -> Any:
        if isinstance(t, dict):  # a state_dict's OrderedDict keeps its _metadata
            out = type(t)((k, swap(v)) for k, v in t.items())
            if hasattr(t, "_metadata"):
                out._metadata = t._metadata
            return out
        if isinstance(t, list | tuple):
            return type(t)(swap(v) for v in t)
        if not isinstance(t, torch.Tensor):
            return t
        key = t.untyped_storage()._cdata  # tied weights: one storage, saved once
        seen.setdefault(key, t)
        return stand_in.setdefault(key, torch.zeros((), dtype=t.dtype).expand(t.shape))

    buffer = io.BytesIO()
    torch.save(swap(state), buffer)
    with zipfile.ZipFile(buffer) as archive:
        first = min((i.header_offset for i in archive.infolist() if "/data/" in i.filename), default=0)
    names = [len(f"archive/data/{i}") for i in range(len(seen))]
    real = [t.untyped_storage().nbytes() for t in seen.values()]
    small = [t.element_size() for t in seen.values()]
    end_real, zip64 = _local_records(first, list(zip(names, real, strict=True)))
    end_small, _ = _local_records(first, list(zip(names, small, strict=True)))
    return len(buffer.getvalue()) + end_real - end_small + zip64, list(seen.values())


def predict(model: torch.nn.Module, cfg: YourModelConfig, devices: int = 1) -> SavedFile:
    """The checkpoint file of a run of ``model`` (any device: only shapes are read) under ``cfg``."""
    state = checkpoint_state(model, cfg, devices)
    total, storages = archive_bytes(state)

    def nbytes(part) -> int:  # each storage once
        tensors = {t.untyped_storage()._cdata: t for t in tree_leaves(part) if isinstance(t, torch.Tensor)}
        return sum(t.untyped_storage().nbytes() for t in tensors.values())

    weights, optimizer = nbytes(state["model"]), nbytes(state.get("optimizer", {}))
    dtype = Precision(cfg.precision, cuda_policy=False).param_dtype
    return SavedFile(
        total,
        weights,
        optimizer,
        total - weights - optimizer,
        len(storages),
        str(dtype).removeprefix("torch."),
        "optimizer" in state,
    )

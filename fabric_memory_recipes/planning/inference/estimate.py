"""The inference estimate (``fmr-estimate --model ... --infer``): the simulated inference call
(planning/inference/simulate.py) replayed through the model of the caching allocator, every decode step of
``generate()`` in order, and the card: peak reserved = the replay's, whole device = that + the card overhead
measured on the GPU kind for inference (measurement/card_overhead.py: eager, no backward or optimizer kernels).

Its components: the weights (in the precision's dtype; with ``--weights-quant int8`` each quantized Linear's
int8 values, scales and zero points), cuBLAS's workspace, the KV cache after the last
token, the prefill's working memory over the weights and its cache (activations of one layer at a time, the
attention's output and the logits of the last position, which ``generate()`` alone computes; an
encoder-decoder's prefill is its encoder and its first decoder step), the largest decode step's over the
weights and the cache, and the peaks allocated and reserved.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Any

from fabric_memory_recipes.measurement.card_overhead import overhead_per_gpu
from fabric_memory_recipes.planning.inference import simulate
from fabric_memory_recipes.planning.plan import GB
from fabric_memory_recipes.planning.simulation.allocator import (
    ROUND_LARGE,
    SMALL_REQUEST,
    CachingAllocator,
    round_size,
    segment_size,
)
from fabric_memory_recipes.training.your_model.inference import generates
from fabric_memory_recipes.training.your_model.models import UserModel

COMPONENTS = ("weights", "workspace", "kv_cache", "prefill_working", "logits", "decode_working")
LABELS = {"weights": "weights", "workspace": "cuBLAS workspace", "kv_cache": "KV cache (last token)",
          "prefill_working": "prefill working memory", "logits": "  of which logits",
          "decode_working": "decode step working memory"}  # fmt: skip


@dataclasses.dataclass
class InferenceEstimate:
    model: str
    task: str
    batch_size: int
    seq_len: int
    new_tokens: int | None
    precision: str
    kv_cache_dtype: str | None
    parameters: int
    components_gb: dict[str, float]
    peak_allocated_gb: float
    peak_phase: str
    peak_reserved_gb: float
    overhead_gb: float | None
    overhead_source: str
    device_peak_gb: float | None
    gpu: str
    kernels: list[str]
    seconds: float
    capacity_gb: float | None = None  # what the allocator could reserve (--fit: the card less its overhead)
    released_gb: float = 0.0  # cached segments given back on the way, to stay within it
    out_of_memory: str | None = None  # where the replay ran out of it
    weights_quant: str = "none"  # the weights' storage: int8 (training/techniques/inference/weights_quant.py)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "reserved_rule": "the replay of every simulated allocation"
                " (planning/inference/estimate.py), no margin"}  # fmt: skip

    def shape(self) -> str:
        if self.new_tokens is None:
            return f"batch {self.batch_size}" + (
                f" x {self.seq_len} tokens" if self.task != "image_classification" else ""
            )
        if self.task == "seq2seq_lm":
            return f"batch {self.batch_size} x ({self.seq_len} source tokens -> {self.new_tokens} new tokens)"
        return f"batch {self.batch_size} x ({self.seq_len} prompt + {self.new_tokens} new tokens)"

    def table(self) -> str:
        rows = [
            f"  {LABELS[c]:<28}{self.components_gb[c]:>9.3f} GB"
            for c in COMPONENTS
            if c in self.components_gb
        ]
        rows += [f"  {'peak allocated':<28}{self.peak_allocated_gb:>9.3f} GB   ({self.peak_phase})",
                 f"  {'peak reserved':<28}{self.peak_reserved_gb:>9.3f} GB   the allocator replay, every step in order"]  # fmt: skip
        device = "unknown" if self.device_peak_gb is None else f"{self.device_peak_gb:>9.3f} GB"
        rows.append(f"  {'whole-device peak':<28}{device}   + {self.overhead_gb or 0:.3f} GB outside the allocator"
                    f" ({self.overhead_source})")  # fmt: skip
        return "\n".join(rows)


class CappedAllocator(CachingAllocator):
    """The caching allocator on a card of ``capacity`` bytes: where a new segment would pass it, the allocator
    first gives back every cached segment that is wholly free (``release_cached_blocks``, what a failed
    ``cudaMalloc`` triggers), and only then runs out of memory (:class:`OutOfMemory`). ``capacity`` None: an
    uncapped card, the training estimate's replay."""

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        self.released = 0  # bytes given back
        self._next_address = 1 << 62  # segments go downwards from here (addresses stay positive)

    def _segment_address(self, size: int) -> int:
        """Each new segment below the earlier ones: the order in which the driver mapped them in the committed
        H100 allocator trace (results/published/h100/snapshot/: after its first few, every segment came at a
        lower address). Free blocks of one size are taken lowest address first, so the newest segment's go
        first; this decides where the KV cache's long-lived tensors land among the freed activations."""
        self._next_address -= size + ROUND_LARGE
        return self._next_address

    def malloc(self, handle: object, nbytes: int) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_REQUEST
        pool = self._pools[small]
        fits = bisect.bisect_left(pool, (size, -1)) < len(pool)
        if self.capacity is not None and not fits and self.reserved + segment_size(size) > self.capacity:
            for block in list(self._free.values()):
                if block.prev is None and block.next is None:  # a whole segment, free
                    self._remove(block)
                    self.reserved -= block.size
                    self.released += block.size
            if self.reserved + segment_size(size) > self.capacity:
                raise OutOfMemory(f"{size} bytes requested with {self.reserved} reserved of {self.capacity}")
        super().malloc(handle, nbytes)


class OutOfMemory(Exception):
    """The replay needed more than the card holds."""


_RECORDINGS: dict[
    tuple, simulate.Recording
] = {}  # one model's recordings: the fit asks for many token counts


def _recording(model: Any, um: UserModel, batch_size: int, seq_len: int, forwards: int, precision: str,
               kv_cache_dtype: str, weights_quant: str = "none") -> simulate.Recording:  # fmt: skip
    key = (id(model), um.ref, batch_size, seq_len, forwards, precision, kv_cache_dtype, weights_quant)
    if key not in _RECORDINGS:
        if len(_RECORDINGS) > 64:
            _RECORDINGS.clear()
        _RECORDINGS[key] = simulate.record(
            model, um, batch_size, seq_len, forwards, precision, kv_cache_dtype, forwards, weights_quant
        )
    return _RECORDINGS[key]


def estimate(model: Any, um: UserModel, batch_size: int, seq_len: int, new_tokens: int, precision: str,
             kv_cache_dtype: str = "auto", gpu: str = "h100", capacity_gb: float | None = None,
             weights_quant: str = "none") -> InferenceEstimate:  # fmt: skip
    """The inference call of ``model`` (any device: only shapes are read) predicted for a card of kind ``gpu``;
    ``capacity_gb``: the bytes the allocator may reserve on the card (None: as many as it asks for), and
    ``out_of_memory`` says whether it ran out."""
    start = time.perf_counter()
    lm = generates(um)
    new = new_tokens if lm else 1
    rec = _recording(model, um, batch_size, seq_len, min(new, simulate.RECORDED_FORWARDS), precision,
                     kv_cache_dtype, weights_quant)  # fmt: skip
    try:
        stream = list(simulate.decode_steps(rec, new))
    except ValueError:  # the decode steps differ: record every one of them
        rec = _recording(model, um, batch_size, seq_len, new, precision, kv_cache_dtype, weights_quant)
        stream = list(rec.events)
    capacity = None if capacity_gb is None else int(capacity_gb * GB)
    allocator, peaks, name, oom = CappedAllocator(capacity), {}, "set-up", None
    encoder_first = um.task == "seq2seq_lm"  # an encoder-decoder's prefill: its encoder, then its first step
    first = rec.starts[0] if rec.starts and not encoder_first else 0
    split = rec.starts[1] if lm and len(rec.starts) > 1 else -1  # where the first decode step begins
    try:
        for i, (kind, handle, nbytes) in enumerate(stream):
            if i in (first, split):
                peaks[name] = allocator.peak_allocated
                allocator.peak_allocated = allocator.allocated  # each phase's own peak
                name = ("prefill" if lm else "forward") if i == first else "decode"
            if kind == "alloc":
                allocator.malloc(handle, nbytes)
            else:
                allocator.free(handle)
    except OutOfMemory as e:
        oom = f"{name}: {e}"
    peaks[name] = allocator.peak_allocated
    if len(peaks) > 1:  # the weights alone: a phase only when the replay ran out of memory there
        peaks.pop("set-up")
    cache = rec.cache_bytes
    final_cache = 0
    if lm and cache:
        per_token = cache[-1] - cache[-2] if len(cache) >= 2 else 0
        final_cache = cache[-1] + max(0, new_tokens - len(cache)) * per_token
    base = rec.weights_bytes + rec.workspace_bytes
    components = {"weights": rec.weights_bytes / GB, "workspace": rec.workspace_bytes / GB}
    if lm:
        components.update(kv_cache=final_cache / GB, prefill_working=(peaks.get("prefill", base) - base - cache[0]) / GB,
                          logits=rec.logits_bytes / GB,
                          decode_working=(peaks.get("decode", base + final_cache) - base - final_cache) / GB)  # fmt: skip
    else:
        components.update(
            prefill_working=(peaks.get("forward", base) - base) / GB, logits=rec.logits_bytes / GB
        )
    top = max(peaks, key=peaks.get)
    over = overhead_per_gpu(gpu, "inference", 1)
    reserved = allocator.peak_reserved / GB
    return InferenceEstimate(
        model=um.ref, task=um.task, batch_size=batch_size, seq_len=seq_len, new_tokens=new_tokens if lm else None,
        precision=precision, kv_cache_dtype=kv_cache_dtype if lm else None,
        parameters=sum(p.numel() for p in model.parameters()), components_gb=components,
        peak_allocated_gb=max(peaks.values()) / GB, peak_phase=top, peak_reserved_gb=reserved,
        overhead_gb=over.gb, overhead_source=over.phrase(), gpu=gpu,
        device_peak_gb=None if over.gb is None else reserved + over.gb, kernels=sorted(rec.kernels),
        seconds=time.perf_counter() - start, capacity_gb=capacity_gb, released_gb=allocator.released / GB,
        out_of_memory=oom, weights_quant=weights_quant,
    )  # fmt: skip

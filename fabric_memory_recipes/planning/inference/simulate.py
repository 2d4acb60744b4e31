"""Inference on fake tensors: the runner's own inference call (training/your_model/inference.py: Hugging Face's
``generate()``, or one forward pass) executed under the training estimate's fake-tensor mode, every storage
tracked (planning/simulation/tracking.py), and its allocations replayed through the model of the caching
allocator (planning/simulation/allocator.py).

``generate()`` runs its prefill and three decode steps here; the remaining decode steps repeat the last two
with every size grown by the same bytes per token (the KV cache's ``torch.cat``, the attention mask, the
ids), so they are written from those two and replayed, step by step: the growing cache strands cached
blocks that no later, larger request can reuse, and only a replay of every step sees how many.

What a real run decides from tensor values is answered as for the runner's inputs (prompts without padding,
no sequence finished early): an ``all`` is true, an ``any`` false, ``sum == numel`` (a mask of ones) true,
``max == 0`` (nothing unfinished) false. Hugging Face keeps fake tensors off the paths that read values
(its masks are built in full when it sees a fake tensor); :func:`_as_on_a_gpu` lets them through, so the
simulated masks are those of a GPU run (none: SDPA's causal flag).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from fabric_memory_recipes.planning.plan import CUBLAS_WORKSPACE_BYTES, round_bytes
from fabric_memory_recipes.planning.simulation.modelled import cuda_runs_flash, replaced
from fabric_memory_recipes.planning.simulation.tracking import Tracker
from fabric_memory_recipes.training.techniques.inference import weights_quant as weights_quant_technique
from fabric_memory_recipes.training.your_model import inference
from fabric_memory_recipes.training.your_model.models import UserModel

_SCALAR_READS = (
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.item.default,
    torch.ops.aten.is_nonzero.default,
)
RECORDED_FORWARDS = 4  # the prefill and three decode steps; later steps are written from the last two


class _Recorded(Exception):
    """The forwards to record have run: generate() is stopped here."""


@dataclasses.dataclass
class Recording:
    """What the simulation saw: the allocator events, where each forward began, the KV cache's bytes after
    each forward and the prefill's logits."""

    events: list[tuple[str, int, int]]
    raw: dict[int, int]  # an allocation's handle -> its bytes before rounding
    starts: list[int]  # event index where each recorded forward began
    end: int  # events[:end] are the run's
    cache_bytes: list[int]
    logits_bytes: int
    weights_bytes: int
    workspace_bytes: int
    kernels: set[str]


class _InferenceTracker(Tracker):
    """The training estimate's tracker, which also answers the run's value reads (module docstring) and
    keeps each allocation's exact bytes (a decode step's sizes grow by bytes per token, not by 512s)."""

    def __init__(self) -> None:
        super().__init__({})
        self.raw: dict[int, int] = {}
        self._pending = 0
        self._made = WeakIdKeyDictionary()  # tensor -> (the op that made it, the op that made its input)

    def _device_alloc(self, category: str, nbytes: int) -> int:
        handle = super()._device_alloc(category, nbytes)
        if handle >= 0:
            self.raw[handle] = self._pending or nbytes
        return handle

    def record(self, t: Any, category: str = "temporaries"):
        if is_traceable_wrapper_subclass(t):  # a quantized weight: its parts are the storages, counted apart
            return None
        if isinstance(t, torch.Tensor):
            self._pending = t.untyped_storage().nbytes()
        return super().record(t, category)

    def add_constant(self, category: str, nbytes: int) -> None:
        self._pending = max(nbytes, 0)
        super().add_constant(category, nbytes)

    def _answer(self, t: torch.Tensor) -> Any:
        op, source = self._made.get(t, (None, None))
        value = {"all": True, "any": False}.get(op, op == "eq" and source == "sum")
        return value if t.dtype == torch.bool else (float(value) if t.is_floating_point() else int(value))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SCALAR_READS:
            return self._answer(args[0])
        out = super().__torch_dispatch__(func, types, args, kwargs)
        first = next((a for a in tree_leaves(args) if isinstance(a, torch.Tensor)), None)
        source = self._made.get(first, (None,))[0] if first is not None else None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._made[t] = (func.overloadpacket.__name__, source)
        return out


@contextlib.contextmanager
def _as_on_a_gpu() -> Iterator[None]:
    """Hugging Face's masks: decided from the values (module docstring), not skipped for fake tensors."""
    from transformers import masking_utils

    original = masking_utils.is_tracing
    with replaced(masking_utils, "is_tracing", lambda tensor=None: original(None)):
        yield


def _fused_attention_output(query: torch.Tensor, value: torch.Tensor, flash: bool) -> torch.Tensor:
    """What CUDA's fused kernels allocate, in their order, for ``query`` (batch, heads, seq, dim): both work on
    the (batch, seq, heads, dim) transpose and return their output transposed back. Flash attention's output
    is ``empty_like`` that transpose (its strides when dense, else contiguous), then its log-sum-exp (fp32)
    and two small random-state tensors, freed on return; the memory-efficient kernel's output is always
    (batch, seq, heads, dim) contiguous, with no log-sum-exp at inference. So where the query is laid out as
    (batch, seq, heads, dim) (a projection viewed per head), the caller's ``transpose(1, 2).contiguous()``
    copies nothing."""
    q_t = query.transpose(1, 2)
    if not flash:
        b, s, h = q_t.shape[:3]
        return torch.empty(b, s, h, value.shape[-1], dtype=query.dtype).transpose(1, 2)
    out = torch.empty_like(q_t)
    lse = torch.empty(query.shape[:-1], dtype=torch.float32)
    rng_state, unused = torch.empty(2, dtype=torch.int64), torch.empty((), dtype=torch.int64)
    del lse, rng_state, unused
    return out.transpose(1, 2)


@contextlib.contextmanager
def _sdpa_on_cuda(used: set[str]) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` as CUDA runs it at inference: flash attention for fp16/bf16 without
    a mask (grouped heads read in place), the memory-efficient kernel for other dtypes or with a mask, both
    without a score matrix (the log-sum-exp only, fp32); the math kernel only for grouped heads that
    flash cannot take (its expanded keys and values and its scores)."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        flash = cuda_runs_flash(query, attn_mask) and value.shape[-1] == query.shape[-1]
        if flash or not enable_gqa:
            used.add("flash" if flash else "efficient")
            return _fused_attention_output(query, value, flash)
        used.add("math")
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale
        )[0]

    with replaced(F, "scaled_dot_product_attention", sdpa):
        yield


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The keys and values a cache holds; an encoder-decoder's: its self-attention's and its cross-attention's."""
    parts = [getattr(cache, n, None) for n in ("self_attention_cache", "cross_attention_cache")]
    if any(part is not None for part in parts):
        return [t for part in parts if part is not None for t in _cache_tensors(part)]
    return [
        t
        for layer in getattr(cache, "layers", [])
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor) and t.numel()
    ]


def _hold_in_place(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Put ``state`` (by the names ``named_parameters`` and ``named_buffers`` give) into ``model`` itself,
    every name that shares a tensor sharing its replacement (tied weights): ``model`` is a copy of its own."""
    tensors = {id(t): state[n] for n, t in [*model.named_parameters(), *model.named_buffers()]}
    for module in model.modules():
        for where in (module._parameters, module._buffers):
            for name, t in where.items():
                if t is not None:
                    where[name] = tensors[id(t)]


def _stored_bytes(t: torch.Tensor) -> int:
    """A tensor's bytes in memory: its storage's, or a quantized tensor's parts (its int8 values, scales)."""
    if is_traceable_wrapper_subclass(t):
        return sum(_stored_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.untyped_storage().nbytes()


def record(
    model: Any,
    um: UserModel,
    batch_size: int,
    seq_len: int,
    new_tokens: int,
    precision: str,
    kv_cache_dtype: str = "auto",
    forwards: int = RECORDED_FORWARDS,
    weights_quant: str = "none",
) -> Recording:
    """Run the inference call on fake tensors: the first ``forwards`` forward passes of ``generate()`` (all of
    them when ``new_tokens`` is not larger; an encoder-decoder's encoder runs before its first), else one
    forward pass."""
    dtype = inference.weights_dtype(precision)
    tracker, kernels = _InferenceTracker(), set()
    starts: list[int] = []
    cache_bytes: list[int] = []
    logits: list[int] = []
    wanted = min(forwards, new_tokens) if inference.generates(um) else 1

    stopped: list[int] = []

    def before(module, args, kwargs):
        if len(starts) == wanted:
            stopped.append(len(tracker.events))
            raise _Recorded
        starts.append(len(tracker.events))

    def after(module, args, kwargs, out):
        tensors = _cache_tensors(kwargs.get("past_key_values") or getattr(out, "past_key_values", None))
        for t in tensors:
            tracker.retag(t, "kv_cache")
        cache_bytes.append(sum(t.untyped_storage().nbytes() for t in tensors))
        found = getattr(out, "logits", out)
        if not logits and isinstance(found, torch.Tensor):
            logits.append(found.untyped_storage().nbytes())

    if weights_quant != "none":  # quantizing replaces its weights: the caller's model stays as it is
        model = copy.deepcopy(model)
    hooks = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        with contextlib.ExitStack() as stack:
            previous = torch.get_default_dtype()
            stack.callback(torch.set_default_dtype, previous)
            torch.set_default_dtype(torch.float32)
            stack.enter_context(torch.device("cpu"))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(tracker)
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            if um.source == "hf":
                stack.enter_context(_as_on_a_gpu())
            stack.enter_context(_sdpa_on_cuda(kernels))
            with tracker.creating("parameters"):
                state = {
                    n: torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype)
                    for n, p in [*model.named_parameters(), *model.named_buffers()]
                }
            weights = sum(t.untyped_storage().nbytes() for t in state.values())
            # cuBLAS's workspace: one, for the one thread and stream (no autograd thread at inference)
            tracker.add_constant("workspace", CUBLAS_WORKSPACE_BYTES)
            if weights_quant == "none":
                stack.enter_context(_reparametrize_module(model, state, tie_weights=True))
            else:  # as the runner does after building the model: each weight freed as its quantized copy
                _hold_in_place(model, state)  # replaces it, the module holding the only reference to it
                state.clear()
                with tracker.creating("parameters"), torch.no_grad():
                    weights_quant_technique.quantize(model, weights_quant)
                weights = sum(_stored_bytes(t) for t in [*model.parameters(), *model.buffers()])
            stack.enter_context(torch.inference_mode())
            inputs = inference.model_inputs(um, model, batch_size, seq_len, dtype, "cpu")
            with contextlib.suppress(_Recorded):
                out = inference.infer(model, um, inputs, new_tokens, kv_cache_dtype, dtype)
                del out
            end = stopped[0] if stopped else len(tracker.events)
            del inputs, state
    finally:
        for h in hooks:
            h.remove()
    return Recording(
        tracker.events[:end],
        tracker.raw,
        starts,
        end,
        cache_bytes,
        logits[0] if logits else 0,
        weights,
        CUBLAS_WORKSPACE_BYTES,
        kernels,
    )


def decode_steps(rec: Recording, new_tokens: int) -> Iterator[tuple[str, Any, int]]:
    """Every allocator event of the whole run: the recorded ones, then decode steps written from the last
    two recorded (each size grown by its bytes per token); ``ValueError`` if those two steps differ in
    anything but sizes (then record every step instead)."""
    yield from rec.events
    recorded = len(rec.starts)
    if new_tokens <= recorded:
        return
    (a, b), end = rec.starts[-2:], rec.end
    previous, last = rec.events[a:b], rec.events[b:end]
    if len(previous) != len(last) or any(p[0] != q[0] for p, q in zip(previous, last, strict=True)):
        raise ValueError("two decode steps allocate differently")
    for kind, handle, _ in last:
        if kind == "free" and not a <= handle < end:
            raise ValueError("a decode step frees what an earlier step than the one before made")
    grow = {
        i: rec.raw[q[1]] - rec.raw[p[1]]
        for i, (p, q) in enumerate(zip(previous, last, strict=True))
        if p[0] == "alloc"
    }
    for step in range(recorded, new_tokens):  # step k: the k-th forward (0 is the prefill)
        ahead = step - recorded + 1
        for i, (kind, handle, _) in enumerate(last):
            if kind == "alloc":
                yield "alloc", (step, i), round_bytes(rec.raw[handle] + ahead * grow[i])
            elif handle >= b:  # made in this step
                yield "free", (step, handle - b), 0
            else:  # made in the step before
                yield "free", (step - 1, handle - a) if step > recorded else handle + (b - a), 0

"""What each op of a simulated training step costs the GPU: :class:`OpCosts`, a dispatch mode that
records, for every aten op run while it is collecting, its FLOPs, the bytes it reads and writes, its
kind and whether it launches a kernel.

``simulate(..., op_costs=OpCosts())`` enters it beside the fake mode and switches it on for the forward
and backward passes of each simulated micro-batch (checkpointed blocks recompute in backward, so their
forward ops count twice, as they run twice on the GPU); the optimizer step is not recorded: its cost
follows from the state's bytes (planning/planner/step_time.py).

* FLOPs: torch's own formulas (``torch.utils.flop_counter.flop_registry``: matmuls, convolutions and
  their backward, the fused attention kernels and their backward); 0 for every other op.
* bytes: the tensor inputs' and outputs' bytes (a broadcast input counts its stored elements once), what
  an unfused kernel moves through memory at least.
* kind: ``matmul`` for the ops of the registry (tensor-core work), ``memory`` for the rest.
* kernels: 1 per op, 0 for ops that only make a view or an uninitialised tensor, or return no tensor
  (a query such as ``prim.device``): no kernel runs.
* strided: a memory-bound op whose tensors are not all dense in one order of their dimensions (a permuted view
  beside a contiguous tensor, a slice) runs ATen's elementwise kernels that compute each element's offset (a fifth
  of Swin-V2-T's memory-bound bytes: its windows).
* a matrix product with an operand whose last two dimensions are not whole 16-byte vectors (``unaligned``: a
  vocabulary of 50257 tokens in bf16) runs cuBLAS's element-wise-reading kernels: GPT-2 small's fused loss
  ran its vocabulary products at about 105 TFLOP/s on an H200, its other linear layers at 600 and more
  (results/published/h200/your-model-speed/vision-graph-profile/).
* shape: a matrix product's M, N, K (an [M, K] by [K, N] product; a batched one's batch folded into M) and its
  operands' layout (n: rows contiguous, t: a transposed view): the step time model reads its rate from the GPU
  kind's measured table of such products (measurement/gemm_rates.py).
* BatchNorm in training (:data:`STATISTICS_PASS`): ATen's CUDA kernels first reduce per channel (forward: the
  batch's statistics from the input; backward: the sums of the output's gradient and of its product with the
  input), then run the elementwise pass; the first pass's reads are ``reduced_bytes`` and a kernel more (the
  step time model prices them at their own rate: channels-last statistics kernels read at 0.2-0.7 TB/s on an
  H200 where the elementwise pass reaches 1-3, results/published/h200/your-model-speed/vision-graph-profile/).
* in a block: the op runs inside one of the repeated blocks the collector is given (what fast mode compiles,
  so only these ops' kernels fuse): in the forward and the recompute, between the block's forward pre-hook
  and hook; in the backward, when the autograd node running it was made by a block's forward (its sequence
  number in a range the forward hooks recorded).

The ops are kept one row each, in the order they ran, per section (the micro-batch's index and the
pass): the step time model weighs each op against the GPU's ceilings, which a sum over ops could not.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections import defaultdict
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
LOW_PRECISION = (torch.float16, torch.bfloat16)
# Ops that run no kernel: a new tensor's metadata only, or a query.
NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.lift_fresh.default,
    aten.detach.default,
    aten.alias.default,
    aten._unsafe_view.default,  # a view whose schema does not say so
    aten.set_.source_Storage_storage_offset,
    aten.resize_.default,
    aten.is_same_size.default,
    aten._has_compatible_shallow_copy_type.default,
}
# A tensor's device, which autograd's engine asks of a fake tensor through the dispatch modes (most of the
# ops of a simulated backward pass).
DEVICE_QUERY = torch.ops.prim.device.default
# The matrix products whose operands' alignment decides cuBLAS's kernels (:func:`unaligned`).
MATRIX_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm"}
# BatchNorm's ops that reduce per channel before their elementwise pass, when training: the op's name and the
# inputs that pass reads (module docstring).
STATISTICS_PASS = {
    "native_batch_norm": ("input",),
    "_native_batch_norm_legit": ("input",),
    "_native_batch_norm_legit_functional": ("input",),
    "cudnn_batch_norm": ("input",),
    "native_batch_norm_backward": ("grad_out", "input"),
    "batch_norm_backward": ("grad_out", "input"),
}


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One op as the GPU would run it."""

    name: str
    flops: float
    bytes: float
    matmul: bool  # tensor-core work (the FLOP registry's ops); else memory-bound
    low_precision: bool  # its first floating-point input is fp16/bf16 (tensor cores at full rate)
    kernels: int  # 0: a view or metadata only
    backward: bool = False  # run by the backward pass (autograd's engine, no Python module around it)
    recompute: bool = False  # a forward op run again in backward by activation checkpointing
    in_block: bool = False  # run inside a repeated block (fast mode compiles those: module docstring)
    # read by a per-channel statistics pass before the op's own (BatchNorm in training: :func:`statistics_bytes`)
    reduced_bytes: float = 0.0
    strided: bool = False  # a memory-bound op whose tensors are not all dense in one order (:func:`strided`)
    # a matrix product with a dimension cuBLAS cannot read in 16-byte vectors (:func:`unaligned`)
    unaligned: bool = False
    # a matrix product's (M, N, K, layout) (:func:`product_shape`); None for any other op
    shape: tuple[int, int, int, str] | None = None


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes an op reads or writes of ``t``: its elements once each (a broadcast dimension, stride 0,
    stores one)."""
    numel = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        numel *= size if stride != 0 else min(size, 1)
    return numel * t.element_size()


def op_cost(func: Any, args: tuple, kwargs: dict, out: Any) -> OpCost:
    """The cost of one op from its inputs and outputs (fake tensors are enough: only shapes are read)."""
    name = _name(func)
    if func in NO_KERNEL or getattr(func, "is_view", False):  # views
        return _no_kernel(name)
    tensors_out = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not tensors_out:  # queries (.device)
        return _no_kernel(name)
    tensors_in = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    nbytes = sum(tensor_bytes(t) for t in tensors_in) + sum(tensor_bytes(t) for t in tensors_out)
    packet = getattr(func, "overloadpacket", None)
    formula = flop_registry.get(packet)
    flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
    floats = [t for t in tensors_in if t.is_floating_point()]
    low = bool(floats) and floats[0].dtype in LOW_PRECISION
    reduced = statistics_bytes(func, name, args, kwargs)
    gather = formula is None and strided([*tensors_in, *tensors_out], tensors_out[0].dim())
    odd = name in MATRIX_PRODUCTS and unaligned([*tensors_in, *tensors_out])
    shape = product_shape(name, args) if name in MATRIX_PRODUCTS else None
    kernels = 2 if reduced else 1
    return OpCost(
        name,
        flops,
        float(nbytes),
        formula is not None,
        low,
        kernels,
        reduced_bytes=reduced,
        strided=gather,
        unaligned=odd,
        shape=shape,
    )


def product_shape(name: str, args: tuple) -> tuple[int, int, int, str] | None:
    """(M, N, K, layout) of a matrix product (``mm``, ``bmm``: the first two arguments are its operands; ``addmm``,
    ``baddbmm``: the second and third): a batched product's batch folded into M; layout ``n`` or ``t`` per operand
    (its last dimension contiguous, or its second-last: a transposed view). None when the operands are not two
    tensors of two or three dimensions."""
    a, b = args[1:3] if name in ("addmm", "baddbmm") else args[:2]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() not in (2, 3):
        return None
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    m *= a.shape[0] if a.dim() == 3 else 1
    layout = "".join("t" if t.stride(-1) != 1 and t.stride(-2) == 1 else "n" for t in (a, b))
    return int(m), int(n), int(k), layout


def unaligned(tensors: list[torch.Tensor]) -> bool:
    """Whether a matrix product's operands have a matrix dimension that is not a whole number of 16-byte vectors
    (a 50257-token vocabulary in bf16): cuBLAS then falls back to kernels that read one element at a time."""
    return any(
        t.dim() >= 2 and any(n % max(1, 16 // t.element_size()) for n in t.shape[-2:]) for t in tensors
    )


def strided(tensors: list[torch.Tensor], ndim: int) -> bool:
    """Whether an op's tensors of ``ndim`` dimensions are not all dense in one order of their dimensions (a
    permuted view beside a contiguous tensor, a slice): ATen's elementwise kernels then compute each element's
    offset instead of reading vectors. Broadcast (stride 0) and size-1 dimensions are left out of the order.
    """
    orders: list[tuple[int, ...]] = []
    for t in tensors:
        if t.dim() != ndim or t.numel() < 2:
            continue
        dims = sorted(
            (i for i in range(ndim) if t.shape[i] > 1 and t.stride(i) > 0), key=lambda i: -t.stride(i)
        )
        expected = 1
        for i in reversed(dims):
            if t.stride(i) != expected:
                return True
            expected *= t.shape[i]
        orders.append(tuple(dims))
    return any(_order_differs(a, b) for a, b in zip(orders, orders[1:], strict=False))


def statistics_bytes(func: Any, name: str, args: tuple, kwargs: dict) -> float:
    """The bytes a BatchNorm op's per-channel statistics pass reads in training (0: another op, or evaluation)."""
    read = STATISTICS_PASS.get(name)
    if read is None:
        return 0.0
    given = {
        a.name: args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(func._schema.arguments)
    }
    if not given.get("training", given.get("train", given.get("update", True))):
        return 0.0
    return float(sum(tensor_bytes(given[k]) for k in read if isinstance(given.get(k), torch.Tensor)))


def _order_differs(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether two tensors lay out the dimensions both hold in different orders."""
    return [d for d in a if d in b] != [d for d in b if d in a]


@functools.cache
def _name(func: Any) -> str:
    return str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)


@functools.cache
def _no_kernel(name: str, backward: bool = False, recompute: bool = False) -> OpCost:
    """The row of an op that runs no kernel (one frozen row shared by every such op of one name)."""
    return OpCost(name, 0.0, 0.0, False, False, 0, backward, recompute)


def _in_backward(cost: OpCost, recompute: bool) -> OpCost:
    """``cost`` run by the backward pass (``recompute``: a checkpointed block's forward op run again)."""
    if cost is _no_kernel(cost.name):
        return _no_kernel(cost.name, True, recompute)
    return dataclasses.replace(cost, backward=True, recompute=recompute)


class OpCosts(TorchDispatchMode):
    """Records :class:`OpCost` rows while ``section`` is set (None: nothing is recorded). Enter it
    under the fake mode (it reads shapes only and passes every op on unchanged).

    ``section`` is ``(micro-batch, "forward" | "backward")``. An op that autograd's engine runs with
    gradients enabled is a checkpointed block's recompute (the engine runs the backward ops themselves
    with gradients off; the recompute turns them on to rebuild the block's graph): it is marked ``recompute``,
    so that the model FLOPs of :meth:`model_flops` leave it out, as model FLOPs utilisation does.

    ``blocks``: the class names of the repeated blocks; each op is marked ``in_block`` when one of them runs it
    (the module docstring says how)."""

    def __init__(self, blocks: tuple[str, ...] | frozenset[str] = ()) -> None:
        super().__init__()
        self.blocks = frozenset(blocks)
        self._depth = 0  # blocks entered and not left (forward and recompute)
        self._started = 0  # the autograd sequence number when the outermost block was entered
        self._node_starts: list[int] = []  # sequence-number ranges of the blocks' forward nodes, sorted
        self._node_ends: list[int] = []
        self.section: Any = None
        self.ops: dict[Any, list[OpCost]] = defaultdict(list)
        self.optimizer: dict[str, float] = {}  # the optimizer step's bytes and tensors (simulate fills it)
        # the largest saved tensor activation offload copies to the host, or would without it (simulate fills it)
        self.largest_offloadable = 0
        self.modules: dict[Any, int] = defaultdict(int)  # module calls per section (forward and recompute)
        self._module_hook = None

    def __enter__(self) -> OpCosts:
        hooks = torch.nn.modules.module
        self._module_hook = (hooks.register_module_forward_pre_hook(self._module_called),)
        if self.blocks:  # where a block's forward ends (no blocks: nothing to mark)
            self._module_hook += (hooks.register_module_forward_hook(self._module_left),)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        for hook in self._module_hook or ():
            hook.remove()
        self._module_hook = None
        super().__exit__(*exc)

    def _module_called(self, module: torch.nn.Module, args: Any) -> None:
        if self.section is not None:
            self.modules[self.section] += 1
        if type(module).__name__ in self.blocks:
            self._depth += 1
            if self._depth == 1:
                self._started = torch._C._autograd._get_sequence_nr()

    def _module_left(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if type(module).__name__ not in self.blocks or not self._depth:
            return
        self._depth -= 1
        forward = self.section is not None and self.section[-1] == "forward"  # not a recompute's nodes
        if not self._depth and forward:
            self._node_starts.append(self._started)
            self._node_ends.append(torch._C._autograd._get_sequence_nr())

    def _in_block(self) -> bool:
        """Whether the op being recorded runs inside a block (forward, recompute, or a block's backward node)."""
        if self._depth:
            return True
        node = torch._C._current_autograd_node()
        if node is None or not self._node_starts:
            return False
        seq = node._sequence_nr()
        i = bisect.bisect_right(self._node_starts, seq) - 1
        return i >= 0 and seq < self._node_ends[i]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is DEVICE_QUERY and fake_device_known(args):
            return self.device_query(args[0])
        out = func(*args, **kwargs)
        if self.section is not None and isinstance(func, torch._ops.OpOverload):
            self._record(op_cost(func, args, kwargs, out))
        return out

    def device_query(self, t: FakeTensor) -> torch.device:
        """A fake tensor's device, as the fake mode answers it (without its dispatch: autograd's engine asks it
        of most tensors of a backward pass), recorded as the op it is (no kernel)."""
        if self.section is not None:
            self._record(_no_kernel(_name(DEVICE_QUERY)))
        return t.fake_device

    def _record(self, cost: OpCost) -> None:
        if self.section[-1] == "backward":  # recompute: inside autograd's engine, gradients on
            recompute = torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
            cost = _in_backward(cost, recompute)
        if cost.kernels and self.blocks and self._in_block():
            cost = dataclasses.replace(cost, in_block=True)
        self.ops[self.section].append(cost)

    def of(self, micro: int) -> list[OpCost]:
        """The ops of one micro-batch, forward then backward (empty if it did not run)."""
        return [*self.ops.get((micro, "forward"), []), *self.ops.get((micro, "backward"), [])]

    def module_calls(self, micro: int) -> int:
        """Module calls of one micro-batch: its forward and the recompute of checkpointed blocks."""
        return self.modules.get((micro, "forward"), 0) + self.modules.get((micro, "backward"), 0)

    def model_flops(self, micro: int = 0) -> float:
        """FLOPs of one micro-batch's forward and backward passes, without the recompute."""
        return sum(r.flops for r in self.of(micro) if not r.recompute)

    def totals(self, micro: int | None = None) -> dict[str, float]:
        """FLOPs, bytes, kernels and ops summed over one micro-batch, or over all."""
        rows = [r for s, ops in self.ops.items() if micro is None or s[0] == micro for r in ops]
        return {
            "flops": sum(r.flops for r in rows),
            "bytes": sum(r.bytes for r in rows),
            "kernels": sum(r.kernels for r in rows),
            "ops": len(rows),
        }


def fake_device_known(args: tuple) -> bool:
    """Whether the fake mode would answer a device query of ``args`` with the fake tensor's own device (its
    ``_device_handler``: always, but inside a kernel it runs, where the answer is the meta device)."""
    return len(args) == 1 and isinstance(args[0], FakeTensor) and not args[0].fake_mode.in_kernel_invocation

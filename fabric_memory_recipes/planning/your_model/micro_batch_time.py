"""One micro-batch's time on a GPU kind's ceilings: each op's time on the GPU and on the host, and the
queue they form (:meth:`MicroBatch.seconds`).

The terms, the queue and why this form: planning/your_model/step_time.py's docstring, which adds the
micro-batches, the optimizer step and activation offload into a step. The ceilings (:class:`Ceilings`) are
fitted per GPU kind by planning/your_model/step_calibration.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fabric_memory_recipes.measurement import gemm_rates
from fabric_memory_recipes.planning.simulation.costs import OpCost

# Dense TF32 over dense bf16 tensor-core peak of the H100 SXM datasheet (494.7 / 989.4 TFLOP/s): an fp32
# matmul (TF32 allowed, as every run here sets) runs at this share of a bf16 one.
TF32_RATIO = 0.5


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """What one GPU kind (and its host) reaches, fitted on its committed runs (step_time.py's docstring)."""

    matmul_flops: float  # F: bf16 FLOP/s of matmul-like ops
    bandwidth: float  # B: bytes/s of memory-bound ops
    kernel_s: float  # g: each kernel's fixed time on the GPU
    python_op_s: float  # L_py: host time of an op Python issues, eager mode
    module_s: float  # L_mod: host time of a module call, eager mode
    autograd_op_s: float  # L_ag: host time of an op autograd or autocast issues, eager mode
    recompute_block_s: float  # C: host time of a checkpointed block's recompute, eager mode
    compiled_call_s: float  # L_call: host time per compiled-region call, fast mode without CUDA graphs
    fusion: float  # phi: the share of memory-bound bytes and kernels left after fusion, fast mode
    hook_s: float  # H: per parameter tensor, the step in backward (host)
    host_bandwidth: float  # B_host: bytes/s of activation offload's copies
    graph_kernel_s: float = 0.0  # g_graph: each kernel's fixed time in a CUDA graph's replay (0: g)
    statistics_bandwidth: float = 0.0  # B_stat: bytes/s of BatchNorm's per-channel statistics passes (0: B)
    strided_bandwidth: float = 0.0  # B_str: bytes/s of a memory-bound op on strided tensors (0: B)
    unaligned_flops: float = 0.0  # F_odd: FLOP/s of a matrix product on unaligned operands (0: F)
    # the GPU kind whose measured products (gemm_rates.py) shape a matrix product's rate: F x its share of that
    # table's best; "": F for every product. Not fitted.
    gemm_table: str = ""

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def shown(self) -> dict[str, str]:
        """Each ceiling as printed: a rate or time to 4 significant digits, the measured products' kind by name."""
        return {k: f"{v:.4g}" if isinstance(v, float) else (v or "none") for k, v in self.to_dict().items()}


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch's ops as arrays (one entry per op)."""

    flops: np.ndarray  # FLOPs at the bf16 rate (an fp32 matmul's / TF32_RATIO)
    bytes: np.ndarray
    kernels: np.ndarray
    matmul: np.ndarray  # bool
    python: np.ndarray  # bool: issued by Python code (a forward op or a recompute; no autocast cast)
    recompute_starts: np.ndarray  # bool: the first op of a recomputed block
    module_calls: int
    compiled_calls: float = 0.0  # fast mode's compiled-region calls (step_time.fast_calls)
    in_block: np.ndarray | None = None  # bool: run inside a repeated block (fast mode fuses these); None: all
    reduced: np.ndarray | float = 0.0  # bytes of a per-channel statistics pass (BatchNorm in training)
    strided: np.ndarray | bool = False  # bool: a memory-bound op on strided tensors (costs.strided)
    unaligned: np.ndarray | bool = False  # bool: a matrix product on unaligned operands (costs.unaligned)
    backward: np.ndarray | bool = False  # bool: run in the backward pass (its own ops and any recompute)
    # each op's (M, N, K, layout) if a matrix product, else None (costs.product_shape); its shares per table kind
    shapes: list | None = None
    _shares: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, ops: list[OpCost], module_calls: int, compiled_calls: float = 0.0) -> MicroBatch:
        rc = np.array([o.recompute for o in ops], dtype=bool)
        starts = rc & ~np.concatenate(([False], rc[:-1])) if len(rc) else rc
        return cls(
            flops=np.array([o.flops / (1.0 if o.low_precision else TF32_RATIO) for o in ops], dtype=float),
            bytes=np.array([o.bytes for o in ops], dtype=float),
            kernels=np.array([o.kernels for o in ops], dtype=float),
            matmul=np.array([o.matmul for o in ops], dtype=bool),
            python=np.array(
                [(not o.backward or o.recompute) and o.name != "_to_copy" for o in ops], dtype=bool
            ),
            recompute_starts=starts,
            module_calls=module_calls,
            compiled_calls=compiled_calls,
            in_block=np.array([o.in_block for o in ops], dtype=bool),
            reduced=np.array([o.reduced_bytes for o in ops], dtype=float),
            strided=np.array([o.strided for o in ops], dtype=bool),
            unaligned=np.array([o.unaligned for o in ops], dtype=bool),
            backward=np.array([o.backward for o in ops], dtype=bool),
            shapes=[None if o.unaligned or not o.low_precision else o.shape for o in ops],
        )

    @staticmethod
    def kernel_s(c: Ceilings, mode: str, graphs: bool) -> float:
        """Each kernel's fixed time on the GPU: g_graph in a CUDA graph's replay (the GPU starts its nodes back to
        back), g where the host launches each (a kind fitted without g_graph: g everywhere)."""
        return c.graph_kernel_s if mode == "fast" and graphs and c.graph_kernel_s else c.kernel_s

    def flop_rate(self, c: Ceilings, shaped: bool = True) -> np.ndarray | float:
        """Each op's FLOP/s: F, or F_odd for a matrix product on unaligned operands; with ``c.gemm_table`` (and
        ``shaped``) an aligned half-precision matrix product's F times its shape's share of the table's best."""
        rate = np.where(self.unaligned, c.unaligned_flops or c.matmul_flops, c.matmul_flops)
        if not (shaped and c.gemm_table and self.shapes):
            return rate
        if c.gemm_table not in self._shares:
            self._shares[c.gemm_table] = gemm_rates.shares(c.gemm_table, self.shapes)
        return rate * self._shares[c.gemm_table]

    def fusion_share(self, c: Ceilings, mode: str, fused: bool) -> np.ndarray | float:
        """What is left of each memory-bound op's bytes and launches: in fast mode with compiled blocks, the
        fusion's share phi for the ops inside the blocks (the rest run as eager mode runs them: the embedding,
        the loss, anything outside the compiled regions), else all of it."""
        if mode == "eager" or not fused:
            return 1.0
        return c.fusion if self.in_block is None else np.where(self.in_block, c.fusion, 1.0)

    def seconds(
        self,
        c: Ceilings,
        mode: str,
        graphs: bool,
        fused: bool = True,
        hooks_s: float = 0.0,
    ) -> float:
        """The queue of :mod:`step_time`'s docstring: max over ops of issue time + the GPU time left
        (``fused``: fast mode compiled the blocks, so their memory-bound ops take the fusion's share;
        ``hooks_s``: the step in backward's host time, issued as the backward pass makes the gradients:
        spread over its ops by their kernels)."""
        memory = self.bytes / np.where(self.strided, c.strided_bandwidth or c.bandwidth, c.bandwidth)
        memory = memory + self.reduced / (c.statistics_bandwidth or c.bandwidth)
        launched = self.kernels * self.kernel_s(c, mode, graphs)
        other = self.fusion_share(c, mode, fused) * (memory * (self.kernels > 0) + launched)
        gpu = np.where(self.matmul, np.maximum(self.flops / self.flop_rate(c), memory) + launched, other)
        host = self.host_times(c, mode if fused else "eager")  # blocks not compiled, step not captured: eager
        if hooks_s and len(host):
            kernels = self.kernels * self.backward
            host = host + hooks_s * (kernels / kernels.sum() if kernels.sum() else np.eye(len(host))[-1])
        if mode == "fast" and graphs:
            return float(gpu.sum())
        if not len(host):
            return 0.0
        gpu_left = np.cumsum(gpu[::-1])[::-1]
        return float((np.cumsum(host) + gpu_left).max())

    def host_times(self, c: Ceilings, mode: str) -> np.ndarray:
        """Each op's time on the host (eager, or fast mode's compiled blocks without CUDA graphs; fast mode
        whose blocks run eagerly and whose step is not captured issues every op as eager mode does); fast mode's
        is its compiled-region calls' (``compiled_calls`` x L_call), spread over the ops by their kernels."""
        if mode == "eager":
            python_ops = max(1.0, float((self.kernels * self.python).sum()))
            per_python = c.python_op_s + c.module_s * self.module_calls / python_ops
            host = self.kernels * np.where(self.python, per_python, c.autograd_op_s)
            return host + c.recompute_block_s * self.recompute_starts
        per_kernel = c.compiled_call_s * self.compiled_calls / max(1.0, float(self.kernels.sum()))
        return self.kernels * per_kernel  # the compiled-region calls' host time, spread over the kernels

    def floor_seconds(
        self,
        c: Ceilings,
        mode: str,
        graphs: bool,
        fused: bool = True,
        scale: float = 1.0,
        kept: float = 1.0,
        kept_memory: float = 1.0,
    ) -> float:
        """No more than :meth:`seconds` of the same ops on ``scale`` x this micro-batch: the matmul FLOPs scale
        with the batch, the bytes are left out, and each op's launch and the host's work count ``kept`` times
        (``kept * kept_memory`` for an op without FLOPs): as often as the smaller micro-batch runs the op at
        least (1: every op runs there too); the queue takes at least the GPU's sum and at least the host's."""
        runs = np.where(self.matmul, kept, kept * kept_memory)
        launched = runs * self.kernels * self.kernel_s(c, mode, graphs)
        share = self.fusion_share(c, mode, fused)
        gpu = float(
            np.where(
                self.matmul, scale * self.flops / self.flop_rate(c, False) + launched, share * launched
            ).sum()
        )
        if mode == "fast" and graphs:
            return gpu
        return max(gpu, float((runs * self.host_times(c, mode if fused else "eager")).sum()))

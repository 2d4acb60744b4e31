"""Your model sharded (``recipes/your_model.py --fsdp``): the strategy, one FSDP unit per repeated block.

Eager mode shards with FSDP (Lightning's ``FSDPStrategy``, whose precision plugin gathers the parameters in
the compute precision of a "-mixed" run). Fast mode takes the ladder's fast sharded path (rung 08's FSDP2
variant, ``recipes/08_fsdp2.py``): each repeated block, compiled by the runner's fast mode, is its own
``fully_shard`` unit, asks for the next block's all-gather ahead of use, and the last block stays gathered
between forward and backward; the parameters are gathered in the compute precision
(``MixedPrecisionPolicy(param_dtype=bf16)`` for bf16-mixed, as FSDP's mixed precision under Lightning), so
autocast has no weight to copy and the estimate's model of FSDP's mixed precision holds for both.
``--cpu-offload``: FSDP's ``CPUOffload`` or FSDP2's ``CPUOffloadPolicy``, the shards in host memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from fabric_memory_recipes.training.techniques.checkpointing import CheckpointedBlock

LOW = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
FSDP2_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")  # what ModelParallelStrategy takes


def fully_sharded(compile: bool, precision: str) -> bool:
    """Whether ``--fsdp`` shards with FSDP2 (``fully_shard``): in fast mode (``compile``), except for 16-mixed,
    which Lightning's ModelParallelStrategy refuses."""
    return bool(compile) and precision in FSDP2_PRECISIONS


def strategy(cfg: Any, units: set[type]) -> Any:
    """The runner's strategy: "auto" without ``--fsdp``; FSDP in eager mode; FSDP2 with compiled blocks in
    fast mode (``cfg.compile``), except for 16-mixed (:func:`fully_sharded`)."""
    if not cfg.fsdp:
        return "auto"
    # here: the estimator imports this module (fully_sharded, LOW), and Lightning costs it seconds of start-up
    from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy

    if not fully_sharded(cfg.compile, cfg.precision):
        return FSDPStrategy(auto_wrap_policy=units, **({"cpu_offload": True} if cfg.cpu_offload else {}))
    names = tuple(sorted(u.__name__ for u in units))
    options = shard_options(cfg.precision, cfg.cpu_offload)

    def parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
        return shard_blocks(model, device_mesh["data_parallel"], names, options)

    return ModelParallelStrategy(parallelize, data_parallel_size=cfg.world_size, tensor_parallel_size=1)


def shard_options(precision: str, cpu_offload: bool) -> dict[str, Any]:
    """``fully_shard``'s mixed precision and offload policies for the run's precision and ``--cpu-offload``."""
    options: dict[str, Any] = {}
    if precision in LOW:  # gathered and computed in low precision, reduced in it (as FSDP under Lightning)
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=LOW[precision])
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return options


def units_of(model: nn.Module, blocks: tuple[str, ...]) -> list[nn.Module]:
    """The modules to shard, in order: every repeated block, or its checkpoint wrapper where it has one."""
    wrapped = {id(m.block): m for m in model.modules() if isinstance(m, CheckpointedBlock)}
    return [wrapped.get(id(m), m) for m in model.modules() if type(m).__name__ in blocks]


def shard_blocks(model: nn.Module, mesh: Any, blocks: tuple[str, ...], options: dict[str, Any]) -> nn.Module:
    """``fully_shard`` each repeated block (the last one kept gathered after forward), each asking for the
    next one's all-gather ahead, then the root (embeddings, final norm, head)."""
    units = units_of(model, blocks)
    for i, unit in enumerate(units):
        fully_shard(unit, mesh=mesh, reshard_after_forward=i < len(units) - 1, **options)
    for unit, after in zip(units, units[1:], strict=False):
        unit.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([unit])
    return fully_shard(model, mesh=mesh, **options)

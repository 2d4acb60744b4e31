"""Your model sharded (training/your_model/sharding.py): FSDP in eager mode, FSDP2 with the blocks gathered
in the compute precision in fast mode, on a 1-process gloo group (CPU only)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from fabric_memory_recipes.training.techniques import checkpointing
from fabric_memory_recipes.training.your_model import sharding
from tests.conftest import free_port


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.layers, self.head = (
            nn.Linear(8, 16),
            nn.ModuleList(Block() for _ in range(3)),
            nn.Linear(16, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.fixture
def gloo_group():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    if started:
        dist.destroy_process_group()


def test_the_strategy_follows_the_mode_and_the_offload():
    cfg = types.SimpleNamespace(
        fsdp=True, compile=False, cpu_offload=True, precision="bf16-mixed", world_size=2
    )
    eager = sharding.strategy(cfg, {Block})
    assert isinstance(eager, FSDPStrategy) and eager.cpu_offload.offload_params
    cfg.compile = True
    assert isinstance(sharding.strategy(cfg, {Block}), ModelParallelStrategy)
    cfg.precision = "16-mixed"  # which Lightning's ModelParallelStrategy refuses: FSDP with compiled blocks
    assert isinstance(sharding.strategy(cfg, {Block}), FSDPStrategy)
    cfg.fsdp = False
    assert sharding.strategy(cfg, {Block}) == "auto"
    options = sharding.shard_options("bf16-mixed", True)
    assert options["mp_policy"].param_dtype == torch.bfloat16 and isinstance(
        options["offload_policy"], CPUOffloadPolicy
    )
    assert sharding.shard_options("32-true", False) == {} and "mp_policy" not in sharding.shard_options(
        "bf16-true", False
    )


def test_fast_mode_shards_each_checkpointed_block_and_gathers_it_in_bf16(gloo_group):
    """Every repeated block's checkpoint wrapper is a unit asking for the next one's all-gather, the last
    kept gathered after forward, and the forward sees bf16 weights (no autocast copy): FSDP's mixed
    precision, which the estimate models."""
    model = Tiny()
    checkpointing.checkpoint_blocks(model, ("Block",))
    seen = []
    model.layers[0].block.proj.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    sharded = sharding.shard_blocks(
        model, gloo_group["data_parallel"], ("Block",), sharding.shard_options("bf16-mixed", False)
    )
    units = list(sharded.layers)
    assert all(type(u).__name__.endswith("CheckpointedBlock") for u in units) and units == sharding.units_of(
        model, ("Block",)
    )
    assert all(
        isinstance(p, DTensor) and p.dtype == torch.float32 for p in sharded.parameters()
    )  # fp32 shards
    states = [u._get_fsdp_state() for u in units]
    for state, after in zip(states, states[1:], strict=False):
        assert state._states_to_forward_prefetch == [after] and after._states_to_backward_prefetch == [state]
    groups = [s._fsdp_param_group for s in states]
    assert [g.post_forward_mesh_info is None for g in groups] == [False, False, True]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = sharded(torch.randn(4, 8)).float().sum()
    loss.backward()
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in sharded.parameters())

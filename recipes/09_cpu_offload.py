"""Rung 09 - offload to the CPU: rung 08 (FSDP2) with the shards in host memory and Adam on the CPU.

CPUOffloadPolicy keeps each rank's shard of parameters, gradients and Adam state in pinned host memory,
copied in before a block's all-gather and out after its reduce-scatter; Adam steps on the CPU.
The sharding and the offload policy: recipes/09_cpu_offload.py: parallelize; each process's own host cores:
fabric_memory_recipes/training/host_cores.py: share_out."""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130

import lightning as L
import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from fabric_memory_recipes import RunConfig, planning
from fabric_memory_recipes.training.techniques import attention
from fabric_memory_recipes.training import data, host_cores, lifecycle, loop, models

RUNG = RunConfig(
    recipe="09_cpu_offload",
    precision="32-true",
    batch_size=64,  # per GPU: every process trains on its own shard of the data
    devices=4,  # rung 08: 4 processes, each holding a shard of every parameter, gradient and Adam state
    sharding="fsdp2",  # rung 08, for the estimate: one FSDP unit and one checkpoint per block
    shard_units=("EncoderBlock",),
    activation_checkpointing=("EncoderBlock",),
    fused_attention=True,  # rung 15's attention: one qkv Linear + scaled_dot_product_attention
    cpu_offload=True,  # rung 09, for the estimate: sharded state in host memory
)


def parallelize(model, device_mesh, compile_blocks: bool = False):
    """Fabric calls it in setup_module: checkpoint, then shard each block (the last stays gathered)."""
    shard = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())}  # rung 09: on the host
    mesh, layers = device_mesh["data_parallel"], model.encoder.layers
    for i, block in enumerate(layers):
        layers[i] = block = checkpoint_wrapper(block)  # keep the block input, recompute inside
        if compile_blocks:  # fast mode: one compiled graph shared by every block
            block.compile()
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(layers) - 1, **shard)  # rung 08: a unit
    for block, after in zip(layers, layers[1:], strict=False):  # all-gather the next block ahead of use
        block.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([block])
    return fully_shard(model, mesh=mesh, **shard)  # the root: patch embedding, class token, final norm, head


def main(cfg: RunConfig, results) -> None:
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")  # "high" = TF32 matmuls
    strategy = ModelParallelStrategy(  # rung 08: every process holds a shard (data parallel only)
        lambda model, mesh: parallelize(model, mesh, cfg.compile), cfg.world_size, tensor_parallel_size=1
    )
    fabric = L.Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
                      strategy=strategy, precision=cfg.precision, loggers=results.fabric_loggers())  # fmt: skip
    fabric.launch()  # then each process binds to its own cores, where its Adam steps (rung 09)
    results.extra.update(host_cores=host_cores.share_out(fabric.local_rank, cfg.devices))
    fabric.seed_everything(cfg.seed, verbose=False)  # the seed is in the results JSON
    results.attach(fabric)
    with fabric.rank_zero_first():
        splits = data.load(cfg.data, cfg.data_dir)
    weights = models.resolve_weights(cfg.model, cfg.weights)
    results.set(data_source=splits.source, weights="pretrained" if weights else "random")
    with results.phase("model_load"):
        model = models.build_model(cfg.model, weights, data.NUM_CLASSES, cfg.image_size)
        attention.fuse_attention(model)  # rung 15: the same weights, one qkv Linear + SDPA per block
        planning.instrument(results, model, cfg)  # records the estimate and the model's size
        image_size = model.image_size
        model = fabric.setup_module(model)  # rung 08: shard first, then build the optimizer over the shards
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True))
    loaders = data.loaders(splits, cfg, fabric, shard=True)  # rung 08: every rank reads its own shard
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    batch_fn = data.image_classification(image_size)
    with results.phase("train"):
        loop.fit(fabric, model, optimizer, train_loader, batch_fn, cfg, results)
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches)


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

"""Rung 08 - shard across GPUs: rung 01's fp32 baseline (batch 64 per GPU, Adam) trained with FSDP.

FSDP (fully sharded data parallel) keeps 1/N of every parameter, gradient and Adam state on each of
the N GPUs. Each EncoderBlock is its own FSDP unit: its full weights are all-gathered just before it
runs and freed right after, so one block's weights at a time exist in full. Activation checkpointing
per EncoderBlock keeps only each block's input during the forward pass and recomputes the inside of
the block during the backward pass. Each GPU trains on its own shard of the data (batch 64 per GPU).

    python recipes/08_fsdp.py --devices 4                   # launches its 4 processes itself
    fabric run --accelerator cuda --devices 4 recipes/08_fsdp.py   # or let a launcher start them
    torchrun --nproc-per-node 4 recipes/08_fsdp.py --devices 4
The strategy: recipes/08_fsdp.py: make_strategy."""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import lightning as L
import torch
from lightning.fabric.strategies import FSDPStrategy
from torchvision.models.vision_transformer import EncoderBlock

from fabric_memory_recipes import planning
from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.training.techniques import attention
from fabric_memory_recipes.training import data, lifecycle, loop, models

RUNG = RunConfig(
    recipe="08_fsdp",
    precision="32-true",
    batch_size=64,  # per GPU: every process trains on its own shard of the data
    devices=4,  # rung 08: 4 processes, each holding a shard of every parameter, gradient and Adam state
    compile=False,
    cuda_graphs=False,  # sharded steps run eagerly
    sharding="fsdp",  # rung 08, for the estimate: one FSDP unit and one checkpoint per block
    shard_units=("EncoderBlock",),
    activation_checkpointing=("EncoderBlock",),
    cpu_variant="08_fsdp2",  # FSDPStrategy refuses the CPU; 08_fsdp2 runs the same sharding there
    fused_attention=True,  # rung 15's attention: one qkv Linear + scaled_dot_product_attention
)


def make_strategy(cfg: RunConfig) -> FSDPStrategy:
    return FSDPStrategy(
        auto_wrap_policy={EncoderBlock},  # rung 08: each transformer block is one FSDP unit, gathered on use
        activation_checkpointing_policy={EncoderBlock},  # keep block inputs, recompute the rest in backward
        cpu_offload=False,
    )


def main(cfg: RunConfig, results) -> None:
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")  # "high" = TF32 matmuls
    fabric = L.Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
                      strategy=make_strategy(cfg),  # rung 08: the model sharded over the processes
                      precision=cfg.precision, loggers=results.fabric_loggers())  # fmt: skip
    fabric.launch()
    fabric.seed_everything(cfg.seed, verbose=False)  # the seed is in the results JSON
    results.attach(fabric)
    with fabric.rank_zero_first():
        splits = data.load(cfg.data, cfg.data_dir)
    weights = models.resolve_weights(cfg.model, cfg.weights)
    results.set(data_source=splits.source, weights="pretrained" if weights else "random")

    with results.phase("model_load"):
        model = models.build_model(cfg.model, weights, data.NUM_CLASSES, cfg.image_size)
        attention.fuse_attention(model)  # rung 15: the same weights, one qkv Linear + SDPA per block
        models.compile_blocks(model, cfg.compile)  # --compile only (fast mode leaves rung 08 eager)
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

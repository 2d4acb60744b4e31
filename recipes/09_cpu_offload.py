"""Rung 09 - offload to the CPU: rung 08 with FSDP's cpu_offload=True.

The sharded parameters and their gradients live in host memory. Before a block runs, its shard is
copied to the GPU and all-gathered; gradients are copied back to the host after the backward pass,
and the optimizer (Adam, fused CPU kernel) updates the parameters on the CPU. GPU memory then holds
little more than the activations and one block's gathered weights, paid for with PCIe traffic and a
CPU optimizer step.

    python recipes/09_cpu_offload.py --devices 4
    torchrun --nproc-per-node 4 recipes/09_cpu_offload.py --devices 4
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import lightning as L
import torch
from lightning.fabric.strategies import FSDPStrategy
from torchvision.models.vision_transformer import EncoderBlock

from fabric_memory_recipes import planning
from fabric_memory_recipes.config import RunConfig, UsageError
from fabric_memory_recipes.training import data, lifecycle, loop, models

RUNG = RunConfig(
    recipe="09_cpu_offload",
    precision="32-true",
    batch_size=64,  # per GPU: every process trains on its own shard of the data
    devices=4,  # rung 08: 4 processes, each holding a shard of every parameter, gradient and Adam state
    compile=False,
    cuda_graphs=False,  # sharded steps run eagerly
    sharding="fsdp",  # rung 08, for the estimate: one FSDP unit and one checkpoint per block
    shard_units=("EncoderBlock",),
    checkpoint=("EncoderBlock",),
    cpu_offload=True,  # rung 09, for the estimate: sharded state in host memory
    cpu_variant="08_fsdp2",  # FSDPStrategy refuses the CPU; 08_fsdp2 runs the same sharding there
)


def make_strategy(cfg: RunConfig) -> FSDPStrategy:
    return FSDPStrategy(
        auto_wrap_policy={EncoderBlock},  # rung 08: each transformer block is one FSDP unit, gathered on use
        activation_checkpointing_policy={EncoderBlock},  # keep block inputs, recompute the rest in backward
        cpu_offload=True,  # rung 09: shards of parameters and gradients in CPU memory; Adam steps on the CPU
    )


def main(cfg: RunConfig, results) -> None:
    if cfg.compile:
        raise UsageError("--compile is not supported with FSDP1 here; recipes/08_fsdp2.py supports it")
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
        results.estimate = planning.for_run(model, cfg)  # the predicted peak
        image_size, parameters = model.image_size, models.count_parameters(model)
        model = fabric.setup_module(model)  # rung 08: shard first, then build the optimizer over the shards
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True))
    results.set(parameters=parameters)

    loaders = data.loaders(splits, cfg, fabric, shard=True)  # rung 08: every rank reads its own shard
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    batch_fn = data.image_classification(image_size)
    with results.phase("train"):
        loop.fit(fabric, model, optimizer, train_loader, batch_fn, cfg, results)
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches)


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

"""Rung 08, FSDP2 variant: the same sharding and checkpointing as rung 08, with PyTorch's fully_shard.

FSDP2 (torch.distributed.fsdp.fully_shard) shards each parameter as a DTensor along dim 0 instead of
flattening a unit's parameters into one buffer (FSDP1). Parameters keep their names and shapes, the
optimizer sees ordinary (distributed) tensors, and memory is freed more predictably. Fabric drives it
through ModelParallelStrategy with a parallelize function: wrap each EncoderBlock in activation
checkpointing, shard each block as its own unit, then shard the root (patch embedding, class token,
head). This path also runs on CPU with the gloo backend (the tests use 2 processes).

    python recipes/08_fsdp2.py --devices 4
    torchrun --nproc-per-node 4 recipes/08_fsdp2.py --devices 4
    python recipes/08_fsdp2.py --accelerator cpu --devices 2 --model vit_tiny --max-steps 5
"""

import functools

import lightning as L
import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard

from common import cli, data, estimate, loop, models

RECIPE = "08_fsdp2"
DEFAULTS = dict(precision="32-true", batch_size=64, accumulation_steps=1, lr=5e-5, devices=4, compile=False)
ESTIMATE = dict(  # for common.estimate: FSDP, one unit and one checkpoint per block
    optimizer="adam", sharding="fsdp2", shard_units=("EncoderBlock",), checkpoint=("EncoderBlock",)
)


def parallelize(model, device_mesh, compile_blocks: bool = False):
    """Called by Fabric in setup_module: checkpoint and shard block by block, then the root."""
    mesh = device_mesh["data_parallel"]
    layers = model.encoder.layers
    for i, block in enumerate(layers):
        layers[i] = checkpoint_wrapper(block)  # save the block input only, recompute inside in backward
        if compile_blocks:  # one compiled graph shared by every block
            layers[i].compile()
        fully_shard(layers[i], mesh=mesh)  # one unit: all-gathered before the block runs, freed after
    fully_shard(model, mesh=mesh)  # patch embedding, class token, final norm and head
    return model


def make_strategy(args) -> ModelParallelStrategy:
    world = args.devices * args.num_nodes
    return ModelParallelStrategy(
        parallelize_fn=functools.partial(parallelize, compile_blocks=args.compile),
        data_parallel_size=world,  # every process holds a shard: pure data-parallel sharding (no tensor parallel)
        tensor_parallel_size=1,
    )


def main(args, log):
    torch.set_float32_matmul_precision("high" if args.tf32 else "highest")  # "high" = TF32 matmuls
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=make_strategy(args),
        precision=args.precision,
        loggers=log.fabric_loggers(),
    )
    fabric.launch()
    fabric.seed_everything(args.seed, verbose=False)  # the seed is in the results JSON
    log.attach(fabric)

    with fabric.rank_zero_first():
        splits = data.load(args.data, args.data_dir)
    weights = models.resolve_weights(args.model, args.weights)
    log.set(data_source=splits.source, weights="pretrained" if weights else "random")

    with log.phase("model_load"):
        model = models.build_model(args.model, weights, num_classes=data.NUM_CLASSES)
        log.estimate = estimate.for_run(model, args, **ESTIMATE)  # the predicted peak
        image_size, parameters = model.image_size, models.count_parameters(model)
        model = fabric.setup_module(model)  # shard first, then build the optimizer over the shards
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
        optimizer = fabric.setup_optimizers(optimizer)
    log.set(parameters=parameters)

    pin = fabric.device.type == "cuda"
    loaders = data.loaders(
        splits,
        args.micro_batch_size,
        args.micro_batch_size,
        args.num_workers,
        pin,
        world_size=fabric.world_size,
        rank=fabric.global_rank,
        seed=args.seed,
    )
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    batch_fn = loop.image_classification(image_size)

    with log.phase("train"):
        loop.fit(
            fabric,
            model,
            optimizer,
            train_loader,
            log,
            batch_fn,
            accumulation_steps=args.accumulation_steps,
            epochs=args.epochs,
            max_steps=args.max_steps,
            log_every=args.log_every,
            **cli.checkpointing(args),
        )
    with log.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, log, args.eval_batches)


if __name__ == "__main__":
    raise SystemExit(cli.run(main, recipe=RECIPE, description=__doc__, defaults=DEFAULTS))

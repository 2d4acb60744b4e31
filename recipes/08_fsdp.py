"""Rung 08 - shard across GPUs: rung 01's fp32 baseline (batch 64 per GPU, Adam) trained with FSDP.

FSDP (fully sharded data parallel) keeps 1/N of every parameter, gradient and Adam state on each of
the N GPUs. Each EncoderBlock is its own FSDP unit: its full weights are all-gathered just before it
runs and freed right after, so one block's weights at a time exist in full. Activation checkpointing
per EncoderBlock keeps only each block's input during the forward pass and recomputes the inside of
the block during the backward pass. Each GPU trains on its own shard of the data (batch 64 per GPU).

    python recipes/08_fsdp.py --devices 4                   # launches its 4 processes itself
    fabric run --accelerator cuda --devices 4 recipes/08_fsdp.py   # or let a launcher start them
    torchrun --nproc-per-node 4 recipes/08_fsdp.py --devices 4
"""

import lightning as L
import torch
from lightning.fabric.strategies import FSDPStrategy
from torchvision.models.vision_transformer import EncoderBlock

from common import cli, data, estimate, loop, models

RECIPE = "08_fsdp"
DEFAULTS = dict(precision="32-true", batch_size=64, accumulation_steps=1, lr=5e-5, devices=4, compile=False)
ESTIMATE = dict(  # for common.estimate: FSDP, one unit and one checkpoint per block
    optimizer="adam", sharding="fsdp", shard_units=("EncoderBlock",), checkpoint=("EncoderBlock",)
)


def make_strategy(args) -> FSDPStrategy:
    return FSDPStrategy(
        auto_wrap_policy={EncoderBlock},  # each transformer block is one FSDP unit: sharded, gathered on use
        activation_checkpointing_policy={EncoderBlock},  # keep block inputs, recompute the rest in backward
        cpu_offload=False,
    )


def main(args, log):
    if args.accelerator != "cuda":
        raise cli.UsageError(
            "FSDPStrategy needs CUDA GPUs; on CPU, recipes/08_fsdp2.py runs the same sharding"
        )
    if args.compile:
        raise cli.UsageError("--compile is not supported with FSDP1 here; recipes/08_fsdp2.py supports it")
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
    raise SystemExit(
        cli.run(main, recipe=RECIPE, description=__doc__, defaults=DEFAULTS, cpu_variant="08_fsdp2")
    )

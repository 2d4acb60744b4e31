"""Rung 13 - 8-bit optimizer state: rung 07 with Adam back, its two moments stored in 8 bits (torchao).

Rung 06 dropped Adam to save its state: two tensors per parameter, 1.21 GB in bf16 for ViT-L/16.
torchao's AdamW8bit keeps both moments block-wise quantised to 8 bits (plus one scale per block),
a quarter of fp32 state and half of bf16 state, and dequantises them inside the update. Adam's
convergence, at 0.61 GB of state. Needs torchao (`pip install -e ".[lowbit]"`).
"""

import lightning as L
import torch

from common import bf16, cli, data, estimate, loop, models

RECIPE = "13_lowbit_optimizer"
DEFAULTS = dict(precision="bf16-true", batch_size=16, accumulation_steps=4, lr=5e-5)
ESTIMATE = dict(optimizer="adamw8bit")  # for common.estimate: 8-bit moments


def main(args, log):
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        raise cli.UsageError('this rung needs torchao: python3 -m pip install -e ".[lowbit]"') from None
    torch.set_float32_matmul_precision("high" if args.tf32 else "highest")  # "high" = TF32 matmuls
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
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
        with fabric.init_module(empty_init=False):  # allocated on the device, in the target precision
            model = models.build_model(args.model, weights, num_classes=data.NUM_CLASSES)
        if args.compile:  # one compiled graph per block (all 24 share it): fewer, fused kernel launches
            for block in models.blocks(model):
                block.compile()
        # both Adam moments in 8 bits, block-wise scaled
        optimizer = AdamW8bit(model.parameters(), lr=args.lr)
        log.estimate = estimate.for_run(model, args, **ESTIMATE)  # the predicted peak
        optimizer = bf16.updates(optimizer, args, log)  # --bf16-update, --lost-updates (common/bf16.py)
        model, optimizer = fabric.setup(model, optimizer)
    log.set(parameters=models.count_parameters(model))
    pin = fabric.device.type == "cuda"
    loaders = data.loaders(splits, args.micro_batch_size, args.micro_batch_size, args.num_workers, pin)
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    batch_fn = loop.image_classification(model.image_size)
    num_steps = loop.planned_steps(len(train_loader), args.accumulation_steps, args.epochs, args.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=num_steps)

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
            scheduler=scheduler,
            log_every=args.log_every,
            cuda_graphs=args.cuda_graphs,  # fast mode: each optimizer step one CUDA graph
            **cli.checkpointing(args),
        )
    with log.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, log, args.eval_batches)


if __name__ == "__main__":
    raise SystemExit(cli.run(main, recipe=RECIPE, description=__doc__, defaults=DEFAULTS))

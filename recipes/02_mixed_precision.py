"""Rung 02 - mixed precision: rung 01 with precision="16-mixed".

Weights, gradients and Adam's state stay fp32; under autocast the matrix products run in fp16 and most
saved activations are fp16, roughly halving activation memory and using the fp16 tensor cores. A loss
scaler keeps small fp16 gradients from underflowing. --precision bf16-mixed needs no scaler.
"""

import lightning as L
import torch

from common import bf16, cli, data, estimate, loop, models

RECIPE = "02_mixed_precision"
DEFAULTS = dict(precision="16-mixed", batch_size=64, accumulation_steps=1, lr=5e-5)
ESTIMATE = dict(optimizer="adam")  # for common.estimate: what the flags do not say (fused Adam)


def main(args, log):
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
        model = models.build_model(args.model, weights, num_classes=data.NUM_CLASSES)
        if args.compile:  # one compiled graph per block (all 24 share it): fewer, fused kernel launches
            for block in models.blocks(model):
                block.compile()
        # fused: the whole update in one kernel, no temporary copies of the parameters
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
        log.estimate = estimate.for_run(model, args, **ESTIMATE)  # the predicted peak
        optimizer = bf16.updates(optimizer, args, log)  # --bf16-update, --lost-updates (common/bf16.py)
        model, optimizer = fabric.setup(model, optimizer)
    log.set(parameters=models.count_parameters(model))

    pin = fabric.device.type == "cuda"
    loaders = data.loaders(splits, args.micro_batch_size, args.micro_batch_size, args.num_workers, pin)
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    batch_fn = loop.image_classification(model.image_size)

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
            cuda_graphs=args.cuda_graphs,  # fast mode: each optimizer step one CUDA graph
            **cli.checkpointing(args),
        )
    with log.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, log, args.eval_batches)


if __name__ == "__main__":
    raise SystemExit(cli.run(main, recipe=RECIPE, description=__doc__, defaults=DEFAULTS))

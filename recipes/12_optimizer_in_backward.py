"""Rung 12 - the optimizer step fused into backward: rung 07 without a full set of gradients, ever.

Each parameter gets its own SGD optimizer, and a post-accumulate-grad hook steps it the moment that
parameter's gradient is complete during the backward pass, then frees the gradient. Gradients for the
whole model (0.61 GB in bf16 for ViT-L/16) never exist at the same time: at most a few layers' worth.
This cannot be combined with gradient accumulation: accumulating means keeping every gradient until
the k-th micro-batch, which is exactly what this removes. So the batch here is the micro-batch, 4, with
no accumulation (--accumulation-steps > 1 is refused).
"""

import lightning as L
import torch

from common import bf16, cli, data, estimate, loop, models

RECIPE = "12_optimizer_in_backward"
DEFAULTS = dict(precision="bf16-true", batch_size=4, accumulation_steps=1, lr=0.01)
ESTIMATE = dict(optimizer="sgd", optimizer_impl="fused", optimizer_in_backward=True)


def main(args, log):
    if args.accumulation_steps != 1:
        raise cli.UsageError(
            "--accumulation-steps must be 1: stepping in backward frees each gradient at once, "
            "and accumulation needs every gradient kept until the last micro-batch"
        )
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
        log.estimate = estimate.for_run(model, args, **ESTIMATE)  # the predicted peak
        model = fabric.setup(model)
        # One optimizer per parameter, stepped by a hook as soon as that parameter's gradient is ready.
        optimizers = {p: torch.optim.SGD([p], lr=args.lr, fused=True) for p in model.parameters()}

        def step_in_backward(param):
            optimizers[param].step()
            optimizers[param].zero_grad(set_to_none=True)  # the gradient is freed right away

        optimizers = bf16.updates(optimizers, args, log)  # --bf16-update, --lost-updates (common/bf16.py)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_in_backward)
    log.set(parameters=models.count_parameters(model))
    pin = fabric.device.type == "cuda"
    loaders = data.loaders(splits, args.micro_batch_size, args.micro_batch_size, args.num_workers, pin)
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    batch_fn = loop.image_classification(model.image_size)
    num_steps = loop.planned_steps(len(train_loader), args.accumulation_steps, args.epochs, args.max_steps)
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=num_steps) for o in optimizers.values()]
    scheduler = loop.SchedulerGroup(schedulers)  # the loop steps it once per optimizer step

    with log.phase("train"):
        loop.fit(
            fabric,
            model,
            None,  # no optimizer for the loop to step: the hooks did it during backward
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

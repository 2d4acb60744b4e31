"""Rung 11 - activation offloading: rung 07 with the tensors saved for backward kept in host memory.

Inside common.offload.offload_activations(), every activation autograd saves during the forward pass
is copied into pinned CPU memory (non-blocking, on the compute stream) and its GPU copy is released;
the backward pass copies each one back just before it is needed. Weights are not copied: they stay on
the GPU anyway. GPU memory for activations drops to what is in flight; the price is PCIe traffic of
every saved activation, twice.
"""

import lightning as L
import torch

from common import bf16, cli, data, estimate, loop, models, offload

RECIPE = "11_activation_offload"
DEFAULTS = dict(precision="bf16-true", batch_size=16, accumulation_steps=4, lr=0.01)
ESTIMATE = dict(optimizer="sgd", optimizer_impl="fused", activation_offload=True)


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
        with fabric.init_module(empty_init=False):  # allocated on the device, in the target precision
            model = models.build_model(args.model, weights, num_classes=data.NUM_CLASSES)
        if args.compile:  # one compiled graph per block (all 24 share it): fewer, fused kernel launches
            for block in models.blocks(model):
                block.compile()
        # plain SGD keeps no state (Adam kept two extra tensors per parameter); fused: one kernel
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, fused=True)
        log.estimate = estimate.for_run(model, args, **ESTIMATE)  # the predicted peak
        optimizer = bf16.updates(optimizer, args, log)  # --bf16-update, --lost-updates (common/bf16.py)
        model, optimizer = fabric.setup(model, optimizer)
    log.set(parameters=models.count_parameters(model))
    pin = fabric.device.type == "cuda"
    loaders = data.loaders(splits, args.micro_batch_size, args.micro_batch_size, args.num_workers, pin)
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    image_batch = loop.image_classification(model.image_size)
    offloaded = offload.offload_activations()  # one set of pinned host buffers, reused every micro-batch

    def batch_fn(model, batch):
        with offloaded:  # saved activations go to pinned host memory
            return image_batch(model, batch)

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
    log.extra["offloaded_gb_per_micro_batch"] = offloaded.host_bytes() / 1e9  # to host memory and back
    with log.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, log, args.eval_batches)


if __name__ == "__main__":
    raise SystemExit(cli.run(main, recipe=RECIPE, description=__doc__, defaults=DEFAULTS))

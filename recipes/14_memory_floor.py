"""Rung 14 - the memory floor: everything that lowers memory, combined, still a full fine-tune that learns.

- bf16-true weights built in place with fabric.init_module (rungs 03, 07): 0.61 GB for ViT-L/16;
- plain SGD, no optimizer state (rung 06);
- the optimizer step fused into backward, so gradients never exist all at once (rung 12);
- every EncoderBlock checkpointed: only block inputs are kept in forward (rung 10);
- what autograd still saves outside the checkpoints goes to pinned host memory (rung 11);
- micro-batch 4 (rung 05), no accumulation (it would need the gradients rung 12 removes);
- the caching allocator in expandable-segments mode, so reserved memory tracks allocated memory
  instead of rounding up to fixed-size segments.
What is left on the GPU is the weights (0.61 GB) plus about 0.1 GB in flight (measured: 0.72 GB peak).
"""

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # must be set before CUDA starts

import lightning as L
import torch

from common import bf16, cli, data, estimate, loop, models, offload

RECIPE = "14_memory_floor"
DEFAULTS = dict(precision="bf16-true", batch_size=4, accumulation_steps=1, lr=0.01)
ESTIMATE = dict(  # for common.estimate: what the flags do not say
    optimizer="sgd",
    optimizer_impl="fused",
    optimizer_in_backward=True,
    activation_offload=True,
    checkpoint=("EncoderBlock",),
)


def main(args, log):
    if args.accumulation_steps != 1:
        raise cli.UsageError(
            "--accumulation-steps must be 1: the optimizer steps inside backward (see rung 12)"
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
        # keep each block's input, recompute the rest in backward
        for i, block in enumerate(models.blocks(model)):
            model.encoder.layers[i] = models.CheckpointedBlock(block)
        log.estimate = estimate.for_run(model, args, **ESTIMATE)  # the predicted peak
        model = fabric.setup(model)
        # One stateless SGD per parameter, stepped by a hook as soon as that parameter's gradient is ready.
        optimizers = {p: torch.optim.SGD([p], lr=args.lr, fused=True) for p in model.parameters()}

        def step_in_backward(param):
            optimizers[param].step()
            optimizers[param].zero_grad(set_to_none=True)

        optimizers = bf16.updates(optimizers, args, log)  # --bf16-update, --lost-updates (common/bf16.py)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_in_backward)
    log.set(parameters=models.count_parameters(model))
    pin = fabric.device.type == "cuda"
    loaders = data.loaders(splits, args.micro_batch_size, args.micro_batch_size, args.num_workers, pin)
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    image_batch = loop.image_classification(model.image_size)
    offloaded = offload.offload_activations()  # one set of pinned host buffers, reused every micro-batch

    def batch_fn(model, batch):
        with offloaded:  # what the checkpoints still save goes to host memory
            return image_batch(model, batch)

    num_steps = loop.planned_steps(len(train_loader), args.accumulation_steps, args.epochs, args.max_steps)
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=num_steps) for o in optimizers.values()]
    scheduler = loop.SchedulerGroup(schedulers)

    with log.phase("train"):
        loop.fit(
            fabric,
            model,
            None,  # the hooks step the parameters during backward
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

"""Rung 15 - the speed rung: the fastest way this project trains ViT-L/16 on one GPU.

Memory is not the goal here; throughput is, with the same model, data and update rule (Adam):
- bf16-true: half the bytes moved, bf16 tensor cores (rung 03);
- the model built on the GPU with fabric.init_module (rung 07);
- fused Adam: the whole update in one kernel;
- torch.compile of the whole model: fused elementwise kernels around the matrix products, far fewer
  launches;
- uint8 images resized on the GPU (common/data.py), so the input pipeline never waits on the CPU;
- a large batch (256): bigger matrix products keep the tensor cores busier and the optimizer step is
  paid once per 256 images. Try --batch-size 64/128 to see what it buys.
The recipe reports model FLOPs utilisation (MFU): the model's FLOPs per step, counted by
torch.utils.flop_counter, over the measured step time, against the GPU's datasheet bf16 peak.
"""

import lightning as L
import torch

from common import bf16, cli, data, estimate, loop, metrics, models

RECIPE = "15_speed"
DEFAULTS = dict(precision="bf16-true", batch_size=256, accumulation_steps=1, lr=5e-5)
ESTIMATE = dict(optimizer="adam")  # for common.estimate: fused Adam (the eager graph is traced)


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
        with fabric.init_module(empty_init=False):
            model = models.build_model(args.model, weights, num_classes=data.NUM_CLASSES)
            log.estimate = estimate.for_run(model, args, **ESTIMATE)  # the predicted peak
        image_size = model.image_size
        if args.compile:  # the whole model as one graph (forward and backward each)
            model = torch.compile(model)
        # fused: the whole update in one kernel, no temporary copies of the parameters
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
        optimizer = bf16.updates(optimizer, args, log)  # --bf16-update, --lost-updates (common/bf16.py)
        model, optimizer = fabric.setup(model, optimizer)
    log.set(parameters=models.count_parameters(model))

    pin = fabric.device.type == "cuda"
    loaders = data.loaders(splits, args.micro_batch_size, args.micro_batch_size, args.num_workers, pin)
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
            cuda_graphs=args.cuda_graphs,  # fast mode: each optimizer step one CUDA graph
            **cli.checkpointing(args),
        )
    flops_per_step = models.training_flops(args.model, args.micro_batch_size) * args.accumulation_steps
    median, peak = log.median_step_s(), metrics.peak_bf16_flops(log.gpu_name())
    log.extra["model_flops_per_step"] = flops_per_step
    log.extra["achieved_tflops"] = flops_per_step / median / 1e12 if median else None
    log.extra["mfu"] = flops_per_step / median / peak if median and peak else None
    log.extra["mfu_peak_tflops"] = peak / 1e12 if peak else None
    with log.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, log, args.eval_batches)


if __name__ == "__main__":
    raise SystemExit(cli.run(main, recipe=RECIPE, description=__doc__, defaults=DEFAULTS))

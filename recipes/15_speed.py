"""Rung 15 - the speed rung: the fastest way this project trains ViT-L/16 on one GPU.

Memory is not the goal here; throughput is, with the same model, data and update rule (Adam):
- bf16-true: half the bytes moved, bf16 tensor cores (rung 03);
- the model built on the GPU with fabric.init_module (rung 07);
- fused Adam: the whole update in one kernel;
- torch.compile of the whole model: fused elementwise kernels around the matrix products, far fewer
  launches;
- uint8 images resized on the GPU (fabric_memory_recipes/training/data.py), so the input pipeline never waits on the CPU;
- a large batch (256): bigger matrix products keep the tensor cores busier and the optimizer step is
  paid once per 256 images. Try --batch-size 64/128 to see what it buys.
The recipe reports model FLOPs utilisation (MFU): the model's FLOPs per step, counted by
torch.utils.flop_counter, over the measured step time, against the GPU's datasheet bf16 peak.
"""

import lightning as L
import torch

from fabric_memory_recipes import RunConfig, planning
from fabric_memory_recipes.measurement import results_file
from fabric_memory_recipes.training import bf16, data, lifecycle, loop, models

RUNG = RunConfig(
    recipe="15_speed",
    precision="bf16-true",  # rung 03: half the bytes moved, bf16 tensor cores
    batch_size=256,  # rung 15: bigger matrix products, the optimizer step paid once per 256 images
    accumulation_steps=1,
    lr=5e-5,
    optimizer="adam",  # for the estimate: what the code below builds (fused Adam, two moments)
)


def main(cfg: RunConfig, results) -> None:
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")  # "high" = TF32 matmuls
    fabric = L.Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
                      precision=cfg.precision, loggers=results.fabric_loggers())  # fmt: skip
    fabric.launch()
    fabric.seed_everything(cfg.seed, verbose=False)  # the seed is in the results JSON
    results.attach(fabric)

    with fabric.rank_zero_first():
        splits = data.load(cfg.data, cfg.data_dir)
    weights = models.resolve_weights(cfg.model, cfg.weights)
    results.set(data_source=splits.source, weights="pretrained" if weights else "random")

    with results.phase("model_load"):
        with fabric.init_module(empty_init=False):  # rung 07: allocated on the device, in bf16
            model = models.build_model(cfg.model, weights, data.NUM_CLASSES, cfg.image_size)
            results.estimate = planning.for_run(model, cfg)  # the predicted peak
        image_size = model.image_size
        if cfg.compile:  # rung 15: the whole model as one graph (forward and backward each)
            model = torch.compile(model)
        # fused: the whole update in one kernel, no temporary copies of the parameters
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True)
        optimizer = bf16.updates(optimizer, cfg, results)  # --bf16-update, --lost-updates (training/bf16.py)
        model, optimizer = fabric.setup(model, optimizer)
    results.set(parameters=models.count_parameters(model))

    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*data.loaders(splits, cfg, fabric))
    batch_fn = data.image_classification(image_size)

    with results.phase("train"):
        loop.fit(fabric, model, optimizer, train_loader, batch_fn, cfg, results)
    # rung 15: model FLOPs utilisation, the step's model FLOPs over its time against the datasheet peak
    flops_per_step = models.training_flops(cfg.model, cfg.micro_batch_size) * cfg.accumulation_steps
    median, peak = results.median_step_s(), results_file.peak_bf16_flops(results.gpu_name())
    results.extra["model_flops_per_step"] = flops_per_step
    results.extra["achieved_tflops"] = flops_per_step / median / 1e12 if median else None
    results.extra["mfu"] = flops_per_step / median / peak if median and peak else None
    results.extra["mfu_peak_tflops"] = peak / 1e12 if peak else None
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches)


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

"""Rung 07 - create the model where it will live: rung 06 with the model built inside fabric.init_module().

The usual way builds the model in fp32 on the CPU, then moves it to the GPU and casts it: the GPU
briefly holds the fp32 copy (2x the bf16 bytes) and the CPU holds it too. Inside fabric.init_module()
parameters are allocated on the GPU directly in the target precision. The recipe measures the
model-load peak both ways (phases "load_cpu_then_move" and "model_load") and then trains as rung 06.
empty_init stays False: torchvision's ViT attention weights have no reset_parameters, so skipping
initialisation leaves garbage in them (loss becomes NaN) unless real weights are loaded afterwards.
The model built inside it: fabric_memory_recipes/training/models.py: build_model."""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import lightning as L
import torch

from fabric_memory_recipes import RunConfig, planning
from fabric_memory_recipes.training.techniques import bf16
from fabric_memory_recipes.training import data, lifecycle, loop, models

RUNG = RunConfig(
    recipe="07_init_module",
    precision="bf16-true",  # rung 03: weights, gradients, Adam state and activations all in bfloat16
    bf16_update="stochastic",  # bf16 updates rounded at random: kept on average (docs/bf16_updates.md)
    batch_size=16,  # rung 04: a quarter of the activations
    accumulation_steps=4,  # rung 05: 4 micro-batches of 4; the loop's "rung 05" blocks group them
    lr=0.01,
    optimizer="sgd",  # rung 06: SGD keeps no state (declared for the planner)
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

    # rung 07, for comparison, the usual way: build in fp32 on the CPU, move to the device, then cast.
    dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(cfg.precision, torch.float32)
    with results.phase("load_cpu_then_move"):
        usual = models.build_model(cfg.model, weights, data.NUM_CLASSES, cfg.image_size)  # fp32, on the CPU
        usual = usual.to(fabric.device).to(dtype)  # moved (in place) and cast
    del usual
    if fabric.device.type == "cuda":
        torch.cuda.empty_cache()

    with results.phase("model_load"):
        with fabric.init_module(empty_init=False):  # rung 07: on the device, in the target dtype
            model = models.build_model(cfg.model, weights, data.NUM_CLASSES, cfg.image_size)
        models.compile_blocks(model, cfg.compile)  # fast mode: one compiled graph shared by every block
        # rung 06: plain SGD keeps no state (Adam kept two extra tensors per parameter); fused: one kernel
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, fused=True)
        planning.instrument(results, model, cfg, optimizer)  # records the estimate and the model's size
        optimizer = bf16.updates(optimizer, cfg, results)  # --bf16-update (training/techniques/bf16.py)
        model, optimizer = fabric.setup(model, optimizer)
    if fabric.device.type == "cuda":  # on CPU the phases hold process RSS, which cannot be reset
        usual_gb, init_gb = (
            results.phases[p]["allocated"] / 1e9 for p in ("load_cpu_then_move", "model_load")
        )
        results.extra["model_load_peak_allocated_gb"] = {"cpu_then_move": usual_gb, "init_module": init_gb,
                                                         "ratio": init_gb / usual_gb}  # fmt: skip

    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*data.loaders(splits, cfg, fabric))
    batch_fn = data.image_classification(model.image_size)
    num_steps = loop.planned_steps(len(train_loader), cfg.accumulation_steps, cfg.epochs, cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=num_steps)  # rung 06

    with results.phase("train"):  # the loop steps the schedule once per optimizer step ("rung 06" there)
        loop.fit(fabric, model, optimizer, train_loader, batch_fn, cfg, results, scheduler=scheduler)
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches)


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

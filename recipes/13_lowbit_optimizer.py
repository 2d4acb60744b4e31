"""Rung 13 - 8-bit optimizer state: rung 07 with Adam back, its two moments stored in 8 bits (torchao).

Rung 06 dropped Adam to save its state: two tensors per parameter, 1.21 GB in bf16 for ViT-L/16.
torchao's AdamW8bit keeps both moments block-wise quantised to 8 bits (plus one scale per block),
a quarter of fp32 state and half of bf16 state, and dequantises them inside the update. Adam's
convergence, at 0.61 GB of state. Needs torchao (`pip install -e ".[lowbit]"`). The optimizer is torchao's
(fabric_memory_recipes/training/techniques/lowbit.py: adamw8bit); it steps in
fabric_memory_recipes/training/step.py: train_step, and the planner reads its state size in
fabric_memory_recipes/planning/simulation/built.py: optimizer_technique.
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import lightning as L
import torch

from fabric_memory_recipes import planning
from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.training.techniques import bf16, lowbit
from fabric_memory_recipes.training import data, lifecycle, loop, models

RUNG = RunConfig(
    recipe="13_lowbit_optimizer",
    precision="bf16-true",  # rung 03: weights, gradients, Adam state and activations all in bfloat16
    bf16_update="stochastic",  # bf16 updates rounded at random: kept on average (docs/bf16_updates.md)
    batch_size=16,  # rung 04: a quarter of the activations
    accumulation_steps=4,  # rung 05: 4 micro-batches of 4; the loop's "rung 05" blocks group them
    lr=5e-5,
    optimizer="adamw8bit",  # rung 13: Adam's two moments in 8 bits (declared for the planner)
)


def main(cfg: RunConfig, results) -> None:
    AdamW8bit = lowbit.adamw8bit("rung 13")  # torchao's class: an optional dependency, asked for first
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
        with fabric.init_module(empty_init=False):  # rung 07: on the device, in the target dtype
            model = models.build_model(cfg.model, weights, data.NUM_CLASSES, cfg.image_size)
        models.compile_blocks(model, cfg.compile)  # fast mode: one compiled graph shared by every block
        optimizer = AdamW8bit(model.parameters(), lr=cfg.lr)  # rung 13: 8-bit moments, scaled per block
        planning.instrument(results, model, cfg, optimizer)  # records the estimate and the model's size
        optimizer = bf16.updates(optimizer, cfg, results)  # --bf16-update (training/techniques/bf16.py)
        model, optimizer = fabric.setup(model, optimizer)

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

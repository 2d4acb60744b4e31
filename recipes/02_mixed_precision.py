"""Rung 02 - mixed precision: rung 01 with precision="16-mixed".

Weights, gradients and Adam's state stay fp32; under autocast the matrix products run in fp16 and most
saved activations are fp16, roughly halving activation memory and using the fp16 tensor cores. A loss
scaler keeps small fp16 gradients from underflowing. --precision bf16-mixed needs no scaler.
Fabric scales the loss in fabric.backward, called in fabric_memory_recipes/training/step.py: train_step.
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import lightning as L
import torch

from fabric_memory_recipes import RunConfig, planning
from fabric_memory_recipes.training.techniques import bf16
from fabric_memory_recipes.training import data, lifecycle, loop, models

RUNG = RunConfig(
    recipe="02_mixed_precision",
    precision="16-mixed",  # rung 02: fp32 weights and state; autocast runs matmuls and activations in fp16
    batch_size=64,
    accumulation_steps=1,
    lr=5e-5,
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
        model = models.build_model(cfg.model, weights, data.NUM_CLASSES, cfg.image_size)
        models.compile_blocks(model, cfg.compile)  # fast mode: one compiled graph shared by every block
        # fused: the whole update in one kernel, no temporary copies of the parameters
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True)
        planning.instrument(results, model, cfg, optimizer)  # records the estimate and the model's size
        optimizer = bf16.updates(optimizer, cfg, results)  # --bf16-update (training/techniques/bf16.py)
        model, optimizer = fabric.setup(model, optimizer)

    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*data.loaders(splits, cfg, fabric))
    batch_fn = data.image_classification(model.image_size)

    with results.phase("train"):
        loop.fit(fabric, model, optimizer, train_loader, batch_fn, cfg, results)
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches)


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

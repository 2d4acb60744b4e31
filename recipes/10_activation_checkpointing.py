"""Rung 10 - activation checkpointing on one GPU: rung 07 with every EncoderBlock under torch.utils.checkpoint.

During the forward pass each block keeps only its input; the ~20 tensors it would save for backward
(LayerNorm inputs, the attention inputs and output, the MLP's 4x-wide hidden activations) are dropped
and recomputed block by block during the backward pass. Activation memory falls from "every block's
insides" to "every block's input + one block's insides", for about one extra forward pass of compute.
Non-reentrant checkpointing is the default; --reentrant selects the older implementation (see
docs/10_activation_checkpointing.md for what each saves). The wrapping:
fabric_memory_recipes/training/techniques/checkpointing.py: checkpoint_blocks (a CheckpointedBlock per block).
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
from dataclasses import dataclass

import lightning as L
import torch

from fabric_memory_recipes import planning
from fabric_memory_recipes.config import RunConfig, flag
from fabric_memory_recipes.training.techniques import bf16, checkpointing
from fabric_memory_recipes.training import data, lifecycle, loop, models


@dataclass
class CheckpointingConfig(RunConfig):  # rung 10's own flag
    reentrant: bool = flag(False, "training", "use_reentrant=True (the older checkpoint)", action="store_true")  # fmt: skip


RUNG = CheckpointingConfig(
    recipe="10_activation_checkpointing",
    precision="bf16-true",  # rung 03: weights, gradients, Adam state and activations all in bfloat16
    bf16_update="stochastic",  # bf16 updates rounded at random: kept on average (docs/bf16_updates.md)
    batch_size=16,  # rung 04: a quarter of the activations
    accumulation_steps=4,  # rung 05: 4 micro-batches of 4; the loop's "rung 05" blocks group them
    lr=0.01,
    optimizer="sgd",  # rung 06: SGD keeps no state (declared for the planner)
    activation_checkpointing=(
        "EncoderBlock",
    ),  # rung 10: every block checkpointed (declared for the planner)
)


def main(cfg: CheckpointingConfig, results) -> None:
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
        # rung 10: every EncoderBlock wrapped in a CheckpointedBlock, which keeps the block's input only
        checkpointing.checkpoint_blocks(model, ("EncoderBlock",), use_reentrant=cfg.reentrant)
        # rung 06: plain SGD keeps no state (Adam kept two extra tensors per parameter); fused: one kernel
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, fused=True)
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

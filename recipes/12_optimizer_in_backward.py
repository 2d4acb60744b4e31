"""Rung 12 - the optimizer step fused into backward: rung 07 without a full set of gradients, ever.

Each parameter gets its own SGD optimizer, and a post-accumulate-grad hook steps it the moment that
parameter's gradient is complete during the backward pass, then frees the gradient. Gradients for the
whole model (0.61 GB in bf16 for ViT-L/16) never exist at the same time: at most a few layers' worth.
This cannot be combined with gradient accumulation: accumulating means keeping every gradient until
the k-th micro-batch, which is exactly what this removes. So the batch here is the micro-batch, 4, with
no accumulation (--accumulation-steps > 1 is refused). The optimizers and their hooks:
fabric_memory_recipes/training/techniques/step_in_backward.py: register; the shared step leaves the optimizer
to the hooks: its block marked "rung 12" in fabric_memory_recipes/training/step.py: train_step.
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import lightning as L
import torch

from fabric_memory_recipes import RunConfig, planning
from fabric_memory_recipes.training.techniques import bf16, step_in_backward
from fabric_memory_recipes.training import data, lifecycle, loop, models

RUNG = RunConfig(
    recipe="12_optimizer_in_backward",
    precision="bf16-true",  # rung 03: weights, gradients, Adam state and activations all in bfloat16
    bf16_update="stochastic",  # bf16 updates rounded at random: kept on average (docs/bf16_updates.md)
    batch_size=4,  # rung 12: the micro-batch; no accumulation (it would keep every gradient)
    accumulation_steps=1,
    lr=0.01,
    optimizer="sgd",  # rung 06: SGD keeps no state (declared for the planner)
    optimizer_in_backward=True,  # rung 12: each gradient freed in backward (--accumulation-steps 1 only)
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
        with fabric.init_module(empty_init=False):  # rung 07: on the device, in the target dtype
            model = models.build_model(cfg.model, weights, data.NUM_CLASSES, cfg.image_size)
        models.compile_blocks(model, cfg.compile)  # fast mode: one compiled graph shared by every block
        planning.instrument(results, model, cfg)  # records the estimate and the model's size
        model = fabric.setup(model)
        # rung 12: one SGD per parameter, stepped by a hook as soon as that parameter's gradient is ready
        optimizers = step_in_backward.per_parameter(model, torch.optim.SGD, lr=cfg.lr, fused=True)
        optimizers = bf16.updates(optimizers, cfg, results)  # --bf16-update, --lost-updates
        step_in_backward.register(optimizers)  # rung 12: the hook steps, then frees the gradient right away

    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*data.loaders(splits, cfg, fabric))
    batch_fn = data.image_classification(model.image_size)
    num_steps = loop.planned_steps(len(train_loader), cfg.accumulation_steps, cfg.epochs, cfg.max_steps)
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=num_steps) for o in optimizers.values()]
    scheduler = step_in_backward.SchedulerGroup(schedulers)  # rung 12: one schedule per optimizer, as one

    with results.phase("train"):  # the loop steps the schedule once per optimizer step ("rung 06" there)
        # rung 12: no optimizer for the loop to step (its "rung 12" block): the hooks did it in backward
        loop.fit(fabric, model, None, train_loader, batch_fn, cfg, results, scheduler=scheduler)
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches)


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

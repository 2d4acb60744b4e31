"""Rung 14 - the memory floor: everything that lowers memory, combined, still a full fine-tune that learns.

Lines marked `# rung NN` are those rungs' techniques: bf16-true weights built in place (03, 07), SGD (06),
the step inside backward (12), checkpointed blocks (10: fabric_memory_recipes/training/techniques/checkpointing.py:
checkpoint_blocks) whose inputs go to host memory (11: fabric_memory_recipes/training/techniques/offload.py:
offload_activations), micro-batch 4; plus expandable segments. On the GPU: 0.61 GB weights, ~0.1 GB in flight."""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # rung 14; before CUDA starts

import lightning as L
import torch

from fabric_memory_recipes import RunConfig, planning
from fabric_memory_recipes.training import data, lifecycle, loop, models
from fabric_memory_recipes.training.techniques import bf16, checkpointing, offload, step_in_backward

RUNG = RunConfig(
    recipe="14_memory_floor",
    precision="bf16-true",  # rung 03: weights, gradients, Adam state and activations all in bfloat16
    bf16_update="stochastic",  # bf16 updates rounded at random: kept on average (docs/bf16_updates.md)
    batch_size=4,  # rung 12: the micro-batch; no accumulation (it would keep every gradient)
    lr=0.01,
    optimizer="sgd",  # rung 06: SGD keeps no state (declared for the planner)
    optimizer_in_backward=True,  # rung 12: each gradient freed in backward (--accumulation-steps 1 only)
    activation_offload=True,  # rung 11
    activation_checkpointing=("EncoderBlock",),  # rung 10
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
        checkpointing.checkpoint_blocks(model, ("EncoderBlock",))  # rung 10: each block keeps its input only
        planning.instrument(results, model, cfg)  # records the estimate and the model's size
        model = fabric.setup(model)
        # rung 12: one SGD per parameter, stepped by a hook as soon as that parameter's gradient is ready
        optimizers = step_in_backward.per_parameter(model, torch.optim.SGD, lr=cfg.lr, fused=True)
        optimizers = bf16.updates(optimizers, cfg, results)  # --bf16-update, --lost-updates
        step_in_backward.register(optimizers)  # rung 12: the hook steps, then frees the gradient right away
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*data.loaders(splits, cfg, fabric))
    image_batch = data.image_classification(model.image_size)
    offloaded = offload.offload_activations()  # rung 11: one set of pinned host buffers, reused

    def batch_fn(model, batch):
        with offloaded:  # rung 11: what the checkpoints still save goes to host memory
            return image_batch(model, batch)

    num_steps = loop.planned_steps(len(train_loader), cfg.accumulation_steps, cfg.epochs, cfg.max_steps)
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=num_steps) for o in optimizers.values()]
    scheduler = step_in_backward.SchedulerGroup(schedulers)  # rung 12: one schedule per optimizer, as one
    with results.phase("train"):  # rung 12: no optimizer for the loop to step, the hooks did it
        loop.fit(fabric, model, None, train_loader, batch_fn, cfg, results, scheduler=scheduler)
    results.extra["offloaded_gb_per_micro_batch"] = offloaded.host_bytes() / 1e9  # to the host and back
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches)


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

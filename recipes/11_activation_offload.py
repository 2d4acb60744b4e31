"""Rung 11 - activation offloading: rung 07 with the tensors saved for backward kept in host memory.

In fabric_memory_recipes/training/techniques/offload.py: offload_activations, each saved activation is copied to
pinned host memory on a side stream (eager: in batches) and freed on the GPU; backward prefetches them on another.
Activation memory drops to what is in flight (--offload-window-mb, --resident-mb); price: PCIe, twice."""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
from dataclasses import dataclass

import lightning as L
import torch

from fabric_memory_recipes import RunConfig, planning
from fabric_memory_recipes.config import at_least, flag
from fabric_memory_recipes.training.techniques import bf16, offload
from fabric_memory_recipes.training import data, lifecycle, loop, models


@dataclass
class OffloadConfig(RunConfig):  # rung 11's own flags
    offload_window_mb: int = flag(0, "training", "MiB of copies in flight per side stream (0: in the compute stream's order)", type=at_least(0))  # fmt: skip
    resident_mb: int = flag(0, "training", "MiB of the last saved tensors kept on the GPU (PCIe traded for memory)", type=at_least(0))  # fmt: skip


RUNG = OffloadConfig(
    recipe="11_activation_offload",
    precision="bf16-true",  # rung 03: weights, gradients, Adam state and activations all in bfloat16
    bf16_update="stochastic",  # bf16 updates rounded at random: kept on average (docs/bf16_updates.md)
    batch_size=16,  # rung 04: a quarter of the activations
    accumulation_steps=4,  # rung 05: 4 micro-batches of 4; the loop's "rung 05" blocks group them
    lr=0.01,
    optimizer="sgd",  # rung 06: SGD keeps no state (declared for the planner)
    activation_offload=True,  # rung 11: saved activations live in host memory (declared for the estimates)
    offload_window_mb=64,  # rung 11: ~2 blocks of copies in flight per side stream, beside the compute
)


def main(cfg: OffloadConfig, results) -> None:
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
        # rung 06: plain SGD keeps no state (Adam kept two extra tensors per parameter); fused: one kernel
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, fused=True)
        planning.instrument(results, model, cfg, optimizer)  # records the estimate and the model's size
        optimizer = bf16.updates(optimizer, cfg, results)  # --bf16-update (training/techniques/bf16.py)
        model, optimizer = fabric.setup(model, optimizer)

    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*data.loaders(splits, cfg, fabric))
    image_batch = data.image_classification(model.image_size)
    offloaded = offload.offload_activations((cfg.offload_window_mb << 20) or None, cfg.resident_mb << 20, batched=not cfg.cuda_graphs)  # rung 11  # fmt: skip

    def batch_fn(model, batch):
        with offloaded:  # rung 11: what autograd saves in the forward pass goes to pinned host memory
            return image_batch(model, batch)

    num_steps = loop.planned_steps(len(train_loader), cfg.accumulation_steps, cfg.epochs, cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=num_steps)  # rung 06

    with results.phase("train"):  # the loop steps the schedule once per optimizer step ("rung 06" there)
        loop.fit(fabric, model, optimizer, train_loader, batch_fn, cfg, results, scheduler=scheduler)
    results.extra.update(offloaded.traffic.summary())  # GB to the host and back, kept, reused per micro-batch
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches)


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

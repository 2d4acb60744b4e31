"""Rung 15 - the speed rung: the fastest way this project trains ViT-L/16 on one GPU.

Throughput is the goal here, with the same model, data and update rule (Adam):
- bf16-true (rung 03), the model built on the GPU (rung 07), fused Adam (the update in one kernel);
- the attention as one fused-qkv Linear + scaled_dot_product_attention instead of torchvision's general
  nn.MultiheadAttention (fabric_memory_recipes/training/techniques/attention.py: fuse_attention; same weights and
  arithmetic; --no-fused-attention: stock);
- torch.compile of the whole model (fused elementwise kernels, few launches); uint8 images resized on the GPU;
- batch 256: bigger matrix products, the optimizer step paid once per 256 images (try 64 or 128).
--float8: float8 matmuls (fabric_memory_recipes/training/techniques/float8.py: convert). MFU: model FLOPs/s / bf16 peak."""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
from dataclasses import dataclass

import lightning as L
import torch

from fabric_memory_recipes import RunConfig, planning
from fabric_memory_recipes.config import BOOL, flag
from fabric_memory_recipes.measurement import results_file
from fabric_memory_recipes.training.techniques import attention, bf16, float8
from fabric_memory_recipes.training import data, lifecycle, loop, models


@dataclass
class SpeedConfig(RunConfig):  # rung 15's own flags
    fused_attention: bool = flag(True, "training", "fused-qkv + SDPA attention (--no-: torchvision's module)", action=BOOL)  # fmt: skip
    float8: bool = flag(False, "training", "float8 matrix products in the linear layers (torchao)", action="store_true")  # fmt: skip


RUNG = SpeedConfig(
    recipe="15_speed",
    precision="bf16-true",  # rung 03: half the bytes moved, bf16 tensor cores
    bf16_update="stochastic",  # bf16 updates rounded at random: kept on average (docs/bf16_updates.md)
    batch_size=256,  # rung 15: bigger matrix products, the optimizer step paid once per 256 images
    accumulation_steps=1,
    lr=5e-5,
    fused_attention=True,  # rung 15: one qkv Linear + scaled_dot_product_attention per block
)


def main(cfg: SpeedConfig, results) -> None:
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
        if cfg.fused_attention:  # rung 15: the same weights as one qkv Linear + scaled_dot_product_attention
            attention.fuse_attention(model)
        planning.instrument(results, model, cfg)  # records the estimate (float8 is not modelled)
        results.extra["float8_linears"] = float8.convert(model, fabric.device) if cfg.float8 else 0
        image_size = model.image_size
        if cfg.compile:  # rung 15: the whole model as one graph (forward and backward each)
            model = torch.compile(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True)  # fused: one update kernel
        optimizer = bf16.updates(optimizer, cfg, results)  # --bf16-update, --lost-updates
        model, optimizer = fabric.setup(model, optimizer)

    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*data.loaders(splits, cfg, fabric))
    batch_fn = data.image_classification(image_size)
    with results.phase("train"):
        loop.fit(fabric, model, optimizer, train_loader, batch_fn, cfg, results)
    # rung 15: model FLOPs utilisation, the step's model FLOPs over its time against the datasheet peak
    flops = models.training_flops(cfg.model, cfg.micro_batch_size) * cfg.accumulation_steps
    results.extra.update(results_file.utilisation(flops, results.median_step_s(), results.gpu_name()))
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches)


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

"""Your own model: train a torchvision, timm or Hugging Face model with a chosen technique set.

Outside the numbered ladder. The model is built from its architecture with random weights; the task follows
from it (image classification on digits, text classification on IMDb when present, a causal LM on IMDb as SFT;
otherwise a synthetic stand-in of the same shape). The technique set is flags, the same ones ``fmr-estimate
--model ... --fit SIZE`` prints; the results JSON has the ladder's memory, whole-device and timing fields and
the estimate (docs/your_model.md).

    python recipes/your_model.py --model torchvision:resnet50 --precision bf16-mixed --batch-size 64
    python recipes/your_model.py --accelerator cpu --model timm:vit_tiny_patch16_224 --batch-size 4 --max-steps 3
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import contextlib

import lightning as L
import torch

from fabric_memory_recipes.planning.inference import cli as inference_estimate
from fabric_memory_recipes.planning.your_model import estimate
from fabric_memory_recipes.training import data, lifecycle, loop
from fabric_memory_recipes.training.data import attention_masks
from fabric_memory_recipes.training.techniques import checkpointing, fused_loss, lora, offload, step_in_backward  # fmt: skip
from fabric_memory_recipes.training.techniques.inference import weights_quant
from fabric_memory_recipes.training.your_model import inference, models, runner, sharding

RUNG = runner.default_config()


def main(cfg: runner.YourModelConfig, results) -> None:
    if cfg.infer:  # generate() or a forward pass under inference_mode, measured next to its prediction
        return inference.run(cfg, results, inference_estimate.for_run, weights_quant.quantize)  # int8 weights
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
    um = runner.resolve(cfg)
    meta = models.build_on_meta(um)  # the repeated blocks: FSDP's units, what --checkpoint-blocks wraps
    blocks, found_by = models.repeated_blocks(meta)
    units = {type(m) for m in meta.modules() if type(m).__name__ in blocks}
    strategy = sharding.strategy(cfg, units)  # --fsdp: a unit per block (fast mode: FSDP2, compiled blocks)
    fabric = L.Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes, strategy=strategy,
                      precision=cfg.precision, loggers=results.fabric_loggers())  # fmt: skip
    fabric.launch()
    fabric.seed_everything(cfg.seed, verbose=False)
    results.attach(fabric)
    with fabric.rank_zero_first():
        splits, batch_fn, num_classes = runner.load_data(cfg, um)
    results.set(data_source=splits.source, weights="random")
    results.extra.update(model=um.ref, task=um.task, blocks=list(blocks), blocks_found_by=found_by)

    with results.phase("model_load"):
        with fabric.init_module(empty_init=False):  # on the device, in the precision's dtype
            model = models.build(um)
            if cfg.lora_rank:  # LoRA: every weight frozen; low-rank adapters and a classifier's head train
                results.extra["lora"] = lora.add_adapters(model, um.source, um.task, blocks, cfg.lora_rank,
                                                          cfg.lora_targets)  # fmt: skip
        results.estimate, results.extra["predicted_card"] = estimate.for_user_run(model, um, cfg, blocks)
        if cfg.fused_loss:  # the loss of the output projection in chunks: the full logits never exist
            batch_fn = fused_loss.fused_batch_fn(model)
        if cfg.checkpoint_blocks:  # rung 10: recompute each block's inside in backward (full: keep its input)
            results.extra["checkpointed_blocks"] = checkpointing.checkpoint_blocks(
                model, blocks, cfg.checkpoint_mode
            )
        if cfg.compile:  # fast mode: each repeated block compiled (CUDA graphs too, for image models)
            results.extra["compiled_blocks"] = models.compile_repeated(model, blocks)
        if cfg.optimizer_in_backward:  # rung 12: each parameter stepped as soon as its gradient is ready
            model = fabric.setup_module(model)
            step_in_backward.register(
                step_in_backward.per_parameter(model, lambda ps: runner.make_optimizer(cfg, ps))
            )
            optimizer = None
        else:
            model = fabric.setup_module(model)  # with FSDP: shard first, then the optimizer over the shards
            optimizer = fabric.setup_optimizers(runner.make_optimizer(cfg, list(model.parameters())))
    results.set(parameters=sum(p.numel() for p in model.parameters()))
    results.extra["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)

    train_loader, val_loader, test_loader = fabric.setup_dataloaders(
        *data.loaders(splits, cfg, fabric, shard=cfg.fsdp)
    )
    task_batch = batch_fn or data.image_classification(model.image_size)
    if cfg.cuda_graphs and um.task == "causal_lm":  # fast mode's graph: no padding mask read on the host
        task_batch = attention_masks.capturable(task_batch, model)
    offloaded = offload.offload_activations() if cfg.activation_offload else contextlib.nullcontext()

    def step_batch(model, batch):
        with offloaded:  # rung 11: what autograd saves goes to pinned host memory
            return task_batch(model, batch)

    with results.phase("train"):
        loop.fit(fabric, model, optimizer, train_loader, step_batch, cfg, results, num_classes=num_classes)
    if cfg.activation_offload:
        results.extra["offloaded_gb_per_micro_batch"] = offloaded.host_bytes() / 1e9
    with results.phase("eval"):
        loop.evaluate_splits(
            fabric, model, val_loader, test_loader, step_batch, results, cfg.eval_batches, num_classes
        )


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

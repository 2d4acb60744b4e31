"""Bonus - BigBird on IMDb, after: bonus_bigbird_before.py with the ladder's techniques applied.

The same model, data (2048 tokens per review) and effective batch of 12, with:
- precision "bf16-true" (rung 03): weights, gradients and Adam state in bf16, half of fp32's bytes;
- micro-batches of 1 with 12 accumulation steps (rung 05), as in the article's script: at 2048 tokens
  the activations dominate, and only one review's are alive at once;
- fabric.init_module() (rung 07): the model is created on the device, directly in bf16;
- fast mode (the default on a CUDA GPU; --mode eager runs without it): each layer's random attention
  blocks drawn once and kept on the GPU (hf_models.fix_random_blocks: Hugging Face redraws the same blocks
  with numpy at every forward pass and copies them from the host), then each optimizer step, its 12
  micro-batches and the update, one CUDA graph (fabric_memory_recipes/training/graphs.py): one review per
  micro-batch is launch-bound in eager mode, some 400 small kernels per layer, which a replay launches at
  once. --compile also compiles each BigBirdLayer (off by default: each layer compiles a graph of its own,
  12 compilations in the first step);
- --checkpointing full|selective (rung 10, off by default): each layer keeps less for the backward pass, so
  that a larger micro-batch (--accumulation-steps 6: micro-batches of 2) fits in the same memory;
- with --devices > 1, FSDP with one unit per BigBirdLayer and cpu_offload=True (rungs 08-09). (The
  article's script used FSDP with CPU offload on 4 GPUs and no wrap policy, i.e. the whole model as one
  unit, and measured 4.03 GB.)
Adam (lr 5e-5) stays, as in the article's script.

    python recipes/bonus_bigbird_after.py --max-steps 20
    python recipes/bonus_bigbird_after.py --max-steps 20 --mode eager   # redrawn blocks, no graph
    python recipes/bonus_bigbird_after.py --max-steps 20 --accumulation-steps 6 --checkpointing full
    python recipes/bonus_bigbird_after.py --devices 4     # FSDP + CPU offload, as in the article
    python recipes/bonus_bigbird_after.py --accelerator cpu --model bigbird-tiny --max-length 128 --max-steps 5
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import lightning as L
import torch
from lightning.fabric.strategies import FSDPStrategy
from transformers.models.big_bird.modeling_big_bird import BigBirdLayer

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.training import data, hf_models, lifecycle, loop
from fabric_memory_recipes.training.data import text
from fabric_memory_recipes.training.data.text import AfterConfig
from fabric_memory_recipes.training.techniques import checkpointing
from fabric_memory_recipes.training.your_model.models import compile_repeated

RUNG = AfterConfig(
    recipe="bonus_bigbird_after",
    model="google/bigbird-roberta-base",
    model_choices=hf_models.BIGBIRD,  # the full-size hub name and a tiny config
    precision="bf16-true",  # rung 03: weights, gradients and Adam state in bf16
    batch_size=12,
    accumulation_steps=12,  # rung 05: micro-batches of 1
    lr=5e-5,
    max_length=2048,
    compile=False,  # fast mode is the CUDA graph; --compile adds the compiled layers
)


def make_strategy(cfg: AfterConfig):
    if cfg.world_size == 1:
        return "auto"  # one device: nothing to shard
    return FSDPStrategy(
        auto_wrap_policy={BigBirdLayer},  # rung 08: each transformer layer is one FSDP unit, gathered on use
        cpu_offload=True,  # rung 09: shards of parameters and gradients in CPU memory; Adam steps on the CPU
    )


def main(cfg: AfterConfig, results) -> None:
    if cfg.world_size > 1 and cfg.accelerator != "cuda":
        raise UsageError("--devices > 1 shards with FSDPStrategy, which needs CUDA GPUs")
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")  # "high" = TF32 matmuls
    fabric = L.Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
                      strategy=make_strategy(cfg),  # rungs 08-09 with several devices
                      precision=cfg.precision, loggers=results.fabric_loggers())  # fmt: skip
    fabric.launch()
    fabric.seed_everything(cfg.seed, verbose=False)  # the seed is in the results JSON
    results.attach(fabric)

    spec = hf_models.SPECS[cfg.model]
    pretrained = hf_models.resolve_weights(spec, cfg.weights)
    with fabric.rank_zero_first():
        splits = text.load_for(cfg, spec)
    results.set(data_source=splits.source, data_detail=splits.detail,
                weights="pretrained" if pretrained else "random", tokens_per_sample=cfg.max_length)  # fmt: skip

    with results.phase("model_load"):
        with fabric.init_module(empty_init=False):  # rung 07: allocated on the device, in bf16
            model = hf_models.build_model(
                spec, pretrained, num_labels=text.NUM_LABELS, vocab_size=splits.vocab_size
            )
        if cfg.checkpointing:  # rung 10: each layer's inside recomputed in backward (full or selective)
            results.extra["checkpointed_blocks"] = checkpointing.checkpoint_blocks(
                model, ("BigBirdLayer",), cfg.checkpointing
            )
        if cfg.compile or cfg.cuda_graphs:  # fast mode: the random blocks drawn once (and kept on the GPU)
            hf_models.fix_random_blocks(model, cfg.max_length, on_device=cfg.cuda_graphs)
        if cfg.compile:  # each layer compiled in place
            layers = model.config.num_hidden_layers  # one compiled graph per layer: each has its own seed
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * layers)
            results.extra["compiled_blocks"] = compile_repeated(model, ("BigBirdLayer",))
        parameters = hf_models.count_parameters(model)
        model = fabric.setup_module(model)  # with FSDP: shard first, then build the optimizer over the shards
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True))
    results.set(parameters=parameters)

    loaders = data.loaders(splits, cfg, fabric, shard=True)  # with several processes, a shard each
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    batch_fn = text.sequence_classification
    with results.phase("train"):
        loop.fit(fabric, model, optimizer, train_loader, batch_fn, cfg, results, num_classes=text.NUM_LABELS)
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches,
                             text.NUM_LABELS)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

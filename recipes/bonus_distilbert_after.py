"""Bonus - DistilBERT on IMDb, after: bonus_distilbert_before.py with the ladder's techniques applied.

The same model, data and effective batch of 12, with:
- precision "bf16-true" (rung 03): weights, gradients and Adam state in bf16, half of fp32's bytes;
- micro-batches of 3 with 4 accumulation steps (rung 05): a quarter of the activations alive at once;
- fabric.init_module() (rung 07): the model is created on the device, directly in bf16;
- fast mode (the default on a CUDA GPU; --mode eager runs without it), as the ladder's: each TransformerBlock
  compiled (regional compilation, as recipes/your_model.py --mode fast does) and each optimizer step, its 4
  micro-batches and the update, one CUDA graph (fabric_memory_recipes/training/graphs.py): at micro-batches of 3
  eager steps are launch-bound, the GPU waiting for Python between small kernels. The padding mask goes in
  as a 4-D tensor (text.sequence_classification_capturable): Hugging Face checks a 2-D one on the host;
- --checkpointing full|selective (rung 10, off by default): each block keeps less for the backward pass, so
  that a larger micro-batch (--accumulation-steps 1 or 2) fits in the same memory;
- with --devices > 1, FSDP with one unit per TransformerBlock and cpu_offload=True (rungs 08-09):
  parameters, gradients and optimizer state are sharded and kept in CPU memory (eagerly).
Adam (lr 5e-5) stays, as in the article's script. Its measurement: 3.99 GB before, 1.15 GB after
(max_memory_reserved; 4 GPUs with FSDP + CPU offload).

    python recipes/bonus_distilbert_after.py --max-steps 50
    python recipes/bonus_distilbert_after.py --max-steps 50 --mode eager   # no graph, the blocks uncompiled
    python recipes/bonus_distilbert_after.py --max-steps 50 --no-cuda-graphs   # compiled blocks, eager steps
    python recipes/bonus_distilbert_after.py --devices 4     # FSDP + CPU offload, as in the article
    python recipes/bonus_distilbert_after.py --accelerator cpu --model distilbert-tiny --max-length 128 --max-steps 5
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import lightning as L
import torch
from lightning.fabric.strategies import FSDPStrategy
from transformers.models.distilbert.modeling_distilbert import TransformerBlock

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.training import data, hf_models, lifecycle, loop
from fabric_memory_recipes.training.data import text
from fabric_memory_recipes.training.data.text import AfterConfig
from fabric_memory_recipes.training.techniques import checkpointing
from fabric_memory_recipes.training.your_model.models import compile_repeated

RUNG = AfterConfig(
    recipe="bonus_distilbert_after",
    model="distilbert-base-uncased",
    model_choices=hf_models.DISTILBERT,  # the full-size hub name and a tiny config
    precision="bf16-true",  # rung 03: weights, gradients and Adam state in bf16
    batch_size=12,
    accumulation_steps=4,  # rung 05: micro-batches of 3
    lr=5e-5,
    max_length=512,
)


def make_strategy(cfg: AfterConfig):
    if cfg.world_size == 1:
        return "auto"  # one device: nothing to shard
    return FSDPStrategy(
        auto_wrap_policy={
            TransformerBlock
        },  # rung 08: each transformer block is one FSDP unit, gathered on use
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
        if cfg.checkpointing:  # rung 10: each block's inside recomputed in backward (full or selective)
            results.extra["checkpointed_blocks"] = checkpointing.checkpoint_blocks(
                model, ("TransformerBlock",), cfg.checkpointing
            )
        if cfg.compile:  # fast mode: each block compiled in place, the six sharing their code
            results.extra["compiled_blocks"] = compile_repeated(model, ("TransformerBlock",))
        parameters = hf_models.count_parameters(model)
        model = fabric.setup_module(model)  # with FSDP: shard first, then build the optimizer over the shards
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True))
    results.set(parameters=parameters)

    loaders = data.loaders(splits, cfg, fabric, shard=True)  # with several processes, a shard each
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    # fast mode's graph: a 4-D padding mask, which Hugging Face does not check on the host
    batch_fn = text.sequence_classification_capturable if cfg.cuda_graphs else text.sequence_classification
    with results.phase("train"):
        loop.fit(fabric, model, optimizer, train_loader, batch_fn, cfg, results, num_classes=text.NUM_LABELS)
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches,
                             text.NUM_LABELS)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

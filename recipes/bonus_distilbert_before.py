"""Bonus - DistilBERT on IMDb, before: a plain fine-tune (fp32, batch 12, Adam 5e-5), the reference point.

distilbert-base-uncased (66M parameters) with a 2-label head classifies movie reviews, truncated and
padded to 512 tokens. Nothing is done about memory: fp32 weights, gradients and Adam state, the whole
batch of 12 in one forward pass. bonus_distilbert_after.py applies the ladder's techniques to the same
task; `diff` the two. (The article's own "before" script ran 16-mixed with DeepSpeed stage 2 on 4 GPUs
and measured 3.99 GB; this one is the single-GPU fp32 baseline the ladder starts from.)

    python recipes/bonus_distilbert_before.py --max-steps 50
    python recipes/bonus_distilbert_before.py --accelerator cpu --model distilbert-tiny --max-length 128 --max-steps 5
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import lightning as L
import torch

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.training import data, hf_models, lifecycle, loop
from fabric_memory_recipes.training.data import text
from fabric_memory_recipes.training.data.text import TextConfig

RUNG = TextConfig(
    recipe="bonus_distilbert_before",
    model="distilbert-base-uncased",
    model_choices=hf_models.DISTILBERT,  # the full-size hub name and a tiny config
    precision="32-true",
    batch_size=12,
    accumulation_steps=1,
    lr=5e-5,
    max_length=512,
    compile=False,
    cuda_graphs=False,  # the Hugging Face models run their steps eagerly
)


def main(cfg: TextConfig, results) -> None:
    if cfg.compile:
        raise UsageError("--compile is not wired for the Hugging Face models of the bonus recipes")
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")  # "high" = TF32 matmuls
    fabric = L.Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
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
        model = hf_models.build_model(
            spec, pretrained, num_labels=text.NUM_LABELS, vocab_size=splits.vocab_size
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True)
        model, optimizer = fabric.setup(model, optimizer)
    results.set(parameters=hf_models.count_parameters(model))

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

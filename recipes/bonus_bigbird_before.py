"""Bonus - BigBird on IMDb, before: a plain fine-tune of a long-input model (fp32, batch 12, Adam 5e-5).

google/bigbird-roberta-base (128M parameters) replaces full attention with block-sparse attention
(a sliding window, a few global and random blocks), so inputs of up to 4096 tokens are affordable. The
reviews are truncated and padded to 2048 tokens (--max-length): 4x DistilBERT's 512, enough for all but a
handful of IMDb's reviews, and short enough for this fp32 baseline to fit on one 80 GB GPU. Nothing is
done about memory here; bonus_bigbird_after.py applies the ladder's techniques. The article gave no
"before" figure for BigBird (its after script measured 4.03 GB); this script supplies one.

    python recipes/bonus_bigbird_before.py --max-steps 20
    python recipes/bonus_bigbird_before.py --accelerator cpu --model bigbird-tiny --max-length 128 --max-steps 5
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import lightning as L
import torch

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.training import data, hf_models, lifecycle, loop
from fabric_memory_recipes.training.data import text
from fabric_memory_recipes.training.data.text import TextConfig

RUNG = TextConfig(
    recipe="bonus_bigbird_before",
    model="google/bigbird-roberta-base",
    model_choices=hf_models.BIGBIRD,  # the full-size hub name and a tiny config
    precision="32-true",
    batch_size=12,
    accumulation_steps=1,
    lr=5e-5,
    max_length=2048,
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

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

import lightning as L
import torch

from common import cli, hf_models, loop, text

RECIPE = "bonus_bigbird_before"
MODELS = hf_models.BIGBIRD  # --model choices: the full-size hub name and a tiny config
DEFAULTS = dict(
    model="google/bigbird-roberta-base",
    precision="32-true",
    batch_size=12,
    accumulation_steps=1,
    lr=5e-5,
    max_length=2048,
    compile=False,
)


def main(args, log):
    if args.compile:
        raise cli.UsageError("--compile is not wired for the Hugging Face models of the bonus recipes")
    torch.set_float32_matmul_precision("high" if args.tf32 else "highest")  # "high" = TF32 matmuls
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision,
        loggers=log.fabric_loggers(),
    )
    fabric.launch()
    fabric.seed_everything(args.seed, verbose=False)  # the seed is in the results JSON
    log.attach(fabric)

    spec = hf_models.SPECS[args.model]
    pretrained = hf_models.resolve_weights(spec, args.weights)
    with fabric.rank_zero_first():
        splits = hf_models.load_text(args, spec)
    log.set(
        data_source=splits.source,
        data_detail=splits.detail,
        weights="pretrained" if pretrained else "random",
        tokens_per_sample=args.max_length,
    )

    with log.phase("model_load"):
        model = hf_models.build(spec, pretrained, num_labels=text.NUM_LABELS, vocab_size=splits.vocab_size)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
        model, optimizer = fabric.setup(model, optimizer)
    log.set(parameters=hf_models.count_parameters(model))

    pin = fabric.device.type == "cuda"
    loaders = text.loaders(
        splits,
        args.micro_batch_size,
        args.micro_batch_size,
        args.num_workers,
        pin,
        world_size=fabric.world_size,
        rank=fabric.global_rank,
        seed=args.seed,
    )
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    batch_fn = text.sequence_classification

    with log.phase("train"):
        loop.fit(
            fabric,
            model,
            optimizer,
            train_loader,
            log,
            batch_fn,
            accumulation_steps=args.accumulation_steps,
            epochs=args.epochs,
            max_steps=args.max_steps,
            log_every=args.log_every,
            **cli.checkpointing(args),
            num_classes=text.NUM_LABELS,
        )
    with log.phase("eval"):
        loop.evaluate_splits(
            fabric, model, val_loader, test_loader, batch_fn, log, args.eval_batches, text.NUM_LABELS
        )


if __name__ == "__main__":
    raise SystemExit(
        cli.run(
            main,
            recipe=RECIPE,
            description=__doc__,
            defaults=DEFAULTS,
            extra=text.add_flags,
            model_choices=MODELS,
            data_choices=text.DATA_CHOICES,
            help_overrides=text.HELP,
        )
    )

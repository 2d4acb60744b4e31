"""Bonus - DistilBERT on IMDb, before: a plain fine-tune (fp32, batch 12, Adam 5e-5), the reference point.

distilbert-base-uncased (66M parameters) with a 2-label head classifies movie reviews, truncated and
padded to 512 tokens. Nothing is done about memory: fp32 weights, gradients and Adam state, the whole
batch of 12 in one forward pass. bonus_distilbert_after.py applies the ladder's techniques to the same
task; `diff` the two. (The article's own "before" script ran 16-mixed with DeepSpeed stage 2 on 4 GPUs
and measured 3.99 GB; this one is the single-GPU fp32 baseline the ladder starts from.)

    python recipes/bonus_distilbert_before.py --max-steps 50
    python recipes/bonus_distilbert_before.py --accelerator cpu --model distilbert-tiny --max-length 128 --max-steps 5
"""

import lightning as L
import torch

from common import cli, hf_models, loop, text

RECIPE = "bonus_distilbert_before"
MODELS = hf_models.DISTILBERT  # --model choices: the full-size hub name and a tiny config
DEFAULTS = dict(
    model="distilbert-base-uncased",
    precision="32-true",
    batch_size=12,
    accumulation_steps=1,
    lr=5e-5,
    max_length=512,
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

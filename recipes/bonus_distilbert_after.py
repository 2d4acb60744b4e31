"""Bonus - DistilBERT on IMDb, after: bonus_distilbert_before.py with the ladder's techniques applied.

The same model, data and effective batch of 12, with:
- precision "bf16-true" (rung 03): weights, gradients and Adam state in bf16, half of fp32's bytes;
- micro-batches of 3 with 4 accumulation steps (rung 05): a quarter of the activations alive at once;
- fabric.init_module() (rung 07): the model is created on the device, directly in bf16;
- with --devices > 1, FSDP with one unit per TransformerBlock and cpu_offload=True (rungs 08-09):
  parameters, gradients and optimizer state are sharded and kept in CPU memory.
Adam (lr 5e-5) stays, as in the article's script. Its measurement: 3.99 GB before, 1.15 GB after
(max_memory_reserved; 4 GPUs with FSDP + CPU offload).

    python recipes/bonus_distilbert_after.py --max-steps 50
    python recipes/bonus_distilbert_after.py --devices 4     # FSDP + CPU offload, as in the article
    python recipes/bonus_distilbert_after.py --accelerator cpu --model distilbert-tiny --max-length 128 --max-steps 5
"""

import lightning as L
import torch
from lightning.fabric.strategies import FSDPStrategy
from transformers.models.distilbert.modeling_distilbert import TransformerBlock

from common import cli, hf_models, loop, text

RECIPE = "bonus_distilbert_after"
MODELS = hf_models.DISTILBERT  # --model choices: the full-size hub name and a tiny config
DEFAULTS = dict(
    model="distilbert-base-uncased",
    precision="bf16-true",
    batch_size=12,
    accumulation_steps=4,
    lr=5e-5,
    max_length=512,
    compile=False,
)


def make_strategy(args):
    if args.devices * args.num_nodes == 1:
        return "auto"  # one device: nothing to shard
    return FSDPStrategy(
        auto_wrap_policy={TransformerBlock},  # each transformer block is one FSDP unit: gathered on use
        cpu_offload=True,  # shards of parameters and gradients live in CPU memory; Adam steps on the CPU
    )


def main(args, log):
    if args.compile:
        raise cli.UsageError("--compile is not wired for the Hugging Face models of the bonus recipes")
    if args.devices * args.num_nodes > 1 and args.accelerator != "cuda":
        raise cli.UsageError("--devices > 1 shards with FSDPStrategy, which needs CUDA GPUs")
    torch.set_float32_matmul_precision("high" if args.tf32 else "highest")  # "high" = TF32 matmuls
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=make_strategy(args),
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
        with fabric.init_module(empty_init=False):  # allocated on the device, in bf16
            model = hf_models.build(
                spec, pretrained, num_labels=text.NUM_LABELS, vocab_size=splits.vocab_size
            )
        parameters = hf_models.count_parameters(model)
        model = fabric.setup_module(model)  # with FSDP: shard first, then build the optimizer over the shards
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
        optimizer = fabric.setup_optimizers(optimizer)
    log.set(parameters=parameters)

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

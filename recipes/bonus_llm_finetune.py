"""Bonus - supervised fine-tuning of a causal LM (Qwen2-0.5B-Instruct-sized), one memory toggle per flag.

The model reads a prompt and its completion; the loss is on the completion only (labels are -100 on
the prompt and on padding). Batch 12 as 2 x 6 accumulation steps, AdamW (lr 5e-5), sequences padded to
512 tokens: the set-up of seed 001, which switched these toggles on one at a time with HF Trainer.

  (no flag)             vanilla: fp32 weights, gradients and AdamW state; eager attention
  --half                precision "bf16-true": weights, gradients and optimizer state in bf16
  --mixed               precision "bf16-mixed": fp32 weights and state, matmuls and activations in bf16
  --grad-checkpointing  keep each decoder layer's input only, recompute the inside during backward
                        (the KV cache, a generation feature, is switched off: it cannot be recomputed)
  --lora                LoRA (peft), r=8 on q_proj and v_proj: the base weights are frozen; gradients and
                        optimizer state exist for the small adapters only
  --attn sdpa           torch's scaled_dot_product_attention: on CUDA with 16-bit inputs, flash
                        kernels that never store the (sequence x sequence) score matrix
  --attn flash_attention_2   the flash-attn package's kernels (only if it is installed)
  --all                 --half --grad-checkpointing --lora --attn sdpa

    python recipes/bonus_llm_finetune.py --max-steps 20 --half --tag half
    ./run_all.sh --bonus                    # every bonus recipe, and this recipe's table of toggles
    python recipes/bonus_llm_finetune.py --accelerator cpu --model qwen2-tiny --max-length 64 --max-steps 5 --all
"""

import argparse
import importlib.util

import lightning as L
import torch

from common import cli, hf_models, loop, text

RECIPE = "bonus_llm_finetune"
MODELS = hf_models.QWEN2  # --model choices: the full-size hub name and a tiny config
DEFAULTS = dict(
    model="Qwen/Qwen2-0.5B-Instruct",
    precision=None,  # 32-true; bf16-true with --half or --all, bf16-mixed with --mixed (resolve_toggles)
    batch_size=12,
    accumulation_steps=6,
    lr=5e-5,
    max_length=512,
    compile=False,
    attn=None,
)
LORA_TARGETS = ["q_proj", "v_proj"]
SIXTEEN_BIT = ("bf16-true", "bf16-mixed", "16-true", "16-mixed")  # what flash-attn kernels accept


def add_flags(parser: argparse.ArgumentParser) -> None:
    text.add_flags(parser)
    g = parser.add_argument_group("memory toggles (seed 001)")
    g.add_argument("--half", action="store_true", help="bf16 weights: --precision bf16-true")
    g.add_argument("--mixed", action="store_true", help="bf16 autocast: --precision bf16-mixed")
    g.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in backward")
    g.add_argument("--lora", action="store_true", help="train LoRA adapters only (needs peft)")
    g.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default 8)")
    g.add_argument(
        "--attn",
        choices=("eager", "sdpa", "flash_attention_2"),
        help="attention implementation (default eager; sdpa with --all)",
    )
    g.add_argument("--all", action="store_true", help="--half --grad-checkpointing --lora --attn sdpa")


def resolve_toggles(args) -> None:
    """--all switches the toggles on, --half/--mixed pick the precision (an explicit --precision must
    agree), and the final precision is validated; contradictions are a UsageError (exit 2)."""
    if args.all:
        if args.mixed:
            raise cli.UsageError("--all includes --half; leave out --mixed")
        args.half = args.grad_checkpointing = args.lora = True
        args.attn = args.attn or "sdpa"
    args.attn = args.attn or "eager"
    if args.half and args.mixed:
        raise cli.UsageError("--half and --mixed exclude each other: choose bf16 weights or bf16 autocast")
    wanted = "bf16-true" if args.half else "bf16-mixed" if args.mixed else "32-true"
    if args.precision is None:  # not given: the toggles decide
        args.precision = wanted
    elif (args.half or args.mixed) and args.precision != wanted:
        toggle = "--all" if args.all else "--half" if args.half else "--mixed"
        raise cli.UsageError(f"--precision {args.precision} contradicts {toggle} (precision {wanted})")
    cli.validate(args)  # again, now with the final precision (e.g. a GPU without bfloat16)
    if args.attn == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise cli.UsageError(
                "--attn flash_attention_2 needs the flash-attn package; --attn sdpa is built in"
            )
        if args.accelerator != "cuda" or args.precision not in SIXTEEN_BIT:
            raise cli.UsageError("--attn flash_attention_2 needs a CUDA GPU and 16-bit precision")
    if args.lora and importlib.util.find_spec("peft") is None:
        raise cli.UsageError("--lora needs peft: python3 -m pip install peft")


def main(args, log):
    resolve_toggles(args)
    if args.compile:
        raise cli.UsageError("--compile is not wired for the Hugging Face models of the bonus recipes")
    torch.set_float32_matmul_precision("high" if args.tf32 else "highest")  # "high" = TF32 matmuls
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision,  # --half: "bf16-true"; --mixed: "bf16-mixed"; vanilla: "32-true"
        loggers=log.fabric_loggers(),
    )
    fabric.launch()
    fabric.seed_everything(args.seed, verbose=False)  # the seed is in the results JSON
    log.attach(fabric)

    spec = hf_models.SPECS[args.model]
    pretrained = hf_models.resolve_weights(spec, args.weights)
    with fabric.rank_zero_first():
        splits = hf_models.load_text(args, spec, task="causal_lm")
    log.set(
        data_source=splits.source,
        data_detail=splits.detail,
        weights="pretrained" if pretrained else "random",
        tokens_per_sample=args.max_length,
    )

    with log.phase("model_load"):
        with fabric.init_module():  # created on the device, in the dtype of the precision
            model = hf_models.build(
                spec, pretrained, attn_implementation=args.attn, vocab_size=splits.vocab_size
            )
        if args.grad_checkpointing:
            model.config.use_cache = False  # a KV cache would keep every layer's keys/values alive
            if hasattr(model, "activation_checkpointing_enable"):  # its name in recent transformers
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable({"use_reentrant": False})
        if args.lora:
            from peft import LoraConfig, TaskType, get_peft_model

            lora = LoraConfig(
                task_type=TaskType.CAUSAL_LM,
                r=args.lora_r,
                lora_alpha=32,
                lora_dropout=0.05,
                target_modules=LORA_TARGETS,
            )
            model = get_peft_model(model, lora)  # freezes the base model, adds trainable adapters
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=args.lr, fused=True)  # state for trainable tensors only
        model, optimizer = fabric.setup(model, optimizer)
    log.set(parameters=hf_models.count_parameters(model))
    log.extra["toggles"] = {
        "weights_dtype": hf_models.weights_dtype(model),
        "autocast": args.precision.endswith("-mixed"),
        "gradient_checkpointing": hf_models.checkpointing_enabled(model),
        "lora": any("lora_" in name for name, _ in model.named_parameters()),
        "trainable_parameters": hf_models.count_parameters(model, trainable_only=True),
        "attn_implementation": model.config._attn_implementation,
    }  # read from the model itself; accuracy.* is next-token accuracy on completion tokens

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
    batch_fn = text.causal_lm
    vocab = model.config.vocab_size

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
            num_classes=vocab,
        )
    with log.phase("eval"):
        loop.evaluate_splits(
            fabric, model, val_loader, test_loader, batch_fn, log, args.eval_batches, num_classes=vocab
        )


if __name__ == "__main__":
    raise SystemExit(
        cli.run(
            main,
            recipe=RECIPE,
            description=__doc__,
            defaults=DEFAULTS,
            extra=add_flags,
            model_choices=MODELS,
            data_choices=text.DATA_CHOICES,
            help_overrides=text.HELP,
        )
    )

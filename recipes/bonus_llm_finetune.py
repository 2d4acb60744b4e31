"""Bonus - supervised fine-tuning of a causal LM (Qwen2-0.5B-Instruct-sized), one memory toggle per flag.

The model reads a prompt and its completion; the loss is on the completion only (labels are -100 on
the prompt and on padding). Batch 12 as 2 x 6 accumulation steps, AdamW (lr 5e-5), sequences padded to
512 tokens; each toggle below switches one technique on (docs/bonus_llm_finetune.md has the table).

  (no flag)             vanilla: fp32 weights, gradients and AdamW state; eager attention
  --half                precision "bf16-true": weights, gradients and optimizer state in bf16
  --mixed               precision "bf16-mixed": fp32 weights and state, matmuls and activations in bf16
  --grad-checkpointing  keep each decoder layer's input only, recompute the inside during backward
                        (the KV cache, a generation feature, is switched off: it cannot be recomputed);
                        --checkpoint-mode selective also keeps its matmuls and attention
  --fused-loss          the loss of the output projection in chunks: the full logits never exist
  --lora                LoRA (peft), r=8 on q_proj and v_proj: the base weights are frozen; gradients and
                        optimizer state exist for the small adapters only
  --attn sdpa           torch's scaled_dot_product_attention: on CUDA with 16-bit inputs, flash
                        kernels that never store the (sequence x sequence) score matrix
  --attn flash_attention_2   the flash-attn package's kernels (only if it is installed)
  --all                 --half --grad-checkpointing --checkpoint-mode selective --fused-loss --lora --attn sdpa,
                        in fast mode on a CUDA GPU (each decoder layer compiled; --mode eager: uncompiled)

    python recipes/bonus_llm_finetune.py --max-steps 20 --half --tag half
    ./run_all.sh --bonus                    # every bonus recipe, and this recipe's table of toggles
    python recipes/bonus_llm_finetune.py --accelerator cpu --model qwen2-tiny --max-length 64 --max-steps 5 --all
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import lightning as L
import torch

from fabric_memory_recipes.training import data, hf_models, lifecycle, loop
from fabric_memory_recipes.training.data import text
from fabric_memory_recipes.training.techniques import checkpointing, fused_loss, llm_toggles
from fabric_memory_recipes.training.techniques.llm_toggles import (
    ToggleConfig,  # --half, --mixed, --grad-checkpointing, --fused-loss, --lora, --attn, --all
)
from fabric_memory_recipes.training.your_model.models import compile_repeated

LORA_TARGETS = ["q_proj", "v_proj"]
LAYERS = ("Qwen2DecoderLayer",)  # what checkpointing wraps and fast mode compiles

RUNG = ToggleConfig(
    recipe="bonus_llm_finetune",
    model="Qwen/Qwen2-0.5B-Instruct",
    model_choices=hf_models.QWEN2,  # the full-size hub name and a tiny config
    precision=None,  # 32-true; bf16-true with --half or --all, bf16-mixed with --mixed
    batch_size=12,
    accumulation_steps=6,
    lr=5e-5,
    max_length=512,
    cuda_graphs=False,  # the steps stay eager: the loss picks the completion tokens by a mask
)


def main(cfg: ToggleConfig, results) -> None:
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")  # "high" = TF32 matmuls
    fabric = L.Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
                      precision=cfg.precision,  # --half: "bf16-true"; --mixed: "bf16-mixed"; vanilla: "32-true"
                      loggers=results.fabric_loggers())  # fmt: skip
    fabric.launch()
    fabric.seed_everything(cfg.seed, verbose=False)  # the seed is in the results JSON
    results.attach(fabric)

    spec = hf_models.SPECS[cfg.model]
    pretrained = hf_models.resolve_weights(spec, cfg.weights)
    with fabric.rank_zero_first():
        splits = text.load_for(cfg, spec, task="causal_lm")
    results.set(data_source=splits.source, data_detail=splits.detail,
                weights="pretrained" if pretrained else "random", tokens_per_sample=cfg.max_length)  # fmt: skip

    with results.phase("model_load"):
        with fabric.init_module():  # created on the device, in the dtype of the precision
            model = hf_models.build_model(
                spec, pretrained, attn_implementation=cfg.attn, vocab_size=splits.vocab_size
            )
        batch_fn = text.causal_lm
        if cfg.fused_loss:  # the loss of the output projection in chunks: the full logits never exist
            batch_fn = fused_loss.causal_lm_loss(fused_loss.fuse_output_embeddings(model))
        if cfg.lora:
            from peft import LoraConfig, TaskType, get_peft_model  # optional: only --lora needs it

            lora = LoraConfig(task_type=TaskType.CAUSAL_LM, r=cfg.lora_r, lora_alpha=32, lora_dropout=0.05,
                              target_modules=LORA_TARGETS)  # fmt: skip
            model = get_peft_model(model, lora)  # freezes the base model, adds trainable adapters
        if cfg.grad_checkpointing:  # full: keep each layer's input; selective: also its matmuls and attention
            model.config.use_cache = False  # a KV cache would keep every layer's keys/values alive
            checkpointing.checkpoint_blocks(model, LAYERS, cfg.checkpoint_mode)
        if cfg.compile:  # fast mode: each decoder layer compiled in place (with its checkpoint wrapper)
            results.extra["compiled_blocks"] = compile_repeated(model, LAYERS)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, fused=True)  # state for trainable tensors only
        model, optimizer = fabric.setup(model, optimizer)
    results.set(parameters=hf_models.count_parameters(model))
    results.extra["toggles"] = llm_toggles.read_back(model, cfg.precision)  # accuracy.*: on completion tokens

    loaders = data.loaders(splits, cfg, fabric, shard=True)  # with several processes, a shard each
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*loaders)
    vocab = model.config.vocab_size
    with results.phase("train"):
        loop.fit(fabric, model, optimizer, train_loader, batch_fn, cfg, results, num_classes=vocab)
    with results.phase("eval"):
        loop.evaluate_splits(
            fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches, vocab
        )


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

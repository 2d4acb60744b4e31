"""The bonus LLM fine-tune's memory toggles (``recipes/bonus_llm_finetune.py``): one flag per technique,
resolved into the run's precision and mode and checked like every other flag (one line, exit code 2).

``--all`` switches every toggle on and runs in fast mode on a CUDA GPU: the fused loss and selective
checkpointing (``training/techniques/fused_loss.py``, ``checkpointing.py``) and each decoder layer compiled;
a single toggle runs eagerly unless ``--mode fast`` is given, so that each row of the table changes one thing."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import ClassVar

from fabric_memory_recipes.config import BOOL, Hardware, UsageError, flag
from fabric_memory_recipes.training import hf_models
from fabric_memory_recipes.training.data.text import TextConfig
from fabric_memory_recipes.training.techniques import checkpointing, fused_loss

SIXTEEN_BIT = ("bf16-true", "bf16-mixed", "16-true", "16-mixed")  # what flash-attn kernels accept


@dataclass
class ToggleConfig(TextConfig):
    """The text flags and this recipe's memory toggles; checking it resolves them into the precision."""

    half: bool = flag(False, "toggles", "bf16 weights: --precision bf16-true", action="store_true")
    mixed: bool = flag(False, "toggles", "bf16 autocast: --precision bf16-mixed", action="store_true")
    grad_checkpointing: bool = flag(
        False, "toggles", "recompute activations in backward", action="store_true"
    )
    lora: bool = flag(False, "toggles", "train LoRA adapters only (needs peft)", action="store_true")
    lora_r: int = flag(8, "toggles", "LoRA rank (default 8)", type=int)
    attn: str | None = flag(
        None,
        "toggles",
        "attention implementation (default eager; sdpa with --all)",
        choices=("eager", "sdpa", "flash_attention_2"),
    )
    checkpoint_mode: str | None = flag(
        None,
        "toggles",
        "what --grad-checkpointing keeps of each layer: full (its input only) or selective (also its matmuls"
        " and attention; default full, selective with --all)",
        choices=checkpointing.MODES,
    )
    fused_loss: bool | None = flag(
        None,
        "toggles",
        "the loss of the output projection in chunks, without the full logits (liger-kernel on CUDA; default:"
        " on with --all)",
        action=BOOL,
    )
    all: bool = flag(
        False,
        "toggles",
        "--half --grad-checkpointing --checkpoint-mode selective --fused-loss --lora --attn sdpa, in fast mode"
        " on a CUDA GPU",
        action="store_true",
    )

    GROUPS: ClassVar[dict[str, str]] = {**TextConfig.GROUPS, "toggles": "memory toggles"}
    HELP: ClassVar[dict[str, str]] = {
        **TextConfig.HELP,
        "mode": "fast: each decoder layer compiled; eager: none (default: fast with --all on a CUDA GPU, else eager)",
    }

    def checked(self, hardware: Hardware) -> ToggleConfig:
        """--all switches the toggles on, --half/--mixed pick the precision (an explicit --precision
        must agree); then the shared checks, with the final precision (e.g. a GPU without bfloat16)."""
        c = dataclasses.replace(self)
        if c.all:
            if c.mixed:
                raise UsageError("--all includes --half; leave out --mixed")
            c.half = c.grad_checkpointing = c.lora = True
            c.attn = c.attn or "sdpa"
            c.checkpoint_mode = c.checkpoint_mode or "selective"
            c.fused_loss = c.fused_loss is not False
        elif c.mode is None:
            c.mode = "eager"  # one toggle, one change: fast mode only when asked
        c.attn = c.attn or "eager"
        if c.checkpoint_mode and not c.grad_checkpointing:
            raise UsageError(f"--checkpoint-mode {c.checkpoint_mode} goes with --grad-checkpointing")
        c.checkpoint_mode = c.checkpoint_mode or "full"
        c.fused_loss = bool(c.fused_loss)
        if c.half and c.mixed:
            raise UsageError("--half and --mixed exclude each other: choose bf16 weights or bf16 autocast")
        wanted = "bf16-true" if c.half else "bf16-mixed" if c.mixed else "32-true"
        if c.precision is None:  # not given: the toggles decide
            c.precision = wanted
        elif (c.half or c.mixed) and c.precision != wanted:
            toggle = "--all" if c.all else "--half" if c.half else "--mixed"
            raise UsageError(f"--precision {c.precision} contradicts {toggle} (precision {wanted})")
        c = super(ToggleConfig, c).checked(hardware)
        if c.attn == "flash_attention_2":
            if importlib.util.find_spec("flash_attn") is None:
                raise UsageError(
                    "--attn flash_attention_2 needs the flash-attn package; --attn sdpa is built in"
                )
            if c.accelerator != "cuda" or c.precision not in SIXTEEN_BIT:
                raise UsageError("--attn flash_attention_2 needs a CUDA GPU and 16-bit precision")
        if c.lora and importlib.util.find_spec("peft") is None:
            raise UsageError('--lora needs peft: python3 -m pip install -e ".[bonus]"')
        return c


def read_back(model, precision: str) -> dict:
    """What each toggle did, read from the model itself (``extra.toggles`` of the results JSON)."""
    wrapped = [m.mode for m in model.modules() if isinstance(m, checkpointing.CheckpointedBlock)]
    return {
        "weights_dtype": hf_models.weights_dtype(model),
        "autocast": precision.endswith("-mixed"),
        "gradient_checkpointing": bool(wrapped) or hf_models.checkpointing_enabled(model),
        "checkpoint_mode": wrapped[0] if wrapped else None,
        "fused_loss": isinstance(model.get_output_embeddings(), fused_loss.HiddenStates),
        "lora": any("lora_" in name for name, _ in model.named_parameters()),
        "trainable_parameters": hf_models.count_parameters(model, trainable_only=True),
        "attn_implementation": model.config._attn_implementation,
    }

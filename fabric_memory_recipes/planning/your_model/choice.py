"""One technique set for your own model, as ``fmr-estimate --model SOURCE:NAME --fit SIZE`` shows it: the
``recipes/your_model.py`` command that trains it, its row's label and its JSON, and the keys the search
groups it by (planning/your_model/sets.py: which sets a model tries and the search among them)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fabric_memory_recipes.planning.planner import advice
from fabric_memory_recipes.planning.planner.fit import Candidate
from fabric_memory_recipes.techniques import (
    ACTIVATION_CHECKPOINTING,
    CHECKPOINT_MODE,
    LORA,
    PLANNED,
    switches,
)


@dataclasses.dataclass
class Choice(Candidate):
    """One technique set for your own model, in the ladder planner's shape (:class:`fit.Candidate`: its
    label, command, row and JSON): its rung is ``recipes/your_model.py``'s configuration with the set's
    flags, its mode eager (the runner's only), its technique set; ``changes`` are what it changes of the user's training (precision, optimizer), each with
    its measured accuracy cost."""

    seq_len: int | None = None  # text models: tokens per sample
    changes: tuple[advice.Cost, ...] = ()
    devices: int = 1  # > 1: FSDP over that many GPUs (--fsdp --devices N); memory is per GPU
    switched: tuple[str, ...] = ()  # the switches on (techniques.switches(), by name: --fused-loss)
    target_len: int | None = None  # an encoder-decoder's --target-len, when given
    checkpoint_mode: str = CHECKPOINT_MODE.default  # the checkpointing's option (--checkpoint-mode)
    cpu_offload: bool = (
        False  # --cpu-offload (with FSDP): shards, gradients and the optimizer step on the host
    )
    model_flops: float = 0.0  # training FLOPs per sample (the model's, without recompute): for the MFU
    lora: tuple[str, ...] = ()  # the user's --lora-rank R [--lora-targets NAMES], kept in every set

    @property
    def key(self) -> tuple:
        """What its simulation depends on: sharded, the mode too (FSDP2 in fast mode, FSDP in eager mode)."""
        sharded_by = self.mode if self.devices > 1 else None
        return (*super().key, self.devices, self.switched, self.checkpoint_mode, self.cpu_offload, sharded_by)

    @property
    def plain(self) -> tuple:
        """The same set without its memory techniques (what bounds its speed: the module's docstring)."""
        r = self.rung
        return (
            r.precision,
            self.techniques.optimizer,
            self.mode,
            self.devices,
            self.switched,
            r.micro_batch_size,
            r.accumulation_steps,
        )

    @property
    def family(self) -> tuple:
        """The set without its micro-batch: what the table shows once, at its fastest micro-batch that fits."""
        r = self.rung
        return (
            r.precision,
            self.techniques,
            self.mode,
            self.devices,
            self.switched,
            self.checkpoint_mode,
            self.cpu_offload,
        )

    def mfu(self, peak_flops: float | None) -> float | None:
        """Model FLOPs utilisation the predicted speed means (the model's FLOPs, not the recompute's)."""
        if not peak_flops or not self.images_per_s or not self.model_flops:
            return None
        return self.images_per_s * self.model_flops / peak_flops

    def argv(self) -> list[str]:
        r, used = self.rung, self.techniques
        out = ["--model", r.model] + (["--seq-len", str(self.seq_len)] if self.seq_len else [])
        out += ["--target-len", str(self.target_len)] if self.target_len else []
        out += ["--precision", r.precision, "--batch-size", str(r.batch_size), "--accumulation-steps",
                str(r.accumulation_steps), "--optimizer", used.optimizer]  # fmt: skip
        out += [t.flag for t in PLANNED if used.uses(t)]
        out += CHECKPOINT_MODE.flags(self.checkpoint_mode)
        out += [t.flag for t in switches() if t.name in self.switched]
        out += [*self.lora, "--mode", self.mode]
        out += ["--fsdp", "--devices", str(self.devices)] if self.devices > 1 else []
        return out + (["--cpu-offload"] if self.cpu_offload else [])

    def label(self) -> str:
        changed = ", ".join(c.change for c in self.changes)
        sharded = f", FSDP over {self.devices} GPUs" if self.devices > 1 else ""
        sharded += " + CPU offload" if self.cpu_offload else ""
        checkpointing = CHECKPOINT_MODE.label(self.checkpoint_mode, ACTIVATION_CHECKPOINTING)
        label = super().label().replace(ACTIVATION_CHECKPOINTING.label, checkpointing)
        for t in (t for t in switches() if t.name in self.switched):
            label = label.replace(f", {self.mode}", f" + {t.label}, {self.mode}")
        if self.lora:
            label = label.replace(f", {self.mode}", f" + {LORA.label}, {self.mode}")
        return label + sharded + (f" [changes {changed}]" if changed else "")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["predicted_samples_per_s"] = out.pop("predicted_images_per_s")  # images or sequences
        out["changes"] = [dataclasses.asdict(c) | {"line": c.line()} for c in self.changes]
        out["devices"], out["cpu_offload"] = self.devices, self.cpu_offload
        out.update({t.name: t.name in self.switched for t in switches()})
        out[CHECKPOINT_MODE.field] = self.checkpoint_mode
        out["micro_batch_size"] = self.rung.micro_batch_size
        out["lora"] = list(self.lora)
        out["label"] = self.label()
        return out

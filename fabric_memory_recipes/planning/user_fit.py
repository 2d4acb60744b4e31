"""``fmr-estimate --model SOURCE:NAME --fit SIZE``: the fastest technique sets for your own model whose
predicted whole-device peak fits a card of SIZE, each with the ``recipes/your_model.py`` command that
trains it.

Combined: precision; micro-batch x accumulation for the requested batch; the optimizer (AdamW, SGD,
8-bit AdamW); checkpointing of the repeated blocks, activation offload and the step in backward. Memory
is simulated (planning/user_estimate.py: peak allocated, reserved from the allocator replay with its
margin, + the card overhead); the runner runs eagerly, so the eager mode's overhead applies.

Speed, for a model no committed run measured: the ladder's step model calibrated on the committed runs
of the GPU kind (planning/speed.py) with its per-micro-batch compute scaled by this model's training
FLOPs per sample over ViT-L/16's per image (counted by ``torch.utils.flop_counter`` on the meta device)
and eager mode's host time per micro-batch scaled by its number of modules over ViT-L/16's. Ranking the
technique sets of one model is what it is for; its absolute samples/s are an estimate, not a measurement.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from fabric_memory_recipes.planning import calibration, speed
from fabric_memory_recipes.planning.check import meta_model as ladder_model
from fabric_memory_recipes.planning.fit import (
    Candidate,
    divisors,
    fastest,
    search,
    smallest,
    static_bytes,
    techniques,
)
from fabric_memory_recipes.planning.plan import GB, Plan
from fabric_memory_recipes.planning.user_estimate import card, estimate, meta_model, text_batch
from fabric_memory_recipes.training import user_run

PRECISIONS = ("bf16-true", "bf16-mixed", "32-true")
OPTIMIZERS = ("adamw", "sgd", "adamw8bit")
# (checkpoint the blocks, offload activations, step in backward)
TECHNIQUES = ((False, False, False), (True, False, False), (False, True, False), (True, True, False),
              (False, False, True), (True, False, True))  # fmt: skip
FLAGS = ("--checkpoint-blocks", "--activation-offload", "--optimizer-in-backward")
SPEED_SOURCE = "model: the ladder's step model, compute scaled by training FLOPs per sample"


@dataclasses.dataclass
class Choice(Candidate):
    """One technique set for your own model, in the ladder planner's shape (:class:`fit.Candidate`: its
    label, command, row and JSON): its rung is ``recipes/your_model.py``'s configuration with the set's
    flags, its mode eager (the runner's only), its signature (optimizer, checkpointing, offload, step in
    backward)."""

    seq_len: int | None = None  # text models: tokens per sample

    def argv(self) -> list[str]:
        r, (optimizer, *on) = self.rung, self.signature
        out = ["--model", r.model] + (["--seq-len", str(self.seq_len)] if self.seq_len else [])
        out += ["--precision", r.precision, "--batch-size", str(r.batch_size), "--accumulation-steps",
                str(r.accumulation_steps), "--optimizer", optimizer]  # fmt: skip
        return out + [f for f, used in zip(FLAGS, on, strict=True) if used]

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["predicted_samples_per_s"] = out.pop("predicted_images_per_s")  # images or sequences
        return out


def flops_per_sample(model: Any, um: Any, seq_len: int) -> float:
    """Training FLOPs (forward + backward) of one sample, counted on the meta device."""
    with torch.device("meta"), FlopCounterMode(display=False) as counter:
        if um.is_text:  # no attention mask: building it reads values, which meta tensors have not
            ids, _, labels = text_batch(um, 1, seq_len)[0]()
            loss = model(input_ids=ids, labels=labels).loss
        else:
            size = getattr(model, "image_size", 224)
            loss = model(torch.empty(1, 3, size, size)).float().sum()
        loss.backward()
    return float(counter.get_total_flops())


class UserPlanner:
    """Predictions for one model, batch and sequence length on one GPU kind."""

    def __init__(self, ref: str, batch_size: int, seq_len: int, gpu: str = "h100", *,
                 precisions=PRECISIONS, optimizers=OPTIMIZERS) -> None:  # fmt: skip
        self.um, self.model, self.blocks, self.found_by = meta_model(ref)
        self.ref, self.batch_size, self.gpu = ref, batch_size, gpu
        self.seq_len = seq_len if self.um.is_text else None
        self.parameters = sum(p.numel() for p in self.model.parameters())
        vit = ladder_model("vit_l_16")
        runs = calibration.load_runs((str(calibration.RESULTS_DIR),))
        base = speed.speed_model(gpu, "vit_l_16", sum(p.numel() for p in vit.parameters()), runs)
        scale = flops_per_sample(self.model, self.um, seq_len) / flops_per_sample(vit, _Vision(), 0)
        modules = len(list(self.model.modules())) / len(list(vit.modules()))
        self.speed = dataclasses.replace(
            base, flops_scale=scale, host_ms={k: v * modules for k, v in base.host_ms.items()}
        )
        self.modules_ratio = modules
        self.simulated: dict[tuple, tuple[float, float, float, float]] = {}
        over = card(_Floor(), gpu)["overhead_gb"] or 0.0  # the card overhead alone
        runner = user_run.default_config()
        self.choices = []
        for precision in precisions:
            for optimizer in optimizers:
                for t in TECHNIQUES:
                    if t[0] and not self.blocks:
                        continue
                    for k in [1] if t[2] else divisors(batch_size):
                        rung = runner.with_flags(model=ref, precision=precision, batch_size=batch_size,
                                               accumulation_steps=k, optimizer=optimizer)  # fmt: skip
                        sig = (optimizer, *t)
                        lower = static_bytes(rung, sig, self.parameters) / GB + over
                        c = Choice(rung, "eager", sig, lower, 0.0, speed_source=SPEED_SOURCE, overhead_gb=over,
                                   seq_len=self.seq_len)  # fmt: skip
                        c.speed_bound = self._speed(c, 0.0)
                        self.choices.append(c)
        self.choices.sort(key=lambda c: (-c.speed_bound, techniques(c), c.lower_bound_gb))

    def _speed(self, c: Choice, offloaded_gb: float) -> float:
        r = c.rung
        prec = r.precision if r.precision in self.speed.precision_factor else "16-mixed"
        step = self.speed.step_s(prec, c.signature, r.micro_batch_size, r.accumulation_steps, "eager", offloaded_gb,
                                 self.parameters)  # fmt: skip
        return r.batch_size / step

    def predict(self, c: Choice) -> Choice:
        if c.predicted_gb is None:
            r, (optimizer, ck, off, sib) = c.rung, c.signature
            key = (r.precision, c.signature, r.micro_batch_size, min(r.accumulation_steps, 2))
            if key not in self.simulated:
                plan = Plan(precision=r.precision, micro_batch_size=r.micro_batch_size,
                            accumulation_steps=r.accumulation_steps, optimizer=optimizer,
                            checkpoint=self.blocks if ck else (), activation_offload=off,
                            optimizer_in_backward=sib)  # fmt: skip
                est = estimate(self.model, self.um, plan, self.seq_len or 0)
                if est.error:
                    raise RuntimeError(f"the simulation of {c.label()} failed: {est.error}")
                got = card(est, self.gpu)
                self.simulated[key] = (est.peak_gb, got["peak_reserved_gb"], est.activations_host_gb)
            c.simulated_gb, c.predicted_gb, c.offloaded_gb = self.simulated[key]
            c.images_per_s = self._speed(c, c.offloaded_gb)
        return c

    def fit(self, budget_gb: float, top: int = 5) -> tuple[list[Choice], Choice | None]:
        """The ``top`` fastest choices predicted to fit, and the fastest predicted not to fit among those
        faster than the last pick (None if there is none): the ladder planner's search (planning/fit.py)."""
        fits, too_big, _ = search(self.choices, self.predict, budget_gb, top)
        return fits, fastest(too_big, self.predict)

    def smallest(self) -> Choice:
        return smallest(self.choices, self.predict)

    def speed_lines(self) -> list[str]:
        what = "sample" + (f" of {self.seq_len} tokens" if self.seq_len else " (image)")
        return [
            f"samples/s: predicted, not measured (no committed run of {self.ref}): the ladder's step model,"
            f" calibrated on the committed {self.gpu} runs (or h100's), with compute x {self.speed.flops_scale:.3g}"
            f" (this model's training FLOPs per {what} over ViT-L/16's per image) and eager host time x"
            f" {self.modules_ratio:.3g} (its modules over ViT-L/16's):",
            *(f"  {line}" for line in self.speed.lines()),
        ]  # fmt: skip


class _Vision:
    is_text = False


class _Floor:
    """An estimate of nothing: :func:`card` of it gives the overhead alone."""

    peak_gb = 0.0
    reserved_gb = 0.0

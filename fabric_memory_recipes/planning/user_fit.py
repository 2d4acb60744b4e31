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
import shlex
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.planning import calibration, speed
from fabric_memory_recipes.planning.check import meta_model as ladder_model
from fabric_memory_recipes.planning.fit import divisors, static_bytes
from fabric_memory_recipes.planning.plan import GB, Plan
from fabric_memory_recipes.planning.user_estimate import card, estimate, meta_model, text_batch

PRECISIONS = ("bf16-true", "bf16-mixed", "32-true")
OPTIMIZERS = ("adamw", "sgd", "adamw8bit")
# (checkpoint the blocks, offload activations, step in backward)
TECHNIQUES = ((False, False, False), (True, False, False), (False, True, False), (True, True, False),
              (False, False, True), (True, False, True))  # fmt: skip
NAMES = ("checkpointing", "offload", "step in backward")


@dataclasses.dataclass
class Choice:
    """One technique set, with what is predicted for it."""

    precision: str
    optimizer: str
    k: int
    techniques: tuple[bool, bool, bool]
    batch_size: int
    speed_bound: float = 0.0
    samples_per_s: float | None = None
    lower_gb: float = 0.0
    reserved_gb: float | None = None
    device_gb: float | None = None
    allocated_gb: float | None = None

    @property
    def micro(self) -> int:
        return self.batch_size // self.k

    def argv(self, ref: str, seq_len: int | None) -> list[str]:
        out = ["--model", ref] + (["--seq-len", str(seq_len)] if seq_len else [])
        out += ["--precision", self.precision, "--batch-size", str(self.batch_size), "--accumulation-steps",
                str(self.k), "--optimizer", self.optimizer]  # fmt: skip
        flags = ("--checkpoint-blocks", "--activation-offload", "--optimizer-in-backward")
        return out + [f for f, on in zip(flags, self.techniques, strict=True) if on]

    def label(self) -> str:
        batch = f"{self.batch_size}" + (f" = {self.micro} x {self.k}" if self.k > 1 else "")
        on = [n for n, t in zip(NAMES, self.techniques, strict=True) if t]
        return f"{self.precision}, batch {batch}, {' + '.join([self.optimizer, *on])}"

    def to_dict(self, ref: str, seq_len: int | None) -> dict[str, Any]:
        return {"command": command(self, ref, seq_len), "argv": self.argv(ref, seq_len), "technique": self.label(),
                "predicted_peak_allocated_gb": self.allocated_gb, "predicted_peak_gb": self.reserved_gb,
                "predicted_device_peak_gb": self.device_gb, "predicted_samples_per_s": self.samples_per_s}  # fmt: skip


def command(c: Choice, ref: str, seq_len: int | None) -> str:
    return shlex.join(["python", "recipes/your_model.py", *c.argv(ref, seq_len)])


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
        self.simulated: dict[tuple, tuple[float, float, float]] = {}
        self.choices = []
        for precision in precisions:
            for optimizer in optimizers:
                for t in TECHNIQUES:
                    if t[0] and not self.blocks:
                        continue
                    for k in [1] if t[2] else divisors(batch_size):
                        c = Choice(precision, optimizer, k, t, batch_size)
                        c.speed_bound = self._speed(c, 0.0)
                        rung = RunConfig(precision=precision, batch_size=batch_size, accumulation_steps=k)
                        over = card(_Floor(), gpu)  # the overhead alone
                        c.lower_gb = static_bytes(rung, (optimizer, *t), self.parameters) / GB + (
                            over["overhead_gb"] or 0
                        )
                        self.choices.append(c)
        self.choices.sort(key=lambda c: (-c.speed_bound, sum(c.techniques), c.lower_gb))

    def _speed(self, c: Choice, offloaded_gb: float) -> float:
        sig = (c.optimizer, *c.techniques)
        prec = c.precision if c.precision in self.speed.precision_factor else "16-mixed"
        return c.batch_size / self.speed.step_s(
            prec, sig, c.micro, c.k, "eager", offloaded_gb, self.parameters
        )

    def predict(self, c: Choice) -> Choice:
        if c.reserved_gb is None:
            key = (c.precision, c.optimizer, c.techniques, c.micro, min(c.k, 2))
            if key not in self.simulated:
                ck, off, sib = c.techniques
                plan = Plan(precision=c.precision, micro_batch_size=c.micro, accumulation_steps=c.k,
                            optimizer=c.optimizer, checkpoint=self.blocks if ck else (), activation_offload=off,
                            optimizer_in_backward=sib)  # fmt: skip
                est = estimate(self.model, self.um, plan, self.seq_len or 0)
                if est.error:
                    raise RuntimeError(f"the simulation of {c.label()} failed: {est.error}")
                got = card(est, self.gpu)
                self.simulated[key] = (
                    est.peak_gb,
                    got["peak_reserved_gb"],
                    got["device_peak_gb"],
                    est.activations_host_gb,
                )
            c.allocated_gb, c.reserved_gb, c.device_gb, offloaded = self.simulated[key]
            c.device_gb = c.reserved_gb if c.device_gb is None else c.device_gb
            c.samples_per_s = self._speed(c, offloaded)
        return c

    def fit(self, budget_gb: float, top: int = 5) -> tuple[list[Choice], Choice | None]:
        """The ``top`` fastest choices predicted to fit, and the fastest predicted not to fit among those
        faster than the last pick (None if there is none)."""
        fits: list[Choice] = []
        too_big: list[Choice] = []
        for c in self.choices:
            if len(fits) >= top and fits[top - 1].samples_per_s >= c.speed_bound:
                break
            if c.lower_gb > budget_gb:
                too_big.append(c)
                continue
            self.predict(c)
            (fits if c.device_gb <= budget_gb else too_big).append(c)
            fits.sort(key=lambda x: (-x.samples_per_s, sum(x.techniques), x.device_gb))
        rejected = None
        for c in too_big:  # sorted by the bound: simulate only what could be the fastest
            if rejected is not None and rejected.samples_per_s >= c.speed_bound:
                break
            self.predict(c)
            rejected = c if rejected is None or c.samples_per_s > rejected.samples_per_s else rejected
        return fits[:top], rejected

    def smallest(self) -> Choice:
        best = None
        for c in sorted(self.choices, key=lambda x: x.lower_gb):
            if best is not None and best.device_gb <= c.lower_gb:
                break
            self.predict(c)
            best = c if best is None or c.device_gb < best.device_gb else best
        return best

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

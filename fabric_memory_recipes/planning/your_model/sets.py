"""``fmr-estimate --model SOURCE:NAME --fit SIZE``: the fastest technique sets for your own model whose
predicted whole-device peak fits a card of SIZE, each with the ``recipes/your_model.py`` command that
trains it.

By default a technique set changes only how memory is used, never what is trained: micro-batch x
accumulation for the requested batch; checkpointing of the repeated blocks, activation offload and the
step in backward (with the user's optimizer); with ``--devices N``, FSDP over the N GPUs (one unit per
repeated block: weights, gradients and optimizer state sharded), with checkpointing or without, the
memory per GPU. The precision and the optimizer stay the user's
(``--precision``, ``--optimizer``) unless ``--may-change precision,optimizer`` lets the planner try
others (bf16-true, bf16-mixed, 32-true; AdamW, SGD, 8-bit AdamW); each such row then carries the accuracy
cost the convergence benchmark measured for the change (planning/planner/advice.py). Memory
is simulated (planning/your_model/estimate.py: peak allocated, reserved from the allocator replay with its
margin, + the card overhead); the runner runs eagerly, so the eager mode's overhead applies.

Speed, for a model no committed run measured: the ladder's step model calibrated on the committed runs
of the GPU kind (planning/planner/speed.py) with its per-micro-batch compute scaled by this model's training
FLOPs per sample over ViT-L/16's per image (counted by ``torch.utils.flop_counter`` on the meta device)
and eager mode's host time per micro-batch scaled by its number of modules over ViT-L/16's; the step in
backward adds its per-parameter hooks (:data:`HOOK_MS`, measured on the runner). Ranking the technique
sets of one model is what it is for; its absolute samples/s are an estimate: ``--measure`` runs the top
ones on the GPU at hand and ranks them by what they did (planning/your_model/measure.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.flop_counter import FlopCounterMode

from fabric_memory_recipes.planning.plan import GB, Plan
from fabric_memory_recipes.planning.planner import advice, calibration, speed
from fabric_memory_recipes.planning.planner.fit import (
    Candidate,
    divisors,
    fastest,
    smallest,
    static_bytes,
)
from fabric_memory_recipes.planning.simulation.costs import OpCosts
from fabric_memory_recipes.planning.your_model import step_time
from fabric_memory_recipes.planning.your_model.estimate import card, estimate, meta_user_model, text_batch
from fabric_memory_recipes.techniques import (
    ACTIVATION_CHECKPOINTING,
    ACTIVATION_OFFLOAD,
    MODES,
    OPTIMIZER_IN_BACKWARD,
    PLANNED,
    PRECISIONS,
    TechniqueSet,
    subset,
    switches,
)
from fabric_memory_recipes.training.models import meta_ladder_model
from fabric_memory_recipes.training.techniques import checkpointing
from fabric_memory_recipes.training.your_model import runner as user_run

# What --may-change tries besides yours: one precision of each memory and speed (bf16-mixed, what a user of
# their own model trains with, for 16-mixed), and one optimizer of each kind of state (AdamW for Adam too).
PRECISIONS_TRIED = subset(PRECISIONS, "bf16-true", "bf16-mixed", "32-true")
OPTIMIZERS_TRIED = subset(user_run.OPTIMIZERS, "adamw", "sgd", "adamw8bit")
# The planned techniques each set turns on (their flags: Technique.flag): every combination but activation
# offload with the step in backward.
SETS = (
    (),
    (ACTIVATION_CHECKPOINTING,),
    (ACTIVATION_OFFLOAD,),
    (ACTIVATION_CHECKPOINTING, ACTIVATION_OFFLOAD),
    (OPTIMIZER_IN_BACKWARD,),
    (ACTIVATION_CHECKPOINTING, OPTIMIZER_IN_BACKWARD),
)
# The runner's other choices each set is tried with: its mode, what a checkpointed block keeps, and the
# switches its model's task allows (techniques.switches(): a causal LM's fused loss), on and off.
MODES_TRIED = subset(MODES, "fast", "eager")
CHECKPOINT_MODES = checkpointing.MODES
SPEED_SOURCE = "model: the ladder's step model, compute scaled by training FLOPs per sample"
# The step in backward in eager mode: one optimizer.step() and zero_grad() per parameter tensor inside
# backward, which the GPU waits for. Measured on the runner: ResNet-50, batch 128, bf16-true SGD, one
# H100, 15 steps each: 3787 samples/s without a technique, 1270 with checkpointing + the step in
# backward; less checkpointing's measured cost (x 1.384, the ladder's fast-mode runs), 54.0 ms over its
# 161 parameter tensors (tests/planning/test_planner.py recomputes it from the two files).
HOOK_MS = 0.335
HOOK_SOURCE = (
    "results/published/h100/your-model/runs/yo-modeltorchvision_resnet50precisbf16-truebatchs128accumu1o*"
    " (SGD without a technique, and with checkpointing + the step in backward)"
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
    checkpoint_mode: str = "full"  # --checkpoint-mode, with checkpointing
    model_flops: float = 0.0  # training FLOPs per sample (the model's, without recompute): for the MFU

    @property
    def key(self) -> tuple:
        return (*super().key, self.devices, self.switched, self.checkpoint_mode)

    @property
    def family(self) -> tuple:
        """The set without its micro-batch: what the table shows once, at its largest micro-batch that fits."""
        r = self.rung
        return (r.precision, self.techniques, self.mode, self.devices, self.switched, self.checkpoint_mode)

    def mfu(self, peak_flops: float | None) -> float | None:
        """Model FLOPs utilisation the predicted speed means (the model's FLOPs, not the recompute's)."""
        if not peak_flops or not self.images_per_s or not self.model_flops:
            return None
        return self.images_per_s * self.model_flops / peak_flops

    def argv(self) -> list[str]:
        r, used = self.rung, self.techniques
        out = ["--model", r.model] + (["--seq-len", str(self.seq_len)] if self.seq_len else [])
        out += ["--precision", r.precision, "--batch-size", str(r.batch_size), "--accumulation-steps",
                str(r.accumulation_steps), "--optimizer", used.optimizer]  # fmt: skip
        out += [t.flag for t in PLANNED if used.uses(t)]
        out += ["--checkpoint-mode", self.checkpoint_mode] if self.checkpoint_mode != "full" else []
        out += [t.flag for t in switches() if t.name in self.switched]
        out += ["--mode", self.mode]
        return out + (["--fsdp", "--devices", str(self.devices)] if self.devices > 1 else [])

    def label(self) -> str:
        changed = ", ".join(c.change for c in self.changes)
        sharded = f", FSDP over {self.devices} GPUs" if self.devices > 1 else ""
        label = super().label()
        if self.checkpoint_mode != "full":
            label = label.replace(
                ACTIVATION_CHECKPOINTING.label, f"{self.checkpoint_mode} {ACTIVATION_CHECKPOINTING.label}"
            )
        for t in (t for t in switches() if t.name in self.switched):
            label = label.replace(f", {self.mode}", f" + {t.label}, {self.mode}")
        return label + sharded + (f" [changes {changed}]" if changed else "")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["predicted_samples_per_s"] = out.pop("predicted_images_per_s")  # images or sequences
        out["changes"] = [dataclasses.asdict(c) | {"line": c.line()} for c in self.changes]
        out["devices"] = self.devices
        out.update({t.name: t.name in self.switched for t in switches()})
        out["checkpoint_mode"] = self.checkpoint_mode
        out["micro_batch_size"] = self.rung.micro_batch_size
        return out


def flops_per_sample(model: Any, um: Any, seq_len: int) -> float:
    """Training FLOPs (forward + backward) of one sample, counted on fake tensors: no memory and no values,
    and transformers treats fake tensors as traced (a causal LM's mask checks read no values)."""
    with torch.device("cpu"), FakeTensorMode(allow_non_fake_inputs=True):
        state = {n: torch.empty(t.shape, dtype=t.dtype if not t.is_floating_point() else torch.float32,
                                requires_grad=t.requires_grad)
                 for n, t in [*model.named_parameters(), *model.named_buffers()]}  # fmt: skip
        with _reparametrize_module(model, state, tie_weights=True), FlopCounterMode(display=False) as counter:
            if um.is_text:
                ids, mask, labels = text_batch(um, 1, seq_len)[0]()
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            else:
                size = getattr(model, "image_size", 224)
                loss = model(torch.empty(1, 3, size, size)).float().sum()
            loss.backward()
    return float(counter.get_total_flops())


class UserPlanner:
    """Predictions for one model, batch and sequence length on one GPU kind. ``precision`` and
    ``optimizer`` are the user's; ``may_change`` (a subset of :data:`MAY_CHANGE`) lets the planner
    try the others. ``devices`` > 1: every set is FSDP over that many GPUs, its memory per GPU (the
    measured overhead of that many processes) and its samples/s those of all GPUs."""

    def __init__(self, ref: str, batch_size: int, seq_len: int, gpu: str = "h100", *, precision: str = "bf16-mixed",
                 optimizer: str = "adamw", may_change: tuple[str, ...] = (), devices: int = 1) -> None:  # fmt: skip
        self.um, self.model, self.blocks, self.found_by = meta_user_model(ref)
        self.ref, self.batch_size, self.gpu = ref, batch_size, gpu
        self.precision, self.optimizer, self.may_change = precision, optimizer, tuple(may_change)
        self.devices = devices
        self.seq_len = seq_len if self.um.is_text else None
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.tensors = sum(p.requires_grad for p in self.model.parameters())
        vit = meta_ladder_model("vit_l_16")
        runs = calibration.load_runs((str(calibration.RESULTS_DIR),))
        base = speed.speed_model(gpu, "vit_l_16", sum(p.numel() for p in vit.parameters()), runs)
        self.ceilings, self.ceilings_source = step_time.ceilings(gpu)
        self.flops = flops_per_sample(self.model, self.um, seq_len)
        scale = self.flops / _ladder_flops()
        modules = len(list(self.model.modules())) / len(list(vit.modules()))
        self.speed = dataclasses.replace(
            base, flops_scale=scale, host_ms={k: v * modules for k, v in base.host_ms.items()}
        )
        self.modules_ratio = modules
        self.simulated: dict[tuple, tuple[float, float, float]] = {}
        modes = MODES_TRIED if devices == 1 else ("eager",)  # the sharded runner runs eagerly
        overhead = {m: card(_Floor(), gpu, m, devices) for m in modes}  # the card overhead alone, per GPU
        self.overhead_source = "; ".join(f"{m}: {o['overhead_source']}" for m, o in overhead.items())
        self.overhead_legend = "; ".join(f"{m} mode: {o['overhead_legend']}" for m, o in overhead.items())
        runner = user_run.default_config()
        precisions = _first(precision, PRECISIONS_TRIED if "precision" in self.may_change else ())
        optimizers = _first(optimizer, OPTIMIZERS_TRIED if "optimizer" in self.may_change else ())
        allowed = [t.name for t in switches() if not t.tasks or self.um.task in t.tasks]
        switched = [s for n in range(len(allowed) + 1) for s in itertools.combinations(allowed, n)]
        self.choices = []
        for prec, opt, mode, switch, on in itertools.product(precisions, optimizers, modes, switched, SETS):
            changes = tuple(advice.cost(what, value, gpu) for what, value, mine in
                            (("precision", prec, precision), ("optimizer", opt, optimizer)) if value != mine)  # fmt: skip
            used = TechniqueSet.of(opt, *on)
            if used.uses(ACTIVATION_CHECKPOINTING) and not self.blocks:
                continue
            if devices > 1 and (used.uses(ACTIVATION_OFFLOAD) or used.uses(OPTIMIZER_IN_BACKWARD)):
                continue  # FSDP: with checkpointing or without (the sharded rungs' sets)
            over = overhead[mode]["overhead_gb"] or 0.0
            for keeps in CHECKPOINT_MODES if used.uses(ACTIVATION_CHECKPOINTING) else ("full",):
                for k in [1] if used.uses(OPTIMIZER_IN_BACKWARD) else divisors(batch_size):
                    rung = runner.with_flags(model=ref, precision=prec, batch_size=batch_size,
                                             accumulation_steps=k, optimizer=opt)  # fmt: skip
                    lower = static_bytes(rung, used, self.parameters) / GB / devices + over  # sharded
                    c = Choice(rung, mode, used, lower, 0.0, speed_source=SPEED_SOURCE, overhead_gb=over,
                               seq_len=self.seq_len, changes=changes, devices=devices, switched=switch,
                               checkpoint_mode=keeps, model_flops=self.flops)  # fmt: skip
                    c.speed_bound = self._speed(c, 0.0)
                    self.choices.append(c)
        self.choices.sort(key=lambda c: (-c.speed_bound, c.techniques.count(), c.lower_bound_gb))

    def weights_gb(self) -> float:
        """The weights alone in the narrowest precision the planner may use: no card below this fits."""
        narrow = "bf16-true" if "precision" in self.may_change else self.precision
        return self.parameters * (2 if narrow in ("bf16-true", "16-true") else 4) / GB / self.devices

    def _speed(self, c: Choice, offloaded_gb: float) -> float:
        r = c.rung
        prec = r.precision if r.precision in self.speed.precision_factor else "16-mixed"
        step = self.speed.step_s(prec, c.techniques, r.micro_batch_size, r.accumulation_steps, c.mode, offloaded_gb,
                                 self.parameters)  # fmt: skip
        hooks = self.tensors * HOOK_MS / 1e3 if c.techniques.uses(OPTIMIZER_IN_BACKWARD) else 0.0
        return c.devices * r.batch_size / (step + hooks)  # every GPU its own batch (FSDP: no comms modelled)

    def predict(self, c: Choice) -> Choice:
        if c.predicted_gb is None:
            r, used = c.rung, c.techniques
            key = (r.precision, used, r.micro_batch_size, min(r.accumulation_steps, 2), c.devices, c.switched,
                   c.checkpoint_mode, c.mode)  # fmt: skip
            if key not in self.simulated:
                plan = Plan(precision=r.precision, micro_batch_size=r.micro_batch_size,
                            accumulation_steps=r.accumulation_steps, optimizer=used.optimizer,
                            activation_checkpointing=self.blocks if used.uses(ACTIVATION_CHECKPOINTING) else (),
                            activation_offload=used.uses(ACTIVATION_OFFLOAD),
                            optimizer_in_backward=used.uses(OPTIMIZER_IN_BACKWARD),
                            sharding="fsdp" if c.devices > 1 else "none", checkpoint_mode=c.checkpoint_mode,
                            switched=c.switched, shard_units=self.blocks, world_size=c.devices)  # fmt: skip
                collector = (
                    OpCosts()
                )  # the same simulation gives the op costs the step time is predicted from
                try:
                    est = estimate(self.model, self.um, plan, self.seq_len or 0, op_costs=collector)
                except Exception as e:
                    raise RuntimeError(
                        f"the simulation of {c.label()} failed: {type(e).__name__}: {str(e)[:200]}"
                    ) from e
                if est.error:
                    raise RuntimeError(f"the simulation of {c.label()} failed: {est.error}")
                got = card(est, self.gpu, c.mode, c.devices)
                self.simulated[key] = (
                    est.peak_gb,
                    got["peak_reserved_gb"],
                    est.activations_host_gb,
                    collector,
                )
            c.simulated_gb, c.predicted_gb, c.offloaded_gb, collector = self.simulated[key]
            c.images_per_s = self._step_speed(c, collector)
        return c

    def _step_speed(self, c: Choice, collector: OpCosts) -> float:
        """samples/s from the simulated step's op costs on the GPU kind's fitted ceilings
        (planning/your_model/step_time.py); the set's own accumulation (the simulation ran two of its
        micro-batches: later ones repeat the second)."""
        r = c.rung
        plan = Plan(
            accumulation_steps=r.accumulation_steps, activation_offload=c.techniques.uses(ACTIVATION_OFFLOAD)
        )
        costs = step_time.costs_of(collector, plan, (c.offloaded_gb or 0.0) * 1e9)
        graphs = c.mode == "fast" and not self.um.is_text and c.devices == 1  # the runner's fast mode
        seconds, detail = step_time.step_seconds(costs, self.ceilings, c.mode, graphs)
        c.model_flops = detail["model_flops_per_step"] / r.batch_size
        c.speed_source = f"model: the simulated step's op costs ({self.ceilings_source})"
        return c.devices * r.batch_size / seconds

    def fit(self, budget_gb: float, top: int = 5) -> tuple[list[Choice], Choice | None]:
        """The ``top`` fastest choices predicted to fit, and the fastest predicted not to fit among those
        faster than the last pick (None if there is none): the ladder planner's search (planning/planner/fit.py)."""
        shown: dict[tuple, Choice] = {}  # each set once, at its fastest (its largest) micro-batch that fits
        too_big = []
        for c in self.choices:  # fastest bound first
            ranked = sorted(shown.values(), key=lambda x: -x.images_per_s)
            if len(ranked) >= top and ranked[top - 1].images_per_s >= c.speed_bound:
                break  # nothing left can be faster than the picks
            if c.family in shown:
                continue  # a faster micro-batch of this set fits already
            if c.lower_bound_gb > budget_gb:
                too_big.append(c)
                continue
            self.predict(c)
            if c.card_gb <= budget_gb:
                shown[c.family] = c
            else:
                too_big.append(c)
        fits = sorted(shown.values(), key=lambda x: -x.images_per_s)[:top]
        return fits, fastest(too_big, self.predict)

    def smallest(self) -> Choice:
        return smallest(self.choices, self.predict)

    def _reference(self) -> str:
        """Where the step model's constants came from besides this kind's own runs, if anywhere."""
        if self.gpu == calibration.REFERENCE_GPU:
            return ""
        return f" ({calibration.REFERENCE_GPU}'s where it has none)"

    def speed_lines(self, verbose: bool = False) -> list[str]:
        """How samples/s were predicted: two lines, or with ``verbose`` every constant and its source."""
        summary = step_time.load_calibration()["kinds"].get(self.gpu, {}).get("summary", {})
        held = summary.get("leave_one_model_out") or {}
        lines = [
            "samples/s: predicted, not measured (--measure runs them): each set's simulated step, op by op (FLOPs and"
            " bytes against the GPU kind's fitted ceilings, and in eager mode the host's time to launch them;"
            f" planning/your_model/step_time.py), {self.ceilings_source}"
            + (f"; each model left out of the fit, the error was {100 * held['median_abs_error']:.0f} % (median),"
               f" {100 * held['max_abs_error']:.0f} % at most" if held else "")
            + ("." if verbose else " (--verbose: the ceilings)."),
        ]  # fmt: skip
        if self.devices > 1:
            lines.append(f"  FSDP over {self.devices} GPUs: {self.devices} x one GPU's samples/s (each its own batch);"
                         " the gathers and reductions are not modelled, and every set here has them. Outside the"
                         " allocator each GPU holds NCCL's buffers besides its context: for a small model the card"
                         " per GPU can be above what one GPU alone needs (leave out --devices to compare).")  # fmt: skip
        if verbose:
            lines += [f"  {name}: {value:.4g}" for name, value in dataclasses.asdict(self.ceilings).items()]
        return lines


@functools.cache
def _ladder_flops() -> float:
    """ViT-L/16's training FLOPs per image: what the ladder's speed model was calibrated on."""
    return flops_per_sample(meta_ladder_model("vit_l_16"), _Vision(), 0)


def _first(mine: str, others: tuple[str, ...]) -> tuple[str, ...]:
    """The user's value first, then the others allowed."""
    return tuple(dict.fromkeys((mine, *others)))


class _Vision:
    is_text = False


class _Floor:
    """An estimate of nothing: :func:`card` of it gives the overhead alone."""

    peak_gb = 0.0
    reserved_gb = 0.0

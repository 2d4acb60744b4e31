"""Throughput where no committed run measured it: a small model of one optimizer step on one GPU
kind (:class:`SpeedModel`), its constants calibrated on the committed runs of that kind
(:func:`speed_model`), each with the runs it came from; the planner prints them."""

from __future__ import annotations

import dataclasses
import functools
import statistics

from fabric_memory_recipes.planning.planner.calibration import REFERENCE_GPU, Measured
from fabric_memory_recipes.techniques import (
    ACTIVATION_CHECKPOINTING,
    ACTIVATION_OFFLOAD,
    LOWBIT_STATE,
    OPTIMIZER_IN_BACKWARD,
    PRECISIONS,
    TechniqueSet,
    subset,
)
from fabric_memory_recipes.training import models

# Bytes read and written per parameter by one optimizer step, in units of the parameter's width: Adam
# reads weight, gradient and two moments and writes weight and moments (7); SGD reads weight and
# gradient and writes the weight (3). 8-bit Adam is timed as Adam times a measured factor.
STEP_TENSORS = {"adam": 7, "adamw": 7, "adamw8bit": 7, "sgd": 3, "sgd-momentum": 5, "none": 0}
# What no committed run determines, with the reason the planner prints.
BUILT_IN = {
    "checkpoint_extra": (1 / 3, "arithmetic: the recomputed forward is a third of forward + backward"),
    "lowbit_factor": (1.0, "not measured in fast mode: 8-bit Adam's step assumed to cost Adam's"),
}


def step_bytes(optimizer: str, precision: str, parameters: int) -> float:
    """Bytes one optimizer step moves (``STEP_TENSORS``; bf16-true weights are 2 bytes, else 4)."""
    width = 2 if precision in ("bf16-true", "16-true") else 4
    return STEP_TENSORS[optimizer] * width * parameters


# The precisions timed as a factor of bf16-true's compute (the others the planners run).
FACTOR_PRECISIONS = subset(PRECISIONS, "16-mixed", "bf16-mixed", "32-true")
# The sets that add no work to forward and backward: the compute per micro-batch is calibrated on them.
ADAM, SGD = TechniqueSet.of("adam"), TechniqueSet.of("sgd")
PLAIN = {ADAM, SGD, TechniqueSet.of("sgd", OPTIMIZER_IN_BACKWARD)}


@dataclasses.dataclass
class SpeedModel:
    """Seconds per optimizer step on one GPU kind (fast mode: every kernel of the step replayed from
    one CUDA graph, so it is GPU time; eager adds Python's launches, measured per technique):

        step = k x max(micro, host) + offload + optimizer
        micro = precision factor x (fixed + per_image x m) x (1 + checkpoint_extra if checkpointed)
        offload = k x bytes offloaded per micro-batch / offload bandwidth
        optimizer = bytes the step moves / memory bandwidth (x lowbit_factor for 8-bit Adam)

    ``host`` is 0 in fast mode. ``sources`` says where each constant came from."""

    gpu: str
    fixed_ms: float
    per_image_ms: float
    precision_factor: dict[str, float]
    memory_gb_s: float
    offload_gb_s: float
    checkpoint_extra: float
    lowbit_factor: float
    host_ms: dict[TechniqueSet, float]
    sources: dict[str, str]
    flops_scale: float = 1.0  # another model's FLOPs per image over ViT-L/16's
    own: int = 0  # constants determined by this kind's own runs (the rest: the reference kind's)

    def micro_s(self, precision: str, techniques: TechniqueSet, micro: int) -> float:
        ms = self.precision_factor.get(precision, 1.0) * (self.fixed_ms + self.per_image_ms * micro)
        recompute = self.checkpoint_extra if techniques.uses(ACTIVATION_CHECKPOINTING) else 0.0
        return ms * self.flops_scale * (1 + recompute) / 1e3

    def host_s(self, techniques: TechniqueSet) -> float:
        """Eager mode's host time per micro-batch of ``techniques``: measured for it where a run did (AdamW
        as Adam: the same launches); else the optimizer's plain host time (the median of the plain ones
        where none) times what the techniques cost where they were measured, relative to the plain set of
        the same optimizer, each technique alone where its combination was not. So a technique costs the
        same share in every set (checkpointing once read as free with AdamW, whose sets no run measured,
        and as doubling the time with SGD)."""
        opt = "adam" if techniques.optimizer == "adamw" else techniques.optimizer
        if (key := TechniqueSet(opt, techniques.used)) in self.host_ms:
            return self.host_ms[key] / 1e3
        plain = {t.optimizer: v for t, v in self.host_ms.items() if not t.used}
        base = plain.get(opt) or statistics.median(list(plain.values()) or list(self.host_ms.values()))

        def factor(used: tuple[str, ...]) -> float | None:
            ratios = [
                v / plain[t.optimizer]
                for t, v in self.host_ms.items()
                if t.used == used and t.optimizer in plain
            ]
            return statistics.median(ratios) if ratios else None

        whole = factor(techniques.used)
        if whole is None:  # each technique alone, where measured
            whole = 1.0
            for name in techniques.used:
                whole *= factor((name,)) or 1.0
        return base * whole / 1e3

    def step_s(self, precision, techniques: TechniqueSet, micro, k, mode, offloaded_gb, parameters) -> float:
        micro_s = self.micro_s(precision, techniques, micro)
        if mode == "eager":
            micro_s = max(micro_s, self.host_s(techniques))
        opt = step_bytes(techniques.optimizer, precision, parameters) / (self.memory_gb_s * 1e9)
        opt *= self.lowbit_factor if techniques.optimizer == LOWBIT_STATE.name else 1.0
        return k * micro_s + k * (offloaded_gb or 0.0) / self.offload_gb_s + opt

    def lines(self, sources: bool = True) -> list[str]:
        """The model's constants; with ``sources``, each one's runs (fmr-estimate --verbose)."""
        f = self.precision_factor
        return [
            f"per micro-batch of m images: {self.fixed_ms:.2f} ms + {self.per_image_ms:.3f} ms x m"
            f" (bf16-true; x {f.get('16-mixed', 1):.2f} 16-mixed, x {f.get('32-true', 1):.2f} 32-true)"
            + (f", x {self.flops_scale:.3g} for this model's FLOPs" if self.flops_scale != 1 else ""),
            f"optimizer step: bytes moved / {self.memory_gb_s:.0f} GB/s; 8-bit Adam x {self.lowbit_factor:.2f}",
            f"{ACTIVATION_CHECKPOINTING.label} +{100 * self.checkpoint_extra:.0f}%;"
            f" {ACTIVATION_OFFLOAD.label} {self.offload_gb_s:.1f} GB/s"
            f" of saved activations; eager: at least {min(self.host_ms.values()):.0f}-"
            f"{max(self.host_ms.values()):.0f} ms of host time per micro-batch (by technique)",
            *(f"  {k}: {v}" for k, v in self.sources.items() if sources),
        ]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a + b x by least squares on relative errors (weights 1/y^2)."""
    w = [1 / y**2 for y in ys]
    sw, sx, sy = (
        sum(w),
        sum(wi * x for wi, x in zip(w, xs, strict=True)),
        sum(wi * y for wi, y in zip(w, ys, strict=True)),
    )
    sxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys, strict=True))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return (sy - b * sx) / sw, b


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    return statistics.median(values) if values else None


Constants = tuple[dict[str, tuple[float, str]], dict[TechniqueSet, float]]


def _constants(runs: list[Measured], parameters: int) -> Constants:
    """The model's constants that these runs (of one GPU kind, ViT-L/16) determine, each with its
    source, and the eager host time per micro-batch by technique."""
    got: dict[str, tuple[float, str]] = {}
    host: dict[TechniqueSet, float] = {}
    timed = [r for r in runs if r.images_per_s and r.model == "vit_l_16"]
    graphed = [r for r in timed if r.mode == "fast"]
    names = lambda rs: ", ".join(sorted({r.path for r in rs}))  # noqa: E731
    # Memory bandwidth: fast runs that differ only in Adam vs SGD.
    pairs = [
        (a, s)
        for a in graphed
        for s in graphed
        if a.techniques == ADAM
        and s.techniques == SGD
        and (a.precision, a.batch_size, a.accumulation_steps)
        == (s.precision, s.batch_size, s.accumulation_steps)
    ]
    bw = _median(
        [
            (step_bytes("adam", a.precision, parameters) - step_bytes("sgd", a.precision, parameters))
            / (a.step_s - s.step_s)
            / 1e9
            for a, s in pairs
            if a.step_s > s.step_s
        ]
    )
    if bw:
        got["memory_gb_s"] = (
            bw,
            f"Adam vs SGD step time in fast mode: {names([x for p in pairs for x in p])}",
        )
    bw = bw or 1e12  # only to subtract the step below; stated nowhere

    def per_micro(r: Measured) -> float:  # ms of forward + backward per micro-batch
        opt = step_bytes(r.techniques.optimizer, r.precision, parameters) / (bw * 1e9)
        return (r.step_s - opt) * 1e3 / r.accumulation_steps

    # Forward + backward against the micro-batch: bf16-true plain rungs, graphed (any m) or compiled
    # with m >= 64 (launches no longer matter there), a weighted least-squares line.
    line = [
        r
        for r in timed
        if r.techniques in PLAIN
        and r.precision == "bf16-true"
        and (r.mode == "fast" or (r.mode == "compiled" and r.micro >= 64))
    ]
    if len({r.micro for r in line}) >= 2:
        a, b = fit_line([r.micro for r in line], [per_micro(r) for r in line])
        if a > 0 and b > 0:
            src = f"weighted least squares over {names(line)}"
            got["fixed_ms"], got["per_image_ms"] = (a, src), (b, src)
    if "per_image_ms" not in got:
        return got, host
    a, b = got["fixed_ms"][0], got["per_image_ms"][0]
    base = lambda r: a + b * r.micro  # noqa: E731
    for prec in FACTOR_PRECISIONS:
        same = [
            r
            for r in timed
            if r.techniques in PLAIN
            and r.precision == prec
            and (r.mode == "fast" or (r.mode == "compiled" and r.micro >= 64))
        ]
        factor = _median([per_micro(r) / base(r) for r in same])
        if factor:
            got[f"precision:{prec}"] = (factor, names(same))
    off = [
        r
        for r in graphed
        if r.techniques.uses(ACTIVATION_OFFLOAD)
        and not r.techniques.uses(ACTIVATION_CHECKPOINTING)
        and r.offloaded_gb
    ]
    gbs = _median([r.offloaded_gb / ((per_micro(r) - base(r)) / 1e3) for r in off if per_micro(r) > base(r)])
    if gbs:
        got["offload_gb_s"] = (gbs, f"offload vs compute time in fast mode: {names(off)}")
    gbs = gbs or float("inf")
    ckpt = [r for r in graphed if r.techniques.uses(ACTIVATION_CHECKPOINTING) and r.precision == "bf16-true"]
    extra = _median([(per_micro(r) - (r.offloaded_gb or 0.0) / gbs * 1e3) / base(r) - 1 for r in ckpt])
    if extra:
        got["checkpoint_extra"] = (extra, f"fast-mode runs with checkpointing: {names(ckpt)}")
    low = [r for r in graphed if r.techniques.optimizer == LOWBIT_STATE.name and r.precision == "bf16-true"]
    adam = step_bytes("adam", "bf16-true", parameters) / (bw * 1e9) * 1e3
    factor = _median(
        [(per_micro(r) * r.accumulation_steps - base(r) * r.accumulation_steps + adam) / adam for r in low]
    )
    if factor:
        got["lowbit_factor"] = (factor, f"8-bit Adam's step in fast mode: {names(low)}")
    for used in {r.techniques for r in timed}:  # eager: host time per micro-batch, launch-bound runs only
        eager = [
            r for r in timed if r.mode == "eager" and r.techniques == used and per_micro(r) > 1.5 * base(r)
        ]
        ms = _median([per_micro(r) for r in eager])
        if ms:
            host[used] = ms
    return got, host


@functools.cache
def speed_model(gpu: str, model: str, parameters: int, runs: tuple[Measured, ...]) -> SpeedModel:
    """The model for ``gpu``: each constant from that kind's runs, else from the reference kind's
    (H100), else built in (:data:`BUILT_IN`); ``sources`` says which."""
    mine, mine_host = _constants([r for r in runs if r.gpu == gpu], parameters)
    ref, ref_host = (
        _constants([r for r in runs if r.gpu == REFERENCE_GPU], parameters)
        if gpu != REFERENCE_GPU
        else ({}, {})
    )
    merged = {**ref, **mine}
    sources: dict[str, str] = {}

    def take(key: str, default: tuple[float, str] | None = None) -> float | None:
        if key in mine:
            value, src = mine[key]
        elif key in ref:
            value, src = ref[key][0], f"{REFERENCE_GPU} runs ({ref[key][1]})"
        elif default is not None:
            value, src = default
        else:
            return None
        sources[key] = f"{value:.4g} from {src}" if key in mine or key in ref else f"{value:.4g}: {src}"
        return value

    missing = [k for k in ("fixed_ms", "per_image_ms", "memory_gb_s", "offload_gb_s") if k not in merged]
    if missing:
        raise LookupError(f"no committed {gpu} or {REFERENCE_GPU} runs determine {', '.join(missing)}")
    host = mine_host or ref_host
    if not host:
        raise LookupError(
            f"no committed eager {gpu} or {REFERENCE_GPU} runs give the host time of eager mode"
        )
    flops = 1.0
    if model != "vit_l_16":
        flops = models.training_flops(model, 1) / models.training_flops("vit_l_16", 1)
    return SpeedModel(
        gpu=gpu,
        fixed_ms=take("fixed_ms"),
        per_image_ms=take("per_image_ms"),
        precision_factor={
            "bf16-true": 1.0,
            **{p: v for p in FACTOR_PRECISIONS if (v := take(f"precision:{p}")) is not None},
        },
        memory_gb_s=take("memory_gb_s"),
        offload_gb_s=take("offload_gb_s"),
        checkpoint_extra=take("checkpoint_extra", BUILT_IN["checkpoint_extra"]),
        lowbit_factor=take("lowbit_factor", BUILT_IN["lowbit_factor"]),
        host_ms=host,
        sources=sources,
        flops_scale=flops,
        own=len(mine) + bool(mine_host),
    )

"""bf16-true weights lose small updates: measure how many (``--lost-updates N``), and fix it (``--bf16-update``).

Why updates are lost. A bfloat16 number has 8 significant bits, so the gap between a weight ``w`` and its
neighbour is about ``|w| / 128``. An optimizer computes ``w + u`` in fp32 and stores the result in bf16,
rounding to the nearest value: when ``|u|`` is below half that gap the stored weight does not move at
all. With Adam ``|u|`` is about the learning rate, so at lr 1e-3 every weight above ~0.26 in magnitude
(LayerNorm gains start at 1.0) keeps its value however long it trains, and at lr 5e-5 almost every
weight does. 16-mixed (rung 02) avoids this by keeping fp32 master weights, at 4 bytes more per
parameter (plus fp32 gradients and optimizer state).

The fixes, selected with ``--bf16-update`` on the bf16-true rungs (``plain`` keeps the rung's optimizer):

``stochastic``  round ``w + u`` up or down at random, with probabilities that make the stored value
                right on average (unbiased): a small update moves the weight by one step with probability
                ``|u| / gap``. No extra memory. Adam: torchao's AdamW with ``bf16_stochastic_round=True``
                (weight decay 0, so it is Adam); 8-bit Adam (rung 13): torchao's ``AdamW8bit`` with the
                same option; SGD: :class:`StochasticRoundSGD` below (torchao has no SGD).
``kahan``       Kahan-compensated summation: a bf16 buffer per parameter keeps what rounding dropped
                and adds it back at the next step, so nothing is lost beyond the buffer's own 8 bits.
                +2 bytes per parameter. Adam and SGD: the torch-optimi package (``kahan_sum=True``).
                8-bit Adam has no Kahan variant: refused.

The measurement (``--lost-updates N``) is
:class:`~fabric_memory_recipes.measurement.lost_updates.LostUpdates`, which :func:`updates` attaches to
the optimizer: what it counts is said there.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fabric_memory_recipes.config import (
    UsageError,  # a --bf16-update the optimizer cannot honour: one line, exit 2
)
from fabric_memory_recipes.console import notice
from fabric_memory_recipes.measurement.lost_updates import LostUpdates
from fabric_memory_recipes.techniques import BF16_UPDATES


# ------------------------------------------------------------------------------------------- rounding
def round_stochastic(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounding up or down at random so that the expected result is ``x``.

    bf16 is the upper 16 bits of an fp32 number. Adding a random 16-bit integer to the lower 16 bits and
    truncating rounds away from zero with probability (lower bits) / 2^16, i.e. in proportion to how
    close ``x`` is to the next bf16 value. Non-finite values are passed through unchanged.
    """
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, device=bits.device, dtype=torch.int32)
    rounded = ((bits + noise) & -65536).view(torch.float32)  # -65536 == 0xFFFF0000 as int32
    return torch.where(torch.isfinite(x), rounded, x.float()).to(torch.bfloat16)


@functools.cache
def library_rounding():
    """The fp32 -> bf16 stochastic rounding to use: torchao's (``_fp32_to_bf16_sr``, the function its
    AdamW variants round with) where torchao is installed, else :func:`round_stochastic` (the same
    rule: torchao is optional, and the SGD rungs should not need it)."""
    try:
        from torchao.optim.quant_utils import _fp32_to_bf16_sr
    except ImportError:
        return round_stochastic
    return _fp32_to_bf16_sr


def sgd_update(
    p,
    grad,
    buf,
    lr,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    first: bool,
    rounding,
) -> None:
    """One parameter's SGD step, torch's rule (``torch.optim.SGD``), computed in fp32 and stored in
    ``p``'s dtype, with ``rounding`` (None: to nearest). ``buf`` is the momentum buffer
    (None without momentum), ``first`` its first step; ``lr`` may be a tensor (a captured step reads it)."""
    g = grad.float()
    if weight_decay:
        g = g + weight_decay * p.float()
    if buf is not None:
        b = g if first else buf.float() * momentum + (1 - dampening) * g
        buf.copy_(b)
        g = g + momentum * b if nesterov else b
    new = p.float() - lr * g
    p.copy_(new if rounding is None else rounding(new))


class StochasticRoundSGD(torch.optim.Optimizer):
    """``torch.optim.SGD`` (momentum, dampening, weight decay, Nesterov) whose bf16 weights are updated
    in fp32 and stored with stochastic rounding (:func:`library_rounding`); other weights as usual.

    Capturable, for fast mode's CUDA graph: the learning rate is a tensor (as in torchao's optimizers;
    the schedulers fill it in place), and on CUDA each parameter's step is one compiled kernel
    (:func:`sgd_update` under ``torch.compile``, as torchao compiles its Adam step): it reads the weight
    and the gradient once and writes the weight once, as the fused SGD kernel does, and draws its random
    bits from the CUDA generator, which a graph replay advances (fresh bits every step). Elsewhere the
    same function runs eagerly (``compile_on``: the devices it is compiled on)."""

    compile_on = ("cuda",)

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if not isinstance(group["lr"], torch.Tensor):  # a float would be baked into the compiled step
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # one compiled variant per shape and flags, a fixed number for a model (as torchao does)
        with torch._dynamo.utils.disable_cache_limit():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        buf, first = None, False
        if group["momentum"]:
            first = "momentum_buffer" not in state
            if first:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
        update = compiled_sgd_update() if p.device.type in self.compile_on else sgd_update
        rounding = library_rounding() if p.dtype == torch.bfloat16 else None
        update(
            p.detach(),
            p.grad,
            buf,
            group["lr"],
            group["momentum"],
            group["dampening"],
            group["weight_decay"],
            group["nesterov"],
            first,
            rounding,
        )


@functools.cache
def compiled_sgd_update():
    """:func:`sgd_update` compiled once per process (dynamo keeps one variant per shape and flags), without
    pointwise autotuning: its benchmark buffer (the size of L2) at each kernel's first run, inside backward
    on rungs 12 and 14, raised the floor's warm-up peak by ~0.04 GB (docs/14_memory_floor.md)."""
    return torch.compile(
        sgd_update, fullgraph=True, dynamic=False, options={"triton.autotune_pointwise": False}
    )


# ---------------------------------------------------------------------------------- choosing the rule
def _hyper(optimizer: torch.optim.Optimizer) -> tuple[list, dict[str, Any]]:
    if len(optimizer.param_groups) != 1:
        raise UsageError("--bf16-update supports one parameter group")
    group = optimizer.param_groups[0]
    return list(group["params"]), group


# ------------------------------------------------------------------- a kernel that applies no update
@functools.cache
def fused_cpu_sgd_drops_bf16_updates() -> bool:
    """Whether this torch's fused SGD kernel on the CPU leaves bf16 weights where they were, where the
    plain kernel moves them. torch 2.11's does: from zero weights, with lr 0.05 and gradients of ~1e-2
    (updates of ~5e-4, far above bf16's resolution there) it moved none of them, and the tiny SGD rungs
    stopped learning on a CPU (tests/training/techniques/test_memory_rungs.py); torch 2.14.1's moves all of them. A probe of
    the kernel, not a version check: one step each, from the same start, counted against fp32."""
    grad = (torch.randn(256, generator=torch.Generator().manual_seed(0)) * 1e-2).to(torch.bfloat16)
    moved = {}
    for fused in (False, True):
        w = torch.zeros(256, dtype=torch.bfloat16, requires_grad=True)
        w.grad = grad.clone()
        torch.optim.SGD([w], lr=0.05, fused=fused).step()
        moved[fused] = int((w.detach() != 0).sum())
    return moved[True] < moved[False] // 2


def unfuse_where_updates_drop(optimizer: torch.optim.Optimizer) -> bool:
    """Switch a fused SGD over bf16 CPU weights to the plain kernel when :func:`fused_cpu_sgd_drops_bf16_updates`
    (same update rule; ``fused`` is read at every step). Returns whether it switched."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    switched = False
    for group in optimizer.param_groups:
        on_cpu = any(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in group["params"])
        if group.get("fused") and on_cpu and fused_cpu_sgd_drops_bf16_updates():
            group["fused"] = False
            switched = True
    return switched


def replace(optimizer: torch.optim.Optimizer, update: str) -> torch.optim.Optimizer:
    """The same update rule as ``optimizer`` (same parameters and hyperparameters), with ``update``'s
    way of storing bf16 weights. ``plain`` returns ``optimizer`` itself."""
    if update == "plain":
        return optimizer
    if update not in BF16_UPDATES:
        raise UsageError(f"--bf16-update {update!r}: expected one of {', '.join(BF16_UPDATES)}")
    params, g = _hyper(optimizer)
    lr = float(g["lr"])
    kind = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD):
        if update == "stochastic":
            return StochasticRoundSGD(
                params,
                lr=lr,
                momentum=g.get("momentum", 0),
                dampening=g.get("dampening", 0),
                weight_decay=g.get("weight_decay", 0),
                nesterov=g.get("nesterov", False),
            )
        if g.get("momentum", 0) or g.get("weight_decay", 0) or g.get("nesterov", False):
            raise UsageError(
                "--bf16-update kahan: only plain SGD (no momentum, no weight decay) is supported"
            )
        return _optimi("SGD", params, lr=lr, kahan_sum=True)
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and not g.get("amsgrad", False):
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        if not decoupled and g.get("weight_decay", 0):
            raise UsageError("--bf16-update: Adam with (coupled) weight decay is not supported")
        hyper = dict(lr=lr, betas=tuple(g["betas"]), eps=g["eps"], weight_decay=g.get("weight_decay", 0))
        if update == "stochastic":
            return _torchao_adamw(params, **hyper, bf16_stochastic_round=True)
        if decoupled:
            return _optimi("AdamW", params, **hyper, decouple_lr=False, kahan_sum=True)
        return _optimi("Adam", params, **hyper, kahan_sum=True)
    if kind == "AdamW8bit":
        if update == "kahan":
            raise UsageError("--bf16-update kahan: 8-bit Adam has no Kahan variant; use stochastic")
        return type(optimizer)(
            params,
            lr=lr,
            betas=tuple(g["betas"]),
            eps=g["eps"],
            weight_decay=g["weight_decay"],
            amsgrad=g.get("amsgrad", False),
            block_size=getattr(optimizer, "block_size", 256),
            bf16_stochastic_round=True,
        )
    raise UsageError(f"--bf16-update {update}: not available for {kind}")


def _torchao_adamw(params, **kwargs) -> torch.optim.Optimizer:
    """torchao's fp32-state AdamW; its class is ``_AdamW`` in torchao 0.17-0.18 (``AdamW`` before)."""
    try:
        import torchao.optim as tao
    except ImportError:
        raise UsageError(
            "--bf16-update stochastic (the default of the bf16 rungs after 03) needs torchao for Adam:"
            ' python3 -m pip install -e ".[bf16]", or run with --bf16-update plain'
        ) from None
    cls = getattr(tao, "AdamW", None) or getattr(tao, "_AdamW", None)
    if cls is None:
        raise UsageError(f"--bf16-update stochastic: torchao {getattr(tao, '__version__', '?')} has no AdamW")
    return cls(params, **kwargs)


def _optimi(name: str, params, **kwargs) -> torch.optim.Optimizer:
    try:
        import optimi
    except ImportError:
        raise UsageError(
            '--bf16-update kahan needs torch-optimi: python3 -m pip install -e ".[bf16]"'
        ) from None
    return getattr(optimi, name)(params, **kwargs)


# --------------------------------------------------------------------------------------------- recipes
def updates(optimizer, cfg, results):
    """What a bf16 rung calls on its optimizer (or its dict of per-parameter optimizers): applies
    ``cfg.bf16_update`` (``--bf16-update``) and, with ``--lost-updates N``, attaches the measurement.
    ``results`` is the run's ``RunResults``: recorded in the results JSON under ``updates``. Returns the
    optimizer (or dict) to use."""
    rule = cfg.bf16_update or "plain"
    every = cfg.lost_updates
    probe = LostUpdates(results, every) if every else None
    if isinstance(optimizer, dict):
        out = {key: replace(o, rule) for key, o in optimizer.items()}
        chosen = list(out.values())
    else:
        out = replace(optimizer, rule)
        chosen = [out]
    if [o for o in chosen if unfuse_where_updates_drop(o)]:  # every one is checked: no short cut
        notice(
            f"[bf16] torch {torch.__version__}'s fused SGD on the CPU applies no bf16 update: the plain kernel steps instead"
        )
        results.updates["fused_cpu_sgd"] = "replaced by the plain kernel (it applied no bf16 update)"
    if probe is not None:
        for o in chosen:
            probe.attach(o)
    name = type(chosen[0]).__name__ if chosen else None
    results.updates.update(rule=rule, optimizer=f"{type(chosen[0]).__module__}.{name}" if chosen else None)
    if probe is not None:
        results.updates["lost"] = {"every": every, "columns": ["step", "lost", "unchanged"], "steps": []}
    return out

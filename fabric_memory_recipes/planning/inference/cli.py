"""``fmr-estimate --model SOURCE:NAME --infer``: the inference estimate (planning/inference/estimate.py) of a
causal LM's ``generate()`` at ``--batch-size`` x (``--seq-len`` prompt + ``--new-tokens``) with its KV cache in
``--kv-cache-dtype``, of an encoder-decoder's ``generate()`` (``--seq-len`` source tokens, ``--new-tokens``
written), or of one forward pass of an encoder or a vision model at ``--batch-size``; with
``--fit SIZE`` the largest batch, and for a causal LM the most new tokens, whose predicted whole-device
peak fits a card of SIZE.

Exit codes: 0 done (with --fit: something fits), 1 nothing fits, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from fabric_memory_recipes.config import UsageError
from fabric_memory_recipes.console import fail
from fabric_memory_recipes.measurement.card_overhead import overhead_per_gpu
from fabric_memory_recipes.measurement.results_file import gpu_slug
from fabric_memory_recipes.planning.inference.estimate import InferenceEstimate, estimate
from fabric_memory_recipes.planning.planner import cli as fit_cli
from fabric_memory_recipes.planning.your_model.estimate import meta_user_model
from fabric_memory_recipes.training.your_model import inference
from fabric_memory_recipes.training.your_model.models import POSITION_FIELDS

MOST = 1 << 20  # the search's ceiling for a batch or a count of tokens


def predict(
    cfg: Any,
    gpu: str = "h100",
    batch_size: int | None = None,
    new_tokens: int | None = None,
    capacity_gb: float | None = None,
) -> InferenceEstimate:
    """The estimate of ``cfg``'s inference call (its batch and new tokens unless given)."""
    um, model, _, _ = meta_user_model(cfg.model)
    return estimate(
        model,
        um,
        batch_size or cfg.batch_size,
        cfg.seq_len,
        new_tokens or cfg.new_tokens,
        cfg.precision,
        cfg.kv_cache_dtype,
        gpu,
        capacity_gb,
        cfg.weights_quant,
    )


def card_capacity_gb(budget_gb: float | None, gpu: str) -> float | None:
    """What the allocator may reserve on a card of ``budget_gb`` (None: no cap): the card less the
    inference overhead of ``gpu``, the cap ``--memory-budget-gb`` sets on the run (training/lifecycle.py)."""
    return None if budget_gb is None else budget_gb - (overhead_per_gpu(gpu, "inference", 1).gb or 0.0)


def for_run(cfg: Any) -> dict:
    """What ``recipes/your_model.py --infer`` records next to its measurement (an error is recorded, never raised).
    On an emulated card (``--memory-budget-gb``) the replay is capped as the run's allocator is: at the cap the
    allocator gives its free cached segments back before it asks for more, which a replay without the cap
    never does (a decode's growing KV cache then reserves many times the card)."""
    try:
        gpu = gpu_slug(torch.cuda.get_device_name()) if torch.cuda.is_available() else "h100"
        return predict(cfg, gpu, capacity_gb=card_capacity_gb(cfg.memory_budget_gb, gpu)).to_dict()
    except Exception as e:  # a prediction never stops the measurement
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def largest(fits: Callable[[int], bool], most: int = MOST) -> int:
    """The largest n in [1, most] with ``fits(n)`` (0: none), for a ``fits`` that stays false once false."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= most and fits(high):
        low, high = high, high * 2
    high = min(high, most + 1)
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def positions_left(cfg: Any) -> int:
    um = meta_user_model(cfg.model)[0]
    for name in POSITION_FIELDS:
        positions = getattr(um.hf_config, name, None)
        if isinstance(positions, int) and positions > 0:
            return positions - cfg.seq_len
    return MOST


def fit(cfg: Any, budget_gb: float, gpu: str) -> dict[str, Any]:
    """The largest batch at ``cfg``'s tokens, and for a causal LM the most new tokens at its batch, that fit."""
    seen: dict[tuple[int, int], InferenceEstimate] = {}

    capacity = card_capacity_gb(budget_gb, gpu)

    def fits(batch: int, new: int) -> bool:  # the replay on the card never runs out of memory
        if (batch, new) not in seen:
            seen[batch, new] = predict(cfg, gpu, batch, new, capacity_gb=capacity)
        return seen[batch, new].out_of_memory is None

    lm = meta_user_model(cfg.model)[0].task == "causal_lm"
    batch = largest(lambda b: fits(b, cfg.new_tokens))
    answer = {
        "budget_gb": budget_gb,
        "gpu": gpu,
        "model": cfg.model,
        "precision": cfg.precision,
        "weights_quant": cfg.weights_quant,
        "seq_len": cfg.seq_len,
        "largest_batch": batch or None,
        "at_largest_batch": seen[batch, cfg.new_tokens].to_dict() if batch else None,
    }
    if lm:
        answer["new_tokens"] = cfg.new_tokens
        answer["kv_cache_dtype"] = cfg.kv_cache_dtype
        new = largest(lambda n: fits(cfg.batch_size, n), positions_left(cfg))
        answer.update(
            batch_size=cfg.batch_size,
            most_new_tokens=new or None,
            at_most_new_tokens=seen[cfg.batch_size, new].to_dict() if new else None,
        )
    return answer


def run(args: Any, cfg: Any) -> int:
    try:
        um = meta_user_model(cfg.model)[0]
        inference.check(um, cfg)
    except UsageError as e:
        fail(str(e))
    if args.measure or args.may_change:
        fail("--infer --fit predicts only: --measure and --may-change go with training's --fit")
    if cfg.technique_flags():
        fail(f"--infer runs the model as built: {' '.join(cfg.technique_flags())} is training's")
    if args.fit:
        answer = fit(cfg, args.budget_gb, args.gpu)
        if args.json:
            print(json.dumps(answer, indent=2))
        else:
            print(fit_text(answer, args.fit))
        return 0 if answer["largest_batch"] or answer.get("most_new_tokens") else 1
    est = predict(cfg, args.gpu)
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
        return 0
    print(
        f"[{est.model}] inference, {est.task.replace('_', ' ')}: {est.shape()}, {est.precision}"
        + (f", {est.weights_quant} weights" if est.weights_quant != "none" else "")
        + (f", KV cache {cfg.kv_cache_dtype}" if est.new_tokens else "")
        + f" ({est.parameters / 1e6:.1f} M parameters)"
    )
    print(est.table())
    return 0


def fit_text(answer: dict[str, Any], size: str) -> str:
    card = fit_cli.budget_text(answer["budget_gb"], size)
    lines = [
        f"The largest inference that fits {card}: {answer['model']}, {answer['precision']}"
        + (f", {answer['weights_quant']} weights" if answer.get("weights_quant", "none") != "none" else "")
        + f", {answer['gpu']}"
    ]
    lm = "new_tokens" in answer
    what = (
        f"{answer['seq_len']} prompt + {answer['new_tokens']} new tokens"
        if lm
        else (
            f"{answer['seq_len']} tokens"
            if answer["at_largest_batch"] and answer["at_largest_batch"]["task"] != "image_classification"
            else "its image size"
        )
    )
    got = answer["at_largest_batch"]
    if got and got["task"] == "seq2seq_lm":  # an encoder-decoder's generate(): the source and its new tokens
        what = f"{answer['seq_len']} source tokens -> {got['new_tokens']} new tokens"
    lines.append(
        f"  largest batch at {what}: "
        + (
            f"{answer['largest_batch']} (predicted whole device {got['device_peak_gb']:.2f} GB)"
            if got
            else "none (batch 1 does not fit)"
        )
    )
    if lm:
        got = answer["at_most_new_tokens"]
        lines.append(
            f"  most new tokens at batch {answer['batch_size']} x {answer['seq_len']} prompt tokens: "
            + (
                f"{answer['most_new_tokens']} (predicted whole device {got['device_peak_gb']:.2f} GB)"
                if got
                else "none (1 new token does not fit)"
            )
        )
    return "\n".join(lines)

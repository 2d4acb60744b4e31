"""The estimate for a model the user names (``--model torchvision:|timm:|hf:``): one simulated training
step (:func:`~fabric_memory_recipes.planning.simulation.simulate.simulate`) of the model built on the meta device,
with the batch of its task, and the card: peak reserved and the whole-device peak.

Peak reserved = the simulated step's allocations and frees replayed through a model of the CUDA
caching allocator (planning/simulation/allocator.py: the weights, a first step that creates the optimizer state,
then steady steps; under fast mode's expandable segments, with an image model's CUDA graphs:
planning/simulation/expandable.py) x the largest measured/replayed ratio of the committed eager runs
(planning/reserved.py, 1.036). The replay is what tells a ResNet from a ViT: feature maps of many
sizes strand cached blocks that one ratio for every model cannot know (docs/your_model.md has the
measured rows). The whole-device peak adds the measured card overhead of the GPU kind
(measurement/card_overhead.py).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any

import torch

from fabric_memory_recipes.console import notice
from fabric_memory_recipes.measurement.card_overhead import overhead_mode, overhead_per_gpu
from fabric_memory_recipes.measurement.results_file import gpu_slug
from fabric_memory_recipes.planning.overhead import replayed_card
from fabric_memory_recipes.planning.plan import Estimate, Plan, allocator_of, expandable_in, plan_for
from fabric_memory_recipes.planning.simulation.costs import OpCosts
from fabric_memory_recipes.planning.simulation.simulate import failed, simulate
from fabric_memory_recipes.planning.your_model import saved_file
from fabric_memory_recipes.techniques import ACTIVATION_CHECKPOINTING, flagged, switches
from fabric_memory_recipes.training.techniques import lora, module_of
from fabric_memory_recipes.training.your_model import models, sharding
from fabric_memory_recipes.training.your_model.models import UserModel
from fabric_memory_recipes.training.your_model.regions import meta_twin
from fabric_memory_recipes.training.your_model.runner import YourModelConfig


@functools.cache
def meta_user_model(
    ref: str, lora_rank: int = 0, lora_targets: str | None = None
) -> tuple[UserModel, Any, tuple[str, ...], str]:
    """The user's model on the meta device: (the resolved model, the model, its repeated blocks, how
    they were found); with ``lora_rank``, LoRA's adapters added as the runner adds them
    (training/techniques/lora.py), so that only they and the head train."""
    um = models.resolve(ref)
    model = models.build_on_meta(um)
    with torch.device("meta"):
        blocks, found_by = models.repeated_blocks(model)
        if lora_rank:
            lora.add_adapters(model, um.source, um.task, blocks, lora_rank, lora_targets)
    return um, model, blocks, found_by


def text_batch(um: UserModel, micro_batch_size: int, seq_len: int, target_len: int | None = None):
    """(make_batch, batch_fn) of a text model: token ids, an attention mask and the labels, padded to
    ``seq_len`` as the runner's data are (training/data/text.py; an encoder-decoder's target to
    ``target_len``, else ``seq_len``: training/data/seq2seq.py); the loss is the model's own."""
    shape = {
        "causal_lm": (micro_batch_size, seq_len),
        "seq2seq_lm": (micro_batch_size, target_len or seq_len),
    }

    def make():
        ids = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        mask = torch.ones(micro_batch_size, seq_len, dtype=torch.long)
        return ids, mask, torch.zeros(shape.get(um.task, (micro_batch_size,)), dtype=torch.long)

    return make, _model_loss


def _model_loss(model, batch):
    """A text model's batch function: its own loss."""
    input_ids, attention_mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    return out.loss, out.logits, labels


def sharding_of(fsdp: bool, compile: bool, precision: str) -> dict[str, Any]:
    """The plan's sharding fields of a run with these flags: none; FSDP1 (eager mode); FSDP2 in fast mode
    (training/your_model/sharding.py), gathering in the compute dtype of a "-mixed" precision."""
    if not fsdp:
        return {"sharding": "none"}
    if not sharding.fully_sharded(compile, precision):
        return {"sharding": "fsdp"}
    return {"sharding": "fsdp2", "mixed_precision_policy": precision in sharding.LOW}


def partitioned_blocks(um: UserModel, blocks: tuple[str, ...]) -> tuple[str, ...]:
    """The blocks whose compiled step the estimate runs as inductor partitions it (plan.compiled_blocks): an
    encoder-decoder's, all of which fast mode compiles (training/your_model/models.py ``compile_repeated``). T5-small's
    compiled blocks kept a third less for backward than their eager graph on an H200
    (planning/simulation/compiled/partition.py); the ladder's ViT's compiled blocks keep what eager keeps
    (its fast rungs' measured peaks within 0.1 % of the eager graph's), and each traced block costs the
    simulation about a second, so the other models' compiled blocks run their eager graph."""
    return blocks if um.task == "seq2seq_lm" else ()


def plan_of(
    cfg: YourModelConfig,
    blocks: tuple[str, ...],
    expandable: bool | None = None,
    um: UserModel | None = None,
) -> Plan:
    """The runner's flags as the estimator's plan: checkpointing and FSDP units are the found blocks (FSDP1 in
    eager mode, FSDP2 in fast mode: :func:`sharding_of`); the techniques' options (the checkpoint mode) are
    the plan's fields of the same names. ``expandable``: whether the run's allocator has expandable segments
    (planning/plan.py ``allocator_of``; fast mode sets them also where the runner then turns the CUDA graphs
    off: a text model's). The plan records whether the run compiles its blocks; in fast mode the step runs the
    blocks :func:`partitioned_blocks` names for ``um`` as inductor partitions them, the rest as the eager graph."""
    options = {o.field: getattr(cfg, o.field) for t in flagged() for o in t.options}
    return plan_for(
        cfg,
        allocator=allocator_of(cfg, expandable),
        activation_checkpointing=blocks if cfg.uses(ACTIVATION_CHECKPOINTING) else (),
        **sharding_of(cfg.fsdp, cfg.compile, cfg.precision),
        shard_units=blocks,
        world_size=cfg.world_size if cfg.fsdp else 1,
        compile=bool(cfg.compile),  # fast mode: compiled blocks
        compiled_blocks=partitioned_blocks(um, blocks) if cfg.compile and um is not None else (),
        switched=tuple(t.name for t in switches() if cfg.uses(t)),
        **options,
    )


def estimate(
    model: Any,
    um: UserModel,
    plan: Plan,
    seq_len: int,
    op_costs: OpCosts | None = None,
    target_len: int | None = None,
) -> Estimate:
    """One simulated step of ``model`` (any device: only shapes are read) under ``plan``; ``op_costs``
    collects what each of its ops costs (planning/simulation/costs.py); ``target_len``: an
    encoder-decoder's target tokens (default ``seq_len``)."""
    make = batch_fn = None
    if um.is_text:
        make, batch_fn = text_batch(um, plan.micro_batch_size, seq_len, target_len)
    if plan.switched:  # what the switches do (the fused loss: no logits), on a copy: the model may be shared
        model, batch_fn = _switched(model, plan.switched, batch_fn)
    return simulate(model, plan, make_batch=make, batch_fn=batch_fn, model_name=um.ref, op_costs=op_costs)


def _switched(model: Any, switched: tuple[str, ...], batch_fn: Any) -> tuple[Any, Any]:
    """A copy of ``model`` with the switches on, and the batch function they give; made once per model, switches
    and batch function (a simulation leaves the model it ran as it was: the next one may run the same). The
    copy is on the meta device: the simulation reads only shapes, and the runner's model is the one on the
    GPU (a real copy held 1.47 GB of a 0.36 B Llama's weights for the whole run, beside the model)."""
    made = _SWITCHED.setdefault(model, {})
    if (switched, batch_fn) not in made:
        copied = meta_twin(model)  # a LoRA model takes a second
        fn = batch_fn
        for t in (t for t in switches() if t.name in switched):
            fn = module_of(t).apply(copied, fn)
        made[switched, batch_fn] = copied, fn
    return made[switched, batch_fn]


_SWITCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(switches, batch_fn): made}


def card(
    est: Estimate, gpu: str = "h100", mode: str = "eager", devices: int = 1, allocator: str | None = None
) -> dict[str, Any]:
    """Peak reserved and whole-device peak of ``est`` on a card of kind ``gpu`` (:data:`RESERVED_RULE`,
    planning/overhead.py: :func:`replayed_card`, as the ladder's estimate takes it), per GPU; ``devices`` >
    1 (``--fsdp``): the measured overhead per GPU of that many processes. ``allocator``: the replay under
    that caching-allocator setting (plan.ALLOCATORS), by default the estimate's plan's."""
    over = overhead_per_gpu(gpu, mode, devices)
    if est.peak_gb is None:
        return {"peak_reserved_gb": None, "device_peak_gb": None, "overhead_legend": over.phrase(devices)}
    replayed = (
        est.reserved_gb if allocator is None else est.reserved_by_allocator.get(allocator, est.reserved_gb)
    )
    replayed = replayed if replayed is not None else est.peak_gb  # a CPU plan: no allocator
    return {**replayed_card(replayed, over, devices), "gpu": gpu, "mode": mode, "devices": devices}


def run_card(est: Estimate, cfg: YourModelConfig, gpu: str) -> dict[str, Any]:
    """:func:`card` of a run of ``cfg`` on a ``gpu``: per GPU of its ``--fsdp`` processes, with the overhead of
    its mode (fast mode compiles a text model's blocks without CUDA graphs: the compiled runs' overhead)."""
    devices = cfg.devices if getattr(cfg, "fsdp", False) else 1  # processes per machine, each a GPU
    return card(est, gpu, overhead_mode(cfg.flags()), devices)  # as --memory-budget-gb caps the run


def for_user_run(
    model: Any, um: UserModel, cfg: YourModelConfig, blocks: tuple[str, ...]
) -> tuple[Estimate, dict]:
    """What the runner records next to its measurement (never stops the run: a failed prediction is
    recorded with its error)."""
    plan = None
    try:  # the allocator's setting as this process has it (fast mode sets it before CUDA starts)
        expandable = expandable_in(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        plan = plan_of(cfg, blocks, expandable, um)
        est = estimate(
            model, um, plan, getattr(cfg, "seq_len", 0), target_len=getattr(cfg, "target_len", None)
        )
    except Exception as e:
        est = failed(plan, um.ref, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    gpu = gpu_slug(torch.cuda.get_device_name()) if torch.cuda.is_available() else "h100"
    predicted = run_card(est, cfg, gpu)
    if not getattr(
        cfg, "fsdp", False
    ):  # the checkpoint file --checkpoint-every writes (FSDP: a folder of shards)
        try:
            predicted["checkpoint_file"] = saved_file.predict(model, cfg).to_dict()
        except Exception as e:
            predicted["checkpoint_file"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    if est.error:
        notice(f"[estimate] could not estimate memory: {est.error}")
    else:
        notice(
            f"[estimate] predicted peak {est.peak_gb:.3g} GB allocated, {predicted['peak_reserved_gb']:.3g} GB"
            f" reserved ({est.peak_phase}, {est.seconds:.1f} s)"
        )
    return est, predicted

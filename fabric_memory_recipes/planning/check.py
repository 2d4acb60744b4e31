"""Predicted against measured: every results JSON of a folder next to its prediction."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fabric_memory_recipes.config import RENAMED_FIELDS, VIT_MODELS, RunConfig
from fabric_memory_recipes.console import program
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.measurement.results_file import SCHEMA_VERSION, estimate_error_pct, gpu_slug
from fabric_memory_recipes.planning.overhead import card_prediction, predicted_reserved
from fabric_memory_recipes.planning.plan import Estimate, Plan, allocator_of, expandable_in, plan_for
from fabric_memory_recipes.planning.simulation.cache import SimulationCache, ladder_key
from fabric_memory_recipes.planning.simulation.simulate import simulate
from fabric_memory_recipes.training.models import meta_ladder_model

# JSON files that sit beside the results and are not runs: the ladder's manifest and prediction,
# timelines, the other ranks' files
COMPANION = re.compile(r"^(run_all|predicted)\.json$|-timeline\.json$|\.rank\d+\.json$")
UNREADABLE, NOT_RESULTS = (
    "unreadable",
    f"not a schema-{SCHEMA_VERSION} results file",
)  # the reasons that name their file


def why_unreadable(error: Exception) -> str:
    """A JSON file that could not be read, in a few words: empty, truncated, not UTF-8, or the OS error."""
    if isinstance(error, json.JSONDecodeError):
        return (
            "empty" if not error.doc.strip() else f"truncated or not JSON: {error.msg}, line {error.lineno}"
        )
    if isinstance(error, OSError):
        return error.strerror or type(error).__name__
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def skipped_summary(dirs: list[str], skipped: list[tuple[str, str]], compared: int) -> list[str]:
    """What ``--check`` says about the files it did not compare, on stderr: with nothing compared, one
    line saying why; otherwise one line naming the files that could not be read or are not results
    (the runs it does not compare by design, CPU or unsuccessful ones, are counted in that line only
    when nothing was compared)."""
    named = [f"{Path(f).name}: {why}" for f, why in skipped if why.startswith((UNREADABLE, NOT_RESULTS))]
    if compared:
        return [f"--check: skipped {len(named)} file(s): {'; '.join(named)}"] if named else []
    counts = Counter(why for _, why in skipped if not why.startswith((UNREADABLE, NOT_RESULTS)))
    found = [f"{n} {why}" for why, n in sorted(counts.items())] + named
    return [
        f"--check {' '.join(dirs)}: nothing to compare: no results JSON of a ViT rung measured on a CUDA GPU"
        f" with status ok (found: {'; '.join(found) or 'no JSON files'})"
    ]


def _skip_reason(result: Any) -> str | None:
    """Why a parsed JSON is not compared (a short phrase, counted in the summary line), or None."""
    if (
        not isinstance(result, dict)
        or result.get("schema_version") != SCHEMA_VERSION
        or not result.get("recipe")
    ):
        return NOT_RESULTS
    if result.get("status") != "ok":
        return f"status {result.get('status')}"
    if (result.get("memory") or {}).get("kind") != "cuda":
        return "measured on the CPU"
    return None


# What a results JSON's ``estimate.assumptions`` record of the plan its run simulated: what the run
# built or declared beyond its flags (rung 16's activation offload, say), taken as recorded.
PLAN_FIELDS = {f.name for f in dataclasses.fields(Plan)}  # a run may record more (your model's fused_loss)
RECORDED_PLAN = (
    "precision",
    "micro_batch_size",
    "accumulation_steps",
    "optimizer",
    "optimizer_impl",
    "activation_checkpointing",
    "checkpoint_mode",
    "sharding",
    "mixed_precision_policy",
    "shard_units",
    "world_size",
    "cpu_offload",
    "activation_offload",
    "optimizer_in_backward",
    "weights_offload",
    "fused_loss",
)


def _rerun(result: dict[str, Any]) -> tuple[Any, Plan, str | None, dict[str, Any]]:
    """(model, plan, model name, what the simulation depends on) of a committed run simulated again."""
    rung, _ = declared_rung(result["recipe"])
    config = result.get("config") or {}
    flags = {f.name for f in RunConfig.flag_fields()}
    cfg = rung.with_flags(**{**{k: v for k, v in config.items() if k in flags}, "accelerator": "cuda"})
    assumed = ((result.get("estimate") or {}).get("assumptions")) or {}
    assumed = {RENAMED_FIELDS.get(k, k): v for k, v in assumed.items()}
    plan = plan_for(
        cfg,
        allocator=recorded_allocator(result, cfg),
        **{k: assumed[k] for k in RECORDED_PLAN if k in assumed and k in PLAN_FIELDS},
    )
    name, size = config.get("model"), config.get("image_size")
    model = meta_ladder_model(name or "vit_l_16", fused_attention=cfg.fused_attention, image_size=size)
    return model, plan, name, ladder_key(plan, name, size, cfg.fused_attention)


def recorded_allocator(result: dict[str, Any], cfg: RunConfig) -> str:
    """The caching allocator a committed run of ``cfg`` trained under (plan.ALLOCATORS): its steps CUDA graphs
    as its config recorded (none where it recorded no ``cuda_graphs``: a run from before fast mode), its
    allocator's expandable segments as its ``provenance.cuda_alloc_conf`` says (where it recorded none, as
    fast mode sets them: with the CUDA graphs)."""
    provenance = result.get("provenance") or {}
    expandable = expandable_in(provenance["cuda_alloc_conf"]) if "cuda_alloc_conf" in provenance else None
    graphs = bool((result.get("config") or {}).get("cuda_graphs"))
    return allocator_of(dataclasses.replace(cfg, cuda_graphs=graphs), expandable)


def simulate_run(result: dict[str, Any]) -> Estimate:
    """A committed run's step simulated again on a CPU (its allocations replayed: ``reserved_gb``): the
    config it recorded on its recipe's declared rung, for CUDA, with the plan its recorded estimate
    assumed where it says one (:data:`RECORDED_PLAN`)."""
    model, plan, name, _ = _rerun(result)
    return simulate(model, plan, model_name=name)


def replayed_of(result: dict[str, Any], cache: SimulationCache) -> float | None:
    """The replayed peak reserved of a committed run's step (:func:`simulate_run`), from ``cache`` when
    it holds it; None when the simulation fails."""
    model, plan, name, key = _rerun(result)
    try:
        simulated = cache.lookup(
            key, lambda: simulate(model, plan, model_name=name), result["recipe"], plan.allocator
        )
        return simulated[2]
    except RuntimeError:
        return None


def _replays(result: dict[str, Any]) -> bool:
    """Whether the check needs the run's allocator replay: a one-GPU run that measured peak reserved
    (several processes take the sharded ratio: planning/overhead.py)."""
    memory, prov = result.get("memory") or {}, result.get("provenance") or {}
    return prov.get("world_size", 1) == 1 and memory.get("run_peak_reserved_gb") is not None


def check_results(
    dirs: list[str],
    skipped: list[tuple[str, str]] | None = None,
    say: Callable[[str], None] | None = None,
    cache: SimulationCache | None = None,
) -> list[dict[str, Any]]:
    """Compare every results JSON in ``dirs`` with its prediction: the one the recipe recorded
    (``estimate``), or, for runs made before recipes recorded one, a prediction from the recorded
    config and the recipe's declared rung. Only runs measured on CUDA with status ok are compared, and
    only the ViT rungs (the estimator does not model the Hugging Face bonus models). ``skipped``, when
    given, receives (file, why) for every other JSON file (its companions excepted: ``COMPANION``);
    ``say``, when given, takes :func:`skipped_summary`'s lines, each starting with the program's name.
    A one-GPU run whose estimate did not record its allocator replay is replayed again (:func:`replayed_of`,
    simulations kept in ``cache``, by default the planner's file)."""
    skipped = [] if skipped is None else skipped
    rows = []
    for d in dirs:
        for path in sorted(Path(d).glob("*.json")):
            if COMPANION.search(path.name):
                continue
            try:
                result = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                skipped.append((str(path), f"{UNREADABLE} ({why_unreadable(e)})"))
                continue
            reason = _skip_reason(result)
            if reason is None and declared_rung(result["recipe"])[0].model not in VIT_MODELS:
                reason = "a model the estimator does not check (not a ViT rung)"
            if reason is not None:
                skipped.append((str(path), reason))
                continue
            config = result.get("config") or {}
            recorded = result.get("estimate") or {}
            replayed = recorded.get("peak_reserved_simulated_gb")
            if recorded.get("peak_allocated_gb") is None:
                recorded = simulate_run(result).to_dict()
                replayed = recorded["peak_reserved_simulated_gb"]
            elif replayed is None and _replays(result):
                cache = cache or SimulationCache()
                replayed = replayed_of(result, cache)
            rows.append(
                {
                    **device_check(result, recorded["peak_allocated_gb"], replayed),
                    "file": str(path),
                    "recipe": result["recipe"],
                    "gpu": (result.get("provenance") or {}).get("gpu_name"),
                    "world_size": (result.get("provenance") or {}).get("world_size", 1),
                    "compile": bool(config.get("compile")),
                    "predicted_gb": recorded["peak_allocated_gb"],
                    "measured_gb": result["memory"]["peak_allocated_gb"],
                    "error_pct": estimate_error_pct({**result, "estimate": recorded}),
                    "peak_phase": recorded.get("peak_phase"),
                    "activations_saved_gb": recorded.get("activations_saved_gb"),
                }
            )
    for line in skipped_summary(dirs, skipped, len(rows)) if say is not None else []:
        say(f"{program()}: {line}")
    return rows


def _pct(predicted: float | None, measured: float | None) -> float | None:
    return None if predicted is None or not measured else 100.0 * (predicted - measured) / measured


def device_check(
    result: dict[str, Any], allocated_gb: float | None, replayed_gb: float | None = None
) -> dict[str, Any]:
    """The card-level check of one run: predicted peak reserved (the step's allocator replay
    ``replayed_gb``; several processes: the sharded ratio) and whole-device peak (that + the measured
    card overhead: fabric_memory_recipes.planning.overhead.card_prediction) against what the run
    measured, per GPU: with several processes on the machine, their measured overhead per GPU (NCCL's
    buffers too)."""
    memory, config = result.get("memory") or {}, result.get("config") or {}
    prov = result.get("provenance") or {}
    devices = int(config.get("devices") or 1) if prov.get("world_size", 1) > 1 else 1
    card = card_prediction(
        allocated_gb,
        replayed_gb=replayed_gb,
        graphs=bool(config.get("cuda_graphs")),
        compiled=bool(config.get("compile")),
        gpu=gpu_slug(prov.get("gpu_name")),
        devices=devices,
    )
    predicted, device = predicted_reserved(card)
    reserved = memory.get("run_peak_reserved_gb")
    measured = memory.get("device_peak_gb")
    return {
        "predicted_reserved_gb": predicted,
        "measured_reserved_gb": reserved,
        "reserved_error_pct": _pct(predicted, reserved),
        "predicted_device_gb": device,
        "measured_device_gb": measured,
        "device_error_pct": _pct(device, measured),
        "overhead_gb": card["overhead_gb"],
        "measured_overhead_gb": memory.get("device_overhead_gb"),
        "overhead_source": card["overhead_source"],
        "device_method": memory.get("device_method"),
    }


def _cell(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render_check(rows: list[dict[str, Any]], tolerance_pct: float = 5.0) -> str:
    """Predicted vs measured as a markdown table: peak allocated, and where the runs measured it, peak
    reserved (the allocator replay) and the whole-device peak (that + the card overhead) with the
    overheads, and a summary."""
    device = any(r.get("measured_device_gb") is not None for r in rows)
    extra = " predicted reserved GB | measured reserved GB | reserved error | predicted device GB | measured device GB | device error | overhead used / measured GB |"
    lines = [
        "| run | GPU | compile | predicted GB | measured GB | error |" + (extra if device else ""),
        "|---|---|---|---:|---:|---:|" + ("---:|" * 7 if device else ""),
    ]
    for r in rows:
        gpu = (r["gpu"] or "?").replace("NVIDIA ", "")
        if r["world_size"] and r["world_size"] > 1:
            gpu = f"{r['world_size']}× {gpu} (per GPU)"
        line = (
            f"| `{r['file']}` | {gpu} | {'on' if r['compile'] else 'off'} | {r['predicted_gb']:.3f} |"
            f" {r['measured_gb']:.3f} | {_cell(r['error_pct'], '+.1f')}% |"
        )
        if device:
            line += (
                f" {_cell(r.get('predicted_reserved_gb'), '.3f')} | {_cell(r.get('measured_reserved_gb'), '.3f')} |"
                f" {_cell(r.get('reserved_error_pct'), '+.1f')}% |"
                f" {_cell(r.get('predicted_device_gb'), '.3f')} | {_cell(r.get('measured_device_gb'), '.3f')} |"
                f" {_cell(r.get('device_error_pct'), '+.1f')}% |"
                f" {_cell(r.get('overhead_gb'), '.3f')} / {_cell(r.get('measured_overhead_gb'), '.3f')} |"
            )
        lines.append(line)
    if device:
        lines += ["", *device_summary(rows, tolerance_pct)]
    return "\n".join(lines)


def device_summary(rows: list[dict[str, Any]], tolerance_pct: float = 5.0) -> list[str]:
    """How far the predicted peaks reserved and whole-device peaks are from the measured ones, and the
    overheads used."""
    out = []
    for key, what in (("reserved_error_pct", "Peak reserved"), ("device_error_pct", "Whole-device peak")):
        errors = [r[key] for r in rows if r.get(key) is not None]
        if errors:
            within = sum(abs(e) <= tolerance_pct for e in errors)
            out.append(
                f"{what}: {len(errors)} runs, error {min(errors):+.1f}% to {max(errors):+.1f}%;"
                f" {within} of {len(errors)} within ±{tolerance_pct:g}%"
            )
    missing = [
        r["file"]
        for r in rows
        if r.get("measured_device_gb") is not None and r.get("predicted_device_gb") is None
    ]
    if missing:
        out.append(
            f"No whole-device prediction for {len(missing)} runs (no measured overhead for their GPU kind)"
        )
    for source in sorted({r["overhead_source"] for r in rows if r.get("overhead_source")}):
        out.append(f"- overhead: {source}")
    return out

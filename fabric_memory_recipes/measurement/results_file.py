"""The results file: one JSON per run, what every run measured about itself (written by ``RunResults``).

Results JSON (``runs/<recipe>[-<tag>].json`` by default: ``--results-dir``), schema version 1. The report reads these keys only.
A run that did not succeed never replaces a successful result: it is written beside it as
``<recipe>[-<tag>].<status>.json`` (e.g. ``01_baseline.interrupted.json``; ``fabric_memory_recipes.faults.results_file``).

===============================  ===========================================================================
key                              meaning
===============================  ===========================================================================
schema_version                   1
recipe, tag, description         which script ran (tag: the --tag suffix or null)
mode                             "fast" (CUDA: compiled blocks, each optimizer step one CUDA graph where the
                                 rung uses them; config.compile / config.cuda_graphs say which) | "eager"
status                           "ok" | "oom" (CUDA out of memory, caught) | "error" | "interrupted"
                                 (stopped by SIGINT/SIGTERM/SIGUSR1/SIGHUP at an optimizer-step boundary: the
                                 measurements cover the steps taken)
error                            first line of the error ("SIGTERM at step 7 of 100" when interrupted),
                                 or null
config                           every parsed flag (plus micro_batch_size)
provenance                       device ("cuda"/"cpu"), gpu_name, world_size, num_nodes, versions (torch,
                                 lightning, torchvision, python, cuda), float32_matmul_precision ("high"
                                 means TF32 matmuls), cuda_alloc_conf (PYTORCH_CUDA_ALLOC_CONF), data_source ("cifar10"/"synthetic"), weights
                                 ("pretrained"/"random"), model, parameters, timestamp (UTC ISO 8601);
                                 data_source is "cifar10"/"digits"/"synthetic" for images (only real
                                 data makes accuracy a score; digits: fabric_memory_recipes/training/data/digits.py);
                                 text runs (bonus recipes) also tokens_per_sample (the padded sequence
                                 length), data_detail, and data_source "imdb"/"synthetic"
memory.kind                      "cuda": torch.cuda.max_memory_allocated/reserved, reset at the start of
                                 every phase; "cpu_rss": process peak resident set size (cannot be reset;
                                 each phase shows the peak so far)
memory.unit                      "GB" (1e9 bytes, as the article prints them)
memory.phases.<name>             {peak_allocated_gb, peak_reserved_gb, per_rank: [{rank, allocated_gb,
                                 reserved_gb}]}: max over ranks; phases are named by the recipe
                                 ("model_load", "train", "eval", ...)
memory.peak_allocated_gb         the "train" phase peak (max over ranks): the number the ladder compares
memory.peak_reserved_gb          likewise, reserved by the caching allocator
memory.run_peak_allocated_gb     the largest phase peak: the whole run (model load, training, evaluation)
memory.run_peak_reserved_gb      likewise, reserved
memory.device_peak_gb            CUDA: this process's whole-device peak (max over ranks), sampled every
                                 device_interval_s from before the device is touched to the end of the run:
                                 what a card must hold (fabric_memory_recipes/measurement/device_memory.py);
                                 null with device_note saying why when nothing could measure it
memory.device_method             "nvml-process" (NVML's entry for this process) | "nvml-device" (NVML's
                                 device-wide used less device_baseline_gb) | "mem_get_info" (total - free
                                 of the whole GPU: this process's only on a GPU of its own) | null
memory.device_baseline_gb        device memory in use when the sampler started, before this process made
                                 its CUDA context (nvml methods; subtracted by nvml-device), else null
memory.device_overhead_gb        device_peak_gb - run_peak_reserved_gb: what the process holds outside the
                                 caching allocator (CUDA context, library handles, kernels); the planner's
                                 card overhead is measured from it (fabric_memory_recipes/planning/overhead.py)
memory.device_note               the method's caveat, or why there is no reading
memory.device_samples            readings taken; device_interval_s the polling interval (s)
memory.device_per_rank           several ranks: [{rank, device_peak_gb, device_baseline_gb}], else null
memory.phases.<name>.device_peak_gb
                                 the phase's whole-device peak (max over ranks; per_rank[].device_gb)
memory.warmup                    CUDA: {steps, peak_allocated_gb, peak_reserved_gb} over the first ``steps``
                                 optimizer steps of training (compilation, CUDA-graph capture, optimizer
                                 state created); null without it. The "train" phase peak is the larger of
                                 this and memory.steady
memory.steady                    {peak_allocated_gb, peak_reserved_gb} after the warm-up steps
memory.timeline                  --memory-timeline: {html, png, json, device, peak_gb, peak_attributed_gb, steps}:
                                 the torch.profiler memory timeline by category (files next to this JSON) and its
                                 peak, whole and without what the profiler could not attribute; else null
memory.snapshot                  --snapshot: path of the CUDA allocator history pickle (memory_viz), else null
estimate                         the predicted peak (fabric_memory_recipes.planning, made before the run): {
                                 peak_allocated_gb, components_gb {parameters, gathered_parameters,
                                 weight_copies, gradients, optimizer_state, activations, temporaries, inputs,
                                 workspace} (GB at the predicted peak), peak_phase, static_gb {weights,
                                 gradients, optimizer_state}, activations_saved_gb (one micro-batch's
                                 forward), peak_reserved_simulated_gb (the step replayed through a model of
                                 the caching allocator, planning/simulation/allocator.py; null off CUDA), parameters
                                 {total, trainable}, assumptions {method, device,
                                 attention_kernel, compile, compile_modelled, precision, micro_batch_size,
                                 accumulation_steps, optimizer, optimizer_impl, activation_checkpointing, sharding,
                                 mixed_precision_policy, shard_units, world_size, cpu_offload, weights_offload,
                                 workspace_gb},
                                 kernels, model, seconds, error}; null when the recipe made none. Compare it with
                                 memory.peak_allocated_gb (per device)
timing.train_wall_s              wall time of the training loop (start-up and evaluation excluded)
timing.median_step_s             median time between consecutive optimizer steps, after warm-up steps
timing.images_per_s              effective batch x world size / median_step_s (all ranks together);
                                 null for text runs
timing.samples_per_s             the same rate for any kind of sample (images, reviews, SFT examples)
timing.tokens_per_s              text runs: samples_per_s x provenance.tokens_per_sample (padded tokens
                                 through the model, all ranks together); null for images
timing.optimizer_steps           optimizer steps taken; micro_batches, images_seen (per rank x world size)
timing.warmup_steps              steps left out of the median (first steps pay for allocation/autotuning)
timing.step_s                    {min, p10, median, p90, max} of the timed step intervals (s): the spread
timing.intervals_s               every interval between consecutive optimizer steps (s), warm-up included
accuracy.{train,val,test}        fraction correct (train: over the last logged window of the run;
                                 bonus_llm_finetune: next-token accuracy on completion tokens)
loss.{first,last}                training loss of the first and last logged window
loss.curve                       [[optimizer step, mean training loss of the window ending there], ...]:
                                 one point every --log-every steps (and the last, partial window)
updates.rule                     --bf16-update of the run ("plain"/"stochastic"/"kahan"); null when the
                                 recipe does not route its optimizer through fabric_memory_recipes.training.techniques.bf16
updates.optimizer                the optimizer class that stepped (module.Class), null likewise
updates.lost                     --lost-updates N: {every, columns ["step", "lost", "unchanged"], steps
                                 [[step, lost, unchanged], ...], mean_lost, mean_unchanged, last_lost}:
                                 per sampled step, the fraction of parameters whose update would move
                                 them in fp32 but whose effective weight did not move, and of stored
                                 weights that did not move (fabric_memory_recipes/training/techniques/bf16.py); null without the flag
extra                            recipe-specific measurements (e.g. rung 07's two ways of loading);
                                 set by the loop: resumed_from {path, step} (a resumed run), stopped
                                 {signal, step, planned_steps, checkpoint (to resume from, or null)}
                                 (an interrupted run); with --memory-budget-gb, memory_budget {budget_gb
                                 (the emulated card), allocator_gb (the allocator's cap: budget less
                                 overhead_gb, the card overhead, from overhead_source), device_total_gb,
                                 fraction, how} (fabric_memory_recipes.training.lifecycle.apply_memory_budget)
===============================  ===========================================================================
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import json
import os
import re
import statistics
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fabric_memory_recipes import paths

SCHEMA_VERSION = 1
GB = 1e9
WARMUP_STEPS = 3  # step intervals left out of the median: the first steps pay for allocation/autotuning
# The predicted ladder beside a results folder (fabric_memory_recipes/planning/ladder.py writes it, the report reads it):
# {schema_version, what, method, rows: [{recipe, peak_allocated_gb, peak_phase, components_gb, static_gb,
# config {model, precision, batch_size, accumulation_steps, micro_batch_size, devices, optimizer,
# sharding}, seconds, error}]}
PREDICTED_FILE = "predicted.json"
PREDICTED_LABEL = "predicted (ViT-L/16, GPU config)"

# Dense bf16 tensor-core peaks from the vendors' datasheets (FLOP/s), for model FLOPs utilisation.
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L4": 121e12, "A10G": 70e12}


def peak_bf16_flops(gpu_name: str | None) -> float | None:
    """The datasheet bf16 peak for a GPU name such as 'NVIDIA H100 80GB HBM3' (None if unknown)."""
    for key, flops in PEAK_BF16_FLOPS.items():
        if gpu_name and key in gpu_name:
            return flops
    return None


def utilisation(flops_per_step: float, median_step_s: float | None, gpu_name: str | None) -> dict:
    """Model FLOPs utilisation (rung 15): a step's model FLOPs over its median time, against the GPU's
    datasheet bf16 peak; the results' ``extra`` keys (None where the time or the peak is unknown)."""
    peak = peak_bf16_flops(gpu_name)
    achieved = flops_per_step / median_step_s if median_step_s else None
    return {
        "model_flops_per_step": flops_per_step,
        "achieved_tflops": achieved / 1e12 if achieved else None,
        "mfu": achieved / peak if achieved and peak else None,
        "mfu_peak_tflops": peak / 1e12 if peak else None,
    }


def gpu_slug(name: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; no GPU -> 'cpu' (results folders and the planner's GPU kinds)."""
    if not name:
        return "cpu"
    match = re.search(r"\b([A-Z]+\d{2,4}[A-Z]?)\b", name.upper().replace("NVIDIA", ""))
    return (match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")).lower()


def results_path(results_dir: str, recipe: str, tag: str | None = None) -> str:
    return os.path.join(results_dir, f"{recipe}-{tag}.json" if tag else f"{recipe}.json")


def write_atomic(path: str | os.PathLike, write: Any, binary: bool = False) -> None:
    """``write(f)`` into a temporary file in the same folder, then rename: a reader never sees half a
    file (results JSON, the rendered README, the figure). Inside ``results/published/`` only with
    ``FMR_PUBLISH=1`` (``fabric_memory_recipes.paths``; commands check their outputs at their start)."""
    paths.check_not_published(path, "cannot write")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(str(path))[1], dir=folder)
    os.chmod(tmp, paths.shared_mode())  # mkstemp makes 0600; results are meant to be shared like any file
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@functools.cache
def kinds_table(path: str) -> dict[str, Any]:
    """A committed table per GPU kind (``{"kinds": {gpu: ...}}``: the card overheads, the step time's ceilings, the
    measured matrix products), read once; an empty one when the file is missing or unreadable."""
    try:
        table = json.loads(Path(path).read_text())
        return table if isinstance(table.get("kinds"), dict) else {"kinds": {}}
    except (OSError, ValueError, AttributeError):
        return {"kinds": {}}


def write_json_atomic(path: str, payload: dict) -> None:
    def dump(f) -> None:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")

    write_atomic(path, dump)


def estimate_error_pct(result: dict) -> float | None:
    """(predicted - measured) / measured of the train-phase peak allocated of a results payload, in %;
    None without both numbers, for a run that did not finish, or when the measurement is CPU RSS (not
    comparable with a GPU prediction)."""
    predicted = (result.get("estimate") or {}).get("peak_allocated_gb")
    memory = result.get("memory") or {}
    measured = memory.get("peak_allocated_gb")
    if predicted is None or not measured or memory.get("kind") == "cpu_rss" or result.get("status") != "ok":
        return None
    return 100.0 * (predicted - measured) / measured


def _quantiles(values: list[float]) -> dict[str, float] | None:
    """min / 10th percentile / median / 90th percentile / max of the timed step intervals (s)."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {
        "min": ordered[0],
        "p10": at(0.1),
        "median": statistics.median(ordered),
        "p90": at(0.9),
        "max": ordered[-1],
    }


def run_mode(args: Any) -> str:
    """ "fast" or "eager": what a run's config says (older results: compiled counts as fast)."""
    config = args if isinstance(args, dict) else vars(args)
    mode = config.get("mode")
    if mode:
        return mode
    return "fast" if config.get("compile") or config.get("cuda_graphs") else "eager"


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _speed(t: dict[str, Any]) -> str:
    if t.get("tokens_per_s") is not None:  # text: samples/s alone hides the sequence length
        return f"{_fmt(t.get('samples_per_s'), '.1f')} samples/s, {_fmt(t['tokens_per_s'], '.0f')} tokens/s"
    return f"{_fmt(t.get('images_per_s'), '.1f')} img/s"


def _steps(p: dict[str, Any]) -> str:
    """The steps the speed line's median and loop time cover: this process's (a resumed run's count
    includes the steps before its checkpoint, which another process ran)."""
    steps = p["timing"]["optimizer_steps"]
    resumed = ((p.get("extra") or {}).get("resumed_from") or {}).get("step")
    if not resumed:
        return f"{steps} steps"
    return f"{steps - resumed} steps in this process, resumed at step {resumed} of {steps}"


def summary(p: dict[str, Any], path: str | None = None) -> str:
    """The one summary block every run prints (same shape for every recipe)."""
    prov, mem, t, acc = p["provenance"], p["memory"], p["timing"], p["accuracy"]
    where = prov.get("gpu_name") or "CPU"
    if prov.get("world_size", 1) > 1:
        where = f"{prov['world_size']} x {where}"
    mem_label = "peak memory (train)" if mem["kind"] == "cuda" else "peak RSS (CPU, process)"
    lines = [
        f"== {p['recipe']}{'-' + p['tag'] if p.get('tag') else ''}: {p['status'].upper()}"
        + (f" ({p['error']})" if p.get("error") else ""),
        f"   device        {where} | precision {p['config'].get('precision')} | model {prov.get('model')}"
        f" ({prov.get('weights')}) | data {prov.get('data_source')}",
        f"   {mem_label:<13} allocated {_fmt(mem['peak_allocated_gb'], '.2f')} GB,"
        f" reserved {_fmt(mem['peak_reserved_gb'], '.2f')} GB"
        + (
            f" | whole device {mem['device_peak_gb']:.2f} GB ({mem.get('device_method')},"
            f" {_fmt(mem.get('device_overhead_gb'), '.2f')} GB outside the allocator)"
            if mem.get("device_peak_gb") is not None
            else ""
        ),
        f"   speed         {_speed(t)} (median step {_fmt(t['median_step_s'], '.4f')} s,"
        f" {_steps(p)}, loop {_fmt(t['train_wall_s'], '.1f')} s)",
        f"   accuracy      train {_fmt(acc.get('train'), '.3f')} | val {_fmt(acc.get('val'), '.3f')}"
        f" | test {_fmt(acc.get('test'), '.3f')}",
    ]
    est = p.get("estimate") or {}
    if est.get("peak_allocated_gb") is not None:
        predicted = est["peak_allocated_gb"]
        line = (
            f"   estimate      predicted peak {predicted:.2f} GB"
            if predicted >= 0.1
            else (f"   estimate      predicted peak {predicted:.3g} GB")
        )
        error = estimate_error_pct(p)
        if error is not None:
            line += f" vs measured {mem['peak_allocated_gb']:.2f} GB allocated ({error:+.1f}%)"
        lines.append(line)
    elif est.get("error"):
        lines.append(f"   estimate      failed: {est['error']}")
    for kind in ("timeline", "snapshot"):
        files = mem.get(kind)
        if files:
            shown = (
                files
                if isinstance(files, str)
                else ", ".join(str(files[k]) for k in ("html", "png") if files.get(k))
            )
            lines.append(f"   {kind:<13} {shown}")
    if path:
        lines.append(f"   results       {path}")
    return "\n".join(lines)


def results_of(pattern: str, repo: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path relative to the checkout, payload) of each results JSON ``pattern`` names: a glob, or
    ``ARCHIVE-GLOB:MEMBER-PATTERN`` for JSONs inside committed ``.tgz`` archives (``archive.tgz:member``)."""
    archives, _, members = pattern.partition(":")
    for path in sorted(repo.glob(archives)):
        name = str(path.relative_to(repo))
        if not members:
            yield name, json.loads(path.read_text())
            continue
        for member, payload in archived(path, members):
            yield f"{name}:{member}", payload


def archived(path: Path, pattern: str = "*.json") -> Iterator[tuple[str, Any]]:
    """(member name, payload) of each file in the ``.tgz`` archive ``path`` whose name ``pattern`` matches
    (a glob whose ``*`` crosses folders), in name order."""
    with tarfile.open(path) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if m.isfile() and fnmatch.fnmatch(m.name, pattern):
                yield m.name, json.load(tar.extractfile(m))

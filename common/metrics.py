"""The metrics logger: what every run measures about itself, written as one results JSON per run.

Results JSON (``results/<recipe>[-<tag>].json``), schema version 1. The report reads these keys only.
A run that did not succeed never replaces a successful result: it is written beside it as
``<recipe>[-<tag>].<status>.json`` (e.g. ``01_baseline.interrupted.json``; ``common.faults.results_file``).

===============================  ===========================================================================
key                              meaning
===============================  ===========================================================================
schema_version                   1
recipe, tag, description         which script ran (tag: the --tag suffix or null)
mode                             "fast" (CUDA: compiled blocks, each optimizer step one CUDA graph where the
                                 rung uses them; config.compile / config.cuda_graphs say which) | "eager"
status                           "ok" | "oom" (CUDA out of memory, caught) | "error" | "interrupted"
                                 (stopped by SIGINT/SIGTERM/SIGUSR1 at an optimizer-step boundary: the
                                 measurements cover the steps taken)
error                            first line of the error ("SIGTERM at step 7 of 100" when interrupted),
                                 or null
config                           every parsed flag (plus micro_batch_size)
provenance                       device ("cuda"/"cpu"), gpu_name, world_size, num_nodes, versions (torch,
                                 lightning, torchvision, python, cuda), float32_matmul_precision ("high"
                                 means TF32 matmuls), cuda_alloc_conf (PYTORCH_CUDA_ALLOC_CONF), data_source ("cifar10"/"synthetic"), weights
                                 ("pretrained"/"random"), model, parameters, timestamp (UTC ISO 8601);
                                 data_source is "cifar10"/"digits"/"synthetic" for images (only real
                                 data makes accuracy a score; digits: common/digits.py);
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
memory.warmup                    CUDA: {steps, peak_allocated_gb, peak_reserved_gb} over the first ``steps``
                                 optimizer steps of training (compilation, CUDA-graph capture, optimizer
                                 state created); null without it. The "train" phase peak is the larger of
                                 this and memory.steady
memory.steady                    {peak_allocated_gb, peak_reserved_gb} after the warm-up steps
memory.timeline                  --memory-timeline: {html, png, json, device, steps, phases_ms} files of the
                                 torch.profiler memory timeline by category (next to this JSON), else null
memory.snapshot                  --snapshot: path of the CUDA allocator history pickle (memory_viz), else null
estimate                         the predicted peak (common.estimate, made before the run): {
                                 peak_allocated_gb, components_gb {parameters, gathered_parameters,
                                 weight_copies, gradients, optimizer_state, activations, temporaries, inputs,
                                 workspace} (GB at the predicted peak), peak_phase, static_gb {weights,
                                 gradients, optimizer_state}, activations_saved_gb (one micro-batch's
                                 forward), parameters {total, trainable}, assumptions {method, device,
                                 attention_kernel, compile, compile_modelled, precision, micro_batch_size,
                                 accumulation_steps, optimizer, optimizer_impl, checkpoint, sharding,
                                 shard_units, world_size, cpu_offload, workspace_gb}, kernels, model,
                                 seconds, error}; null when the recipe made none. Compare it with
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
accuracy.{train,val,test}        fraction correct (train: over the last logged window of the run;
                                 bonus_llm_finetune: next-token accuracy on completion tokens)
loss.{first,last}                training loss of the first and last logged window
loss.curve                       [[optimizer step, mean training loss of the window ending there], ...]:
                                 one point every --log-every steps (and the last, partial window)
updates.rule                     --bf16-update of the run ("plain"/"stochastic"/"kahan"); null when the
                                 recipe does not route its optimizer through common.bf16
updates.optimizer                the optimizer class that stepped (module.Class), null likewise
updates.lost                     --lost-updates N: {every, columns ["step", "lost", "unchanged"], steps
                                 [[step, lost, unchanged], ...], mean_lost, mean_unchanged, last_lost}:
                                 per sampled step, the fraction of parameters whose update would move
                                 them in fp32 but whose effective weight did not move, and of stored
                                 weights that did not move (common/bf16.py); null without the flag
extra                            recipe-specific measurements (e.g. rung 07's two ways of loading);
                                 set by the loop: resumed_from {path, step} (a resumed run), stopped
                                 {signal, step, planned_steps, checkpoint (to resume from, or null)}
                                 (an interrupted run)
===============================  ===========================================================================
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from typing import Any

from common import faults

SCHEMA_VERSION = 1
GB = 1e9
WARMUP_STEPS = 3
LOG_DIR = os.environ.get("FMR_LOG_DIR", "logs")


# Dense bf16 tensor-core peaks from the vendors' datasheets (FLOP/s), for model FLOPs utilisation.
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L4": 121e12, "A10G": 70e12}


def peak_bf16_flops(gpu_name: str | None) -> float | None:
    """The datasheet bf16 peak for a GPU name such as 'NVIDIA H100 80GB HBM3' (None if unknown)."""
    for key, flops in PEAK_BF16_FLOPS.items():
        if gpu_name and key in gpu_name:
            return flops
    return None


def results_path(results_dir: str, recipe: str, tag: str | None = None) -> str:
    return os.path.join(results_dir, f"{recipe}-{tag}.json" if tag else f"{recipe}.json")


def write_atomic(path: str | os.PathLike, write: Any, binary: bool = False) -> None:
    """``write(f)`` into a temporary file in the same folder, then rename: a reader never sees half a
    file (results JSON, the rendered README, the figure)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(str(path))[1], dir=folder)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; results are meant to be shared like any file
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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


def environment() -> dict[str, Any]:
    """Versions, matmul precision, time and command line: what every results file records."""
    import lightning
    import torch
    import torchvision

    return {
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }


class MetricsLogger:
    """Collects one run's measurements and writes them at :meth:`finish`.

    Usage in a recipe: ``fabric = L.Fabric(..., loggers=log.fabric_loggers())``, ``log.attach(fabric)``,
    ``with log.phase("train"): ...``; the loop calls :meth:`step_done` after every optimizer step.
    """

    def __init__(self, recipe: str, args: Any, description: str = "") -> None:
        self.recipe = recipe
        self.args = args
        self.description = description
        self.fabric = None
        self.phases: dict[str, dict[str, float]] = {}
        self.step_marks: list[Any] = []  # CUDA events or perf_counter floats, one per optimizer step
        self.optimizer_steps = 0
        self.micro_batches = 0
        self.accuracy: dict[str, float | None] = {"train": None, "val": None, "test": None}
        self.loss: dict[str, Any] = {"first": None, "last": None, "curve": []}
        self.updates: dict[str, Any] = {"rule": None, "optimizer": None, "lost": None}  # common.bf16
        self.provenance: dict[str, Any] = {"data_source": None, "weights": None}
        self.extra: dict[str, Any] = {}
        self._estimate: Any = None
        self._estimate_s = 0.0  # time spent predicting memory: kept out of the phases' wall_s
        self.memory_files: dict[str, Any] = {"timeline": None, "snapshot": None}  # set by common.loop
        self.warmup: dict[str, Any] | None = None  # peak memory up to the end of warm-up (warmup_done)
        self._steady_from: str | None = None  # the phase in which warm-up ended (its peaks were reset)
        self._loggers: list | None = None

    # ------------------------------------------------------------------------------------------ set-up
    def fabric_loggers(self) -> list:
        """Fabric loggers to pass to ``L.Fabric(loggers=...)``: CSV always, TensorBoard if installed."""
        if self._loggers is None:
            import importlib.util

            from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

            name = self.recipe + (f"-{self.args.tag}" if getattr(self.args, "tag", None) else "")
            self._loggers = [CSVLogger(root_dir=LOG_DIR, name=name)]
            if importlib.util.find_spec("tensorboard") is not None:
                self._loggers.append(
                    TensorBoardLogger(root_dir=os.path.join(LOG_DIR, "tensorboard"), name=name)
                )
        return self._loggers

    def attach(self, fabric) -> None:
        self.fabric = fabric

    def set(self, **provenance: Any) -> None:
        """Record where the run's inputs came from (data_source=..., weights=..., anything else)."""
        self.provenance.update(provenance)

    @property
    def estimate(self) -> Any:
        """The predicted peak (a common.estimate.Estimate), set by the recipe before training."""
        return self._estimate

    @estimate.setter
    def estimate(self, est: Any) -> None:
        # A recipe predicts right after building its model, inside the "model_load" phase; the seconds
        # of simulation are not loading, so phase() leaves them out of that phase's wall time.
        self._estimate = est
        self._estimate_s += getattr(est, "seconds", 0.0) or 0.0

    def gpu_name(self) -> str | None:
        import torch

        return torch.cuda.get_device_name(self.fabric.device) if self._cuda else None

    @property
    def _cuda(self) -> bool:
        return self.fabric is not None and self.fabric.device.type == "cuda"

    # ------------------------------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def phase(self, name: str):
        """Measure peak memory (and wall time, less any memory prediction made inside) of a block.

        CUDA peaks are reset on entry."""
        import torch

        self._phase = name
        cuda = self._cuda
        if cuda:
            torch.cuda.synchronize(self.fabric.device)
            torch.cuda.reset_peak_memory_stats(self.fabric.device)
        start, estimate_s = time.perf_counter(), self._estimate_s
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.fabric.device)
                alloc = torch.cuda.max_memory_allocated(self.fabric.device)
                reserved = torch.cuda.max_memory_reserved(self.fabric.device)
            else:
                # ru_maxrss is in KiB on Linux: the process peak so far, not resettable.
                alloc = reserved = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            if self._steady_from == name and self.warmup is not None:
                # warm-up ended inside this phase and reset the peaks: the phase's peak is the larger
                self.warmup["steady_allocated"], self.warmup["steady_reserved"] = alloc, reserved
                alloc = max(alloc, self.warmup["allocated"])
                reserved = max(reserved, self.warmup["reserved"])
            self.phases[name] = {
                "allocated": alloc,
                "reserved": reserved,
                "wall_s": time.perf_counter() - start - (self._estimate_s - estimate_s),
            }

    def warmup_done(self, steps: int) -> None:
        """End of warm-up (compilation, CUDA-graph capture, optimizer state created): keep the peak so
        far apart and reset the peaks, so the rest of the phase measures the steady state."""
        if not self._cuda:
            return
        import torch

        device = self.fabric.device
        torch.cuda.synchronize(device)
        self.warmup = {
            "steps": steps,
            "allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.max_memory_reserved(device),
        }
        self._steady_from = getattr(self, "_phase", None)
        torch.cuda.reset_peak_memory_stats(device)

    def _warmup_payload(self) -> tuple[dict | None, dict | None]:
        """(memory.warmup, memory.steady) for the results, or (None, None)."""
        w = self.warmup
        if w is None or "steady_allocated" not in w:
            return None, None
        return (
            {"steps": w["steps"], "peak_allocated_gb": w["allocated"] / GB, "peak_reserved_gb": w["reserved"] / GB},
            {"peak_allocated_gb": w["steady_allocated"] / GB, "peak_reserved_gb": w["steady_reserved"] / GB},
        )

    # ------------------------------------------------------------------------------------------ timing
    def step_done(self) -> None:
        """Mark the end of an optimizer step without synchronising (a CUDA event on the stream)."""
        self.optimizer_steps += 1
        if self._cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.step_marks.append(event)
        else:
            self.step_marks.append(time.perf_counter())

    def step_intervals(self) -> list[float]:
        """Seconds between consecutive optimizer steps (synchronises once, at the end)."""
        if len(self.step_marks) < 2:
            return []
        if self._cuda:
            self.step_marks[-1].synchronize()
            return [
                a.elapsed_time(b) / 1000.0 for a, b in zip(self.step_marks, self.step_marks[1:], strict=False)
            ]
        return [b - a for a, b in zip(self.step_marks, self.step_marks[1:], strict=False)]

    # ------------------------------------------------------------------------------------------ output
    def _world(self) -> tuple[int, int]:
        if self.fabric is None:
            return 0, 1
        return self.fabric.global_rank, self.fabric.world_size

    def _gather_phases(self, gather: bool = True) -> dict[str, dict]:
        """Per-rank peaks, gathered to every rank when there are several processes."""
        rank, world = self._world()
        names = sorted(self.phases)
        rows = {n: [(rank, self.phases[n]["allocated"], self.phases[n]["reserved"])] for n in names}
        if gather and world > 1 and names:
            import torch

            local = torch.tensor(
                [[self.phases[n]["allocated"], self.phases[n]["reserved"]] for n in names],
                dtype=torch.float64,
                device=self.fabric.device,
            )
            gathered = self.fabric.all_gather(local).cpu()  # (world, phases, 2)
            rows = {
                n: [(r, float(gathered[r, i, 0]), float(gathered[r, i, 1])) for r in range(world)]
                for i, n in enumerate(names)
            }
        out = {}
        for n in names:
            per_rank = [{"rank": r, "allocated_gb": a / GB, "reserved_gb": res / GB} for r, a, res in rows[n]]
            out[n] = {
                "peak_allocated_gb": max(p["allocated_gb"] for p in per_rank),
                "peak_reserved_gb": max(p["reserved_gb"] for p in per_rank),
                "wall_s": self.phases[n]["wall_s"],
                "per_rank": per_rank,
            }
        return out

    def _provenance(self) -> dict[str, Any]:
        rank, world = self._world()
        device = self.fabric.device.type if self.fabric is not None else "cpu"
        prov = {
            "device": device,
            "gpu_name": self.gpu_name(),
            "world_size": world,
            "num_nodes": getattr(self.args, "num_nodes", 1),
            **environment(),
            "model": getattr(self.args, "model", None),
        }
        prov.update(self.provenance)
        return prov

    def steady_intervals(self) -> list[float]:
        """Step intervals without the first WARMUP_STEPS (allocation, autotuning, compilation)."""
        intervals = self.step_intervals()
        return intervals[min(WARMUP_STEPS, max(0, len(intervals) - 1)) :]

    def median_step_s(self) -> float | None:
        steady = self.steady_intervals()
        return statistics.median(steady) if steady else None

    def _timing(self) -> dict[str, Any]:
        _, world = self._world()
        intervals = self.step_intervals()
        steady = self.steady_intervals()
        warmup = len(intervals) - len(steady)
        median = statistics.median(steady) if steady else None
        per_step = getattr(self.args, "batch_size", 0) * world
        rate = per_step / median if median else None
        tokens = self.provenance.get("tokens_per_sample")  # set by text recipes only
        return {
            "train_wall_s": self.phases.get("train", {}).get("wall_s"),
            "median_step_s": median,
            "images_per_s": rate if tokens is None else None,
            "samples_per_s": rate,
            "tokens_per_s": rate * tokens if rate and tokens else None,
            "optimizer_steps": self.optimizer_steps,
            "micro_batches": self.micro_batches,
            "images_seen": self.micro_batches * getattr(self.args, "micro_batch_size", 0) * world,
            "warmup_steps": warmup,
            "timed_intervals": len(steady),
            "step_s": _quantiles(steady),
        }

    def payload(self, status: str = "ok", error: str | None = None, gather: bool = True) -> dict[str, Any]:
        phases = self._gather_phases(gather)
        main = phases.get("train", {})
        warmup, steady = self._warmup_payload()
        return {
            "schema_version": SCHEMA_VERSION,
            "recipe": self.recipe,
            "tag": getattr(self.args, "tag", None),
            "description": self.description,
            "mode": run_mode(self.args),
            "status": status,
            "error": error,
            "config": {k: v for k, v in vars(self.args).items()},
            "provenance": self._provenance(),
            "memory": {
                "kind": "cuda" if self._cuda else "cpu_rss",
                "unit": "GB",
                "peak_allocated_gb": main.get("peak_allocated_gb"),
                "peak_reserved_gb": main.get("peak_reserved_gb"),
                "phases": phases,
                "run_peak_allocated_gb": max((p["peak_allocated_gb"] for p in phases.values()), default=None),
                "run_peak_reserved_gb": max((p["peak_reserved_gb"] for p in phases.values()), default=None),
                "warmup": warmup,
                "steady": steady,
                "timeline": self.memory_files.get("timeline"),
                "snapshot": self.memory_files.get("snapshot"),
            },
            "timing": self._timing(),
            "accuracy": self.accuracy,
            "loss": self.loss,
            "updates": self.updates,
            "extra": self.extra,
            "estimate": self.estimate.to_dict() if self.estimate is not None else None,
        }

    def finish(
        self, status: str = "ok", error: str | None = None, gather: bool | None = None
    ) -> dict[str, Any] | None:
        """Write the results JSON (rank 0) and print the summary block. Returns the payload on rank 0.

        After an OOM the other ranks may never reach a collective, so nothing is gathered then: the
        rank that caught it reports its own view. ``gather`` (default: only when ok) says that every
        rank reached this point together.
        """
        gather = status == "ok" if gather is None else gather
        payload = self.payload(status, error, gather=gather)
        if self._loggers:
            for lg in self._loggers:
                with contextlib.suppress(Exception):
                    lg.finalize("success" if status == "ok" else "failed")
        rank, _ = self._world()
        if rank != 0 and gather:
            return None
        path = results_path(
            getattr(self.args, "results_dir", "results"), self.recipe, getattr(self.args, "tag", None)
        )
        path = faults.results_file(path, status)  # never replaces a successful result
        if rank != 0:
            path = path[: -len(".json")] + f".rank{rank}.json"
        write_json_atomic(path, payload)
        print(summary(payload, path))
        return payload


def _quantiles(values: list[float]) -> dict[str, float] | None:
    """min / 10th percentile / median / 90th percentile / max of the timed step intervals (s)."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"min": ordered[0], "p10": at(0.1), "median": statistics.median(ordered), "p90": at(0.9),
            "max": ordered[-1]}  # fmt: skip


def run_mode(args: Any) -> str:
    """"fast" or "eager": what a run's config says (older results: compiled counts as fast)."""
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
        f" reserved {_fmt(mem['peak_reserved_gb'], '.2f')} GB",
        f"   speed         {_speed(t)} (median step {_fmt(t['median_step_s'], '.4f')} s,"
        f" {t['optimizer_steps']} steps, loop {_fmt(t['train_wall_s'], '.1f')} s)",
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

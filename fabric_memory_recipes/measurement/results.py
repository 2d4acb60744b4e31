"""The measurements of one run: what a recipe and the loop record (peak memory per phase, step times,
losses, accuracy, provenance), gathered over ranks and written as the results JSON (fabric_memory_recipes/measurement/results_file.py
documents its keys).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.util
import math
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

import lightning
import torch
import torchvision
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

from fabric_memory_recipes import faults
from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.measurement import gpu_lock
from fabric_memory_recipes.measurement.device_memory import DeviceSampler, device_fields
from fabric_memory_recipes.measurement.results_file import (
    GB,
    SCHEMA_VERSION,
    WARMUP_STEPS,
    _quantiles,
    results_path,
    run_mode,
    summary,
    write_json_atomic,
)

LOG_DIR = os.environ.get("FMR_LOG_DIR", "logs")  # Fabric's CSV (and TensorBoard) logs of every run


def environment() -> dict[str, Any]:
    """Versions, matmul precision, time and command line: what every results file records."""
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


class RunResults:
    """Collects one run's measurements and writes them at :meth:`finish`.

    Usage in a recipe: ``fabric = L.Fabric(..., loggers=results.fabric_loggers())``,
    ``results.attach(fabric)``, ``with results.phase("train"): ...``; the loop calls :meth:`step_done`
    after every optimizer step. ``cfg`` is the run's checked configuration (the JSON's ``config``).
    """

    def __init__(self, cfg: RunConfig, description: str = "", device: DeviceSampler | None = None) -> None:
        self.cfg = cfg
        # whole-device memory of this process (started by the lifecycle before CUDA is touched)
        self.device = device
        self.recipe = cfg.recipe
        self.description = description
        self.fabric = None
        self.phases: dict[str, dict[str, float]] = {}
        self.step_marks: list[Any] = []  # CUDA events or perf_counter floats, one per optimizer step
        self.optimizer_steps = 0
        self.micro_batches = 0
        self.accuracy: dict[str, float | None] = {"train": None, "val": None, "test": None}
        self.loss: dict[str, Any] = {"first": None, "last": None, "curve": []}
        self.updates: dict[str, Any] = {
            "rule": None,
            "optimizer": None,
            "lost": None,
        }  # fabric_memory_recipes.training.techniques.bf16
        self.provenance: dict[str, Any] = {"data_source": None, "weights": None}
        self.extra: dict[str, Any] = {}
        self._estimate: Any = None
        self._estimate_s = 0.0  # time spent predicting memory: kept out of the phases' wall_s
        self.memory_files: dict[str, Any] = {
            "timeline": None,
            "snapshot": None,
        }  # set by fabric_memory_recipes.training.loop
        self.warmup: dict[str, Any] | None = None  # peak memory up to the end of warm-up (warmup_done)
        self._steady_from: str | None = None  # the phase in which warm-up ended (its peaks were reset)
        self._loggers: list | None = None

    # ------------------------------------------------------------------------------------------ set-up
    def fabric_loggers(self) -> list:
        """Fabric loggers to pass to ``L.Fabric(loggers=...)``: CSV always, TensorBoard if installed."""
        if self._loggers is None:
            name = self.cfg.run_name
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
        """The predicted peak (a fabric_memory_recipes.planning.Estimate), set by the recipe before training."""
        return self._estimate

    @estimate.setter
    def estimate(self, est: Any) -> None:
        # A recipe predicts right after building its model, inside the "model_load" phase; the seconds
        # of simulation are not loading, so phase() leaves them out of that phase's wall time.
        self._estimate = est
        self._estimate_s += getattr(est, "seconds", 0.0) or 0.0

    def gpu_name(self) -> str | None:
        return torch.cuda.get_device_name(self.fabric.device) if self._cuda else None

    @property
    def _cuda(self) -> bool:
        return self.fabric is not None and self.fabric.device.type == "cuda"

    # ------------------------------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def phase(self, name: str):
        """Measure peak memory (and wall time, less any memory prediction made inside) of a block.

        CUDA peaks are reset on entry. The "train" phase holds the GPU alone when ./run_all.sh runs
        several recipes at once (measurement/gpu_lock.py); the wait is not part of its time."""
        with gpu_lock.exclusive(self.extra) if name == "train" else contextlib.nullcontext():
            with self._phase_measured(name):
                yield

    @contextlib.contextmanager
    def _phase_measured(self, name: str):
        self._phase = name
        cuda = self._cuda
        if cuda:
            torch.cuda.synchronize(self.fabric.device)
            torch.cuda.reset_peak_memory_stats(self.fabric.device)
        if self.device is not None:
            self.device.phase_start(name)
        start, estimate_s = time.perf_counter(), self._estimate_s
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.fabric.device)
            if self.device is not None:
                self.device.phase_end(name)
            if cuda:
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
            {
                "steps": w["steps"],
                "peak_allocated_gb": w["allocated"] / GB,
                "peak_reserved_gb": w["reserved"] / GB,
            },
            {"peak_allocated_gb": w["steady_allocated"] / GB, "peak_reserved_gb": w["steady_reserved"] / GB},
        )

    # ------------------------------------------------------------------------------------------ timing
    def step_done(self) -> None:
        """Mark the end of an optimizer step without synchronising (a CUDA event on the stream)."""
        self.optimizer_steps += 1
        if self._cuda:
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

    def _device_peak(self, name: str | None = None) -> float:
        """This process's whole-device peak in bytes (of phase ``name``, else of the run); NaN if none."""
        if self.device is None or not self._cuda:
            return math.nan
        value = self.device.phase_peak(name) if name else self.device.peak_bytes()
        return math.nan if value is None else value

    def _gather(self, rows: list[list[float]], gather: bool) -> list[tuple[int, list[list[float]]]]:
        """(rank, ``rows``) of every rank when gathering over several processes, else of this one."""
        rank, world = self._world()
        if gather and world > 1:
            local = torch.tensor(rows, dtype=torch.float64, device=self.fabric.device)
            return list(enumerate(self.fabric.all_gather(local).cpu().tolist()))  # (world, rows, columns)
        return [(rank, rows)]

    def _gather_phases(self, gather: bool = True) -> tuple[dict[str, dict], list[dict]]:
        """Per-rank peaks per phase, and per-rank whole-device peaks of the run, gathered to every
        rank when there are several processes."""
        names = sorted(self.phases)
        rows = [
            [self.phases[n]["allocated"], self.phases[n]["reserved"], self._device_peak(n)] for n in names
        ]
        baseline = (
            self.device.summary()["device_baseline_gb"] if self.device is not None else None
        ) or math.nan
        per_rank = self._gather(rows + [[self._device_peak(), baseline * GB, 0.0]], gather)
        out = {}
        for i, n in enumerate(names):
            entries = [
                {"rank": r, "allocated_gb": v[i][0] / GB, "reserved_gb": v[i][1] / GB}
                | ({} if math.isnan(v[i][2]) else {"device_gb": v[i][2] / GB})
                for r, v in per_rank
            ]
            devices = [p["device_gb"] for p in entries if "device_gb" in p]
            out[n] = {
                "peak_allocated_gb": max(p["allocated_gb"] for p in entries),
                "peak_reserved_gb": max(p["reserved_gb"] for p in entries),
                "device_peak_gb": max(devices) if devices else None,
                "wall_s": self.phases[n]["wall_s"],
                "per_rank": entries,
            }
        device = [
            {"rank": r, "device_peak_gb": v[-1][0] / GB}
            | ({} if math.isnan(v[-1][1]) else {"device_baseline_gb": v[-1][1] / GB})
            for r, v in per_rank
            if not math.isnan(v[-1][0])
        ]
        return out, device

    def _provenance(self) -> dict[str, Any]:
        rank, world = self._world()
        device = self.fabric.device.type if self.fabric is not None else "cpu"
        prov = {
            "device": device,
            "gpu_name": self.gpu_name(),
            "world_size": world,
            "num_nodes": self.cfg.num_nodes,
            **environment(),
            "model": self.cfg.model,
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
        per_step = self.cfg.batch_size * world
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
            "images_seen": self.micro_batches * self.cfg.micro_batch_size * world,
            "warmup_steps": warmup,
            "timed_intervals": len(steady),
            "step_s": _quantiles(steady),
            "intervals_s": [round(x, 6) for x in intervals],  # every step, warm-up included
        }

    def payload(self, status: str = "ok", error: str | None = None, gather: bool = True) -> dict[str, Any]:
        if self.device is not None:
            self.device.stop()  # one last reading; the run is over
        phases, device_ranks = self._gather_phases(gather)
        main = phases.get("train", {})
        warmup, steady = self._warmup_payload()
        return {
            "schema_version": SCHEMA_VERSION,
            "recipe": self.recipe,
            "tag": self.cfg.tag,
            "description": self.description,
            "mode": run_mode(self.cfg.flags()),
            "status": status,
            "error": error,
            "config": self.cfg.flags(),
            "provenance": self._provenance(),
            "memory": {
                "kind": "cuda" if self._cuda else "cpu_rss",
                "unit": "GB",
                "peak_allocated_gb": main.get("peak_allocated_gb"),
                "peak_reserved_gb": main.get("peak_reserved_gb"),
                "phases": phases,
                "run_peak_allocated_gb": max((p["peak_allocated_gb"] for p in phases.values()), default=None),
                "run_peak_reserved_gb": max((p["peak_reserved_gb"] for p in phases.values()), default=None),
                **device_fields(self.device if self._cuda else None, phases, device_ranks),
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
        path = results_path(self.cfg.results_dir, self.recipe, self.cfg.tag)
        path = faults.results_file(path, status)  # never replaces a successful result
        if rank != 0:
            path = path[: -len(".json")] + f".rank{rank}.json"
        write_json_atomic(path, payload)
        print(summary(payload, path))
        return payload

"""Whole-device memory of this process: what a card must hold, beyond the caching allocator's peaks.

A CUDA process holds device memory that ``torch.cuda.max_memory_reserved`` never counts: the CUDA
context, library handles (cuBLAS, cuDNN) and loaded kernels. A card must hold it too, so every CUDA run
also records its *whole-device* peak. A :class:`DeviceSampler` polls, from a daemon thread every
``INTERVAL_S`` seconds, from before the run's device is touched to the end of the run, with the first
method that works here:

``nvml-process``
    NVML's list of compute processes on the device, this process's entry (what ``nvidia-smi`` shows
    per process). In a container NVML may list host PIDs only; then the next method answers.
``nvml-device``
    NVML's device-wide used memory, less what was used when the sampler started (the baseline, read
    before this process created its CUDA context): this process's own only when no other process
    changes its use meanwhile.
``mem_get_info``
    ``torch.cuda.mem_get_info`` (total - free), read only once CUDA is initialised here and never
    during a CUDA-graph capture (:func:`quiet`): the whole GPU, this process's only when it has the
    GPU to itself; no baseline can be read without creating the context it should exclude.

A reader that fails is left for the next method; when none works, the peak is ``None`` and
``note`` says why. Nothing here ever raises into the run.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from fabric_memory_recipes.measurement.results_file import GB

INTERVAL_S = 0.005  # a step of a small rung lasts ~20 ms: a 5 ms poll sees its peak
INTERVAL_ENV = "FMR_DEVICE_INTERVAL_S"  # another poll interval (seconds), for an A/B of the sampler's cost
MAX_FAILURES = 3  # consecutive failed reads before a method is given up
PROCESS_MISSES = 100  # readings with CUDA started but this PID unlisted: the process list is given up
METHODS = ("nvml-process", "nvml-device", "mem_get_info")
_ACTIVE: set[DeviceSampler] = set()
_ACTIVE_LOCK = threading.Lock()


class Reader:
    """One way of reading this process's device memory: ``read()`` returns bytes, or None when this
    method sees nothing yet (e.g. before CUDA is initialised), and raises when it cannot work."""

    method = "none"
    baseline: float | None = None  # bytes subtracted from every reading
    note: str | None = None  # the caveat recorded with the method
    uses_cuda = False  # calls the CUDA runtime: kept quiet during a graph capture

    def read(self) -> float | None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class NvmlReader(Reader):
    """NVML, process entry first (``nvml-process``), else device-wide used less the baseline
    (``nvml-device``). The choice is made per reading and the sampler keeps the best method seen."""

    def __init__(self, nvml: Any, index: int, pid: int | None = None) -> None:
        self.nvml, self.pid = nvml, pid or os.getpid()
        nvml.nvmlInit()
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.baseline = float(nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
        self.process_seen, self.misses = False, 0
        self.method = "nvml-device"
        self.note = (
            "NVML device-wide used memory less the baseline read before this process created its CUDA"
            " context: this process's own unless another process changed its use during the run"
        )

    def read_process(self) -> float | None:
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:  # not supported here: the device-wide reading answers
            return None
        used = [
            p.usedGpuMemory for p in procs if p.pid == self.pid and isinstance(p.usedGpuMemory, int | float)
        ]
        return float(sum(used)) if used else None

    def read(self) -> float | None:
        return max(0.0, float(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used) - self.baseline)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


class MemGetInfoReader(Reader):
    """``torch.cuda.mem_get_info``: total - free of the whole GPU, once CUDA is initialised here."""

    method = "mem_get_info"
    uses_cuda = True
    note = (
        "torch.cuda.mem_get_info (total - free): the whole GPU, this process's own only when it has the"
        " GPU to itself; no baseline (reading one would create the CUDA context it should exclude)"
    )

    def __init__(self, index: int) -> None:
        self.index = index

    def read(self) -> float | None:
        if not torch.cuda.is_initialized():
            return None  # reading now would create the context on this thread: wait for the run's own
        free, total = torch.cuda.mem_get_info(self.index)
        return float(total - free)


def default_interval() -> float:
    """The poll interval: ``FMR_DEVICE_INTERVAL_S`` when it is a positive number of seconds, else
    :data:`INTERVAL_S`. The results JSON records the interval used (``memory.device_interval_s``)."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, ""))
    except ValueError:
        return INTERVAL_S
    return value if value > 0 else INTERVAL_S


def local_device_index() -> int:
    """The CUDA device this process will use: its local rank (Fabric's launcher, torchrun, SLURM)."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def nvml_index(index: int) -> int:
    """The NVML index of CUDA device ``index`` (CUDA_VISIBLE_DEVICES taken into account)."""
    try:
        return int(torch.cuda._get_nvml_device_index(index))
    except Exception:  # a private helper that may change: the plain index is right without a mask
        return index


def default_readers(index: int) -> list[Callable[[], Reader]]:
    """The methods to try, best first, as factories (a factory that raises is skipped)."""

    def nvml() -> Reader:
        import pynvml  # nvidia-ml-py: on the GPU image; missing elsewhere (then mem_get_info answers)

        return NvmlReader(pynvml, nvml_index(index))

    return [nvml, lambda: MemGetInfoReader(index)]


class DeviceSampler:
    """Polls this process's device memory from a daemon thread; tracks the peak of the run and of
    each open phase. ``start()`` / ``stop()``; :meth:`summary` for the results JSON."""

    def __init__(
        self,
        readers: list[Callable[[], Reader]] | None = None,
        interval_s: float | None = None,
        index: int | None = None,
    ) -> None:
        self.index = local_device_index() if index is None else index
        self._factories = list(readers) if readers is not None else default_readers(self.index)
        self.interval_s = default_interval() if interval_s is None else interval_s
        self.reader: Reader | None = None
        self.failures: list[str] = []  # why each method that was tried did not answer
        self.peak: float | None = None  # bytes
        self.process_peak: float | None = None  # NVML's process entry, when it ever listed this process
        self.phase_peaks: dict[str, list[float | None]] = {}  # name -> [method's peak, process entry's]
        self._open: set[str] = set()
        self.samples = 0
        self._quiet = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stopped_reason: str | None = None
        # CUDA started here before the sampler: the baseline may hold some of this process's memory
        self.cuda_was_initialised = False

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> DeviceSampler:
        with contextlib.suppress(Exception):
            self.cuda_was_initialised = torch.cuda.is_initialized()
        with self._lock:
            self._next_reader()
        if self.reader is not None:
            self._thread = threading.Thread(target=self._run, name="device-memory-sampler", daemon=True)
            self._thread.start()
            with _ACTIVE_LOCK:
                _ACTIVE.add(self)
        return self

    def stop(self, reason: str | None = None) -> None:
        """Stop polling (one last reading first); idempotent. ``reason`` discards the measurement."""
        if self._thread is not None and not self._stop.is_set():
            self.sample()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        with _ACTIVE_LOCK:
            _ACTIVE.discard(self)
        with self._lock:
            if self.reader is not None:
                self.reader.close()
            if reason is not None:
                self.stopped_reason, self.peak, self.process_peak = reason, None, None

    def _next_reader(self) -> None:
        """Try the next method (under the lock)."""
        if self.reader is not None:
            self.reader.close()
        self.reader = None
        while self._factories:
            factory = self._factories.pop(0)
            try:
                self.reader = factory()
                return
            except Exception as e:
                self.failures.append(f"{getattr(factory, '__name__', 'reader')}: {type(e).__name__}: {e}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
            if self.reader is None:
                return

    # ------------------------------------------------------------------------------ readings
    def sample(self) -> None:
        """One reading, folded into the peaks. Never raises."""
        with self._lock:
            reader = self.reader
            if reader is None or self._stop.is_set() or (self._quiet and reader.uses_cuda):
                return
            try:
                value = reader.read()
                process = reader.read_process() if isinstance(reader, NvmlReader) else None
            except Exception as e:
                self.failures.append(f"{reader.method}: {type(e).__name__}: {e}")
                recent = self.failures[-MAX_FAILURES:]
                if len(recent) == MAX_FAILURES and all(f.startswith(reader.method) for f in recent):
                    if self.samples == 0:
                        self._next_reader()  # nothing measured yet: the next method may work
                    else:
                        reader.close()
                        self.reader = None  # a partial peak would look whole: record why instead
                        self.stopped_reason = f"{reader.method} failed during the run: {recent[-1]}"
                        self.peak = self.process_peak = None
                return
            if process is not None:
                self.process_peak = max(self.process_peak or 0.0, process)
            if value is None:
                return  # (the process entry needs a context, which a device-wide reading precedes)
            self.samples += 1
            self.peak = max(self.peak or 0.0, value)
            for name in self._open:
                peaks = self.phase_peaks[name]
                peaks[0] = max(peaks[0] or 0.0, value)
                if process is not None:
                    peaks[1] = max(peaks[1] or 0.0, process)

    def phase_start(self, name: str) -> None:
        with self._lock:
            self._open.add(name)
            self.phase_peaks[name] = [None, None]
        self.sample()

    def phase_end(self, name: str) -> None:
        self.sample()
        with self._lock:
            self._open.discard(name)

    def phase_peak(self, name: str) -> float | None:
        """A phase's peak in bytes by the run's method (None when nothing was read)."""
        with self._lock:
            peaks = self.phase_peaks.get(name)
            if peaks is None or self.method is None:
                return None
            return peaks[1] if self.method == "nvml-process" else peaks[0]

    # ------------------------------------------------------------------------------ results
    @property
    def method(self) -> str | None:
        if self.reader is None or self.stopped_reason:
            return None
        if self.process_peak is not None:
            return "nvml-process"
        return self.reader.method if self.peak is not None else None

    def peak_bytes(self) -> float | None:
        if self.method == "nvml-process":
            return self.process_peak
        return self.peak if self.method else None

    def summary(self) -> dict[str, Any]:
        """``device_peak_gb``, ``device_method``, ``device_baseline_gb``, ``device_note``,
        ``device_samples``, ``device_interval_s`` (the results JSON's ``memory``)."""
        with self._lock:
            method, peak = self.method, self.peak_bytes()
            reader = self.reader
            baseline = getattr(reader, "baseline", None) if method else None
            if method == "nvml-process":
                note = "NVML's compute-process entry of this process (what nvidia-smi lists)"
            elif method:
                note = reader.note
                if baseline is not None and self.cuda_was_initialised:
                    note += " (CUDA was already initialised here when the baseline was read)"
            else:
                note = self.stopped_reason or (
                    "no reading: " + "; ".join(self.failures[-2:]) if self.failures else "no reading taken"
                )
            return {
                "device_peak_gb": None if peak is None else peak / GB,
                "device_method": method,
                "device_baseline_gb": None if baseline is None else baseline / GB,
                "device_note": note,
                "device_samples": self.samples,
                "device_interval_s": self.interval_s,
            }


def device_fields(
    sampler: DeviceSampler | None, phases: dict[str, dict], ranks: list[dict]
) -> dict[str, Any]:
    """The results JSON's ``memory.device_*``: the whole-device peak (max over ``ranks``, each
    ``{rank, device_peak_gb[, device_baseline_gb]}``), its method, and the part of it outside the
    caching allocator (``device_overhead_gb`` = device peak - the run's peak reserved over ``phases``).
    ``sampler`` None: not measured (a CPU run, or CUDA was not there when the run started)."""
    if sampler is None:
        return {
            "device_peak_gb": None,
            "device_method": None,
            "device_baseline_gb": None,
            "device_overhead_gb": None,
            "device_note": "not measured: not a CUDA run",
            "device_samples": 0,
            "device_interval_s": None,
            "device_per_rank": None,
        }
    summary = sampler.summary()
    peak = max((d["device_peak_gb"] for d in ranks), default=None)
    reserved = max((p["peak_reserved_gb"] for p in phases.values()), default=None)
    baselines = [d["device_baseline_gb"] for d in ranks if "device_baseline_gb" in d]
    return {
        **summary,
        "device_peak_gb": peak,
        "device_method": summary["device_method"] if peak is not None else None,
        "device_baseline_gb": max(baselines) if baselines else None,
        "device_overhead_gb": peak - reserved if peak is not None and reserved is not None else None,
        "device_per_rank": ranks if len(ranks) > 1 else None,
    }


@contextlib.contextmanager
def quiet():
    """No CUDA-runtime reading from a sampler thread inside this block: a CUDA-graph capture in the
    default (global) mode fails on another thread's runtime call. NVML readings go on."""
    with _ACTIVE_LOCK:
        active = list(_ACTIVE)
    for s in active:
        with s._lock:  # waits for a reading in flight
            s._quiet += 1
    try:
        yield
    finally:
        for s in active:
            with s._lock:
                s._quiet -= 1


def start_for_run() -> DeviceSampler | None:
    """A started sampler when this process may use CUDA, else None (no CUDA: nothing to measure)."""
    try:
        if not torch.cuda.is_available():
            return None
        return DeviceSampler().start()
    except Exception:
        return None


def wait_for(sampler: DeviceSampler, samples: int, timeout_s: float = 2.0) -> bool:
    """Until ``sampler`` has taken ``samples`` readings (tests): True when it did."""
    deadline = time.monotonic() + timeout_s
    while sampler.samples < samples and time.monotonic() < deadline:
        time.sleep(0.001)
    return sampler.samples >= samples

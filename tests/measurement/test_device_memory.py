"""Whole-device memory (fabric_memory_recipes/measurement/device_memory.py) on the CPU: the sampler with
fake readers and a fake NVML, the results JSON's memory.device_* keys, and the report's column."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.measurement import device_memory, results
from fabric_memory_recipes.measurement.device_memory import DeviceSampler, NvmlReader, Reader
from fabric_memory_recipes.measurement.report import render
from fabric_memory_recipes.measurement.results import RunResults

GB = 1e9


class Scripted(Reader):
    """Returns the scripted values in turn (then the last one); an Exception value is raised."""

    def __init__(self, values, method="fake", uses_cuda=False):
        self.values, self.method, self.uses_cuda = list(values), method, uses_cuda
        self.note, self.reads, self.closed = f"{method} caveat", 0, False

    def read(self):
        self.reads += 1
        value = self.values.pop(0) if len(self.values) > 1 else self.values[0]
        if isinstance(value, Exception):
            raise value
        return value

    def close(self):
        self.closed = True


@pytest.fixture(autouse=True)
def _samplers_stopped(monkeypatch):
    """Every sampler a test starts is stopped when the test ends, whatever it asserted: one left polling is
    a live thread that test_the_thread_polls_and_stops_cleanly finds if it runs later."""
    started = []
    start = DeviceSampler.start

    def recorded(self):
        started.append(self)
        return start(self)

    monkeypatch.setattr(DeviceSampler, "start", recorded)
    yield
    for sampler in started:
        sampler.stop()


def manual(*readers) -> DeviceSampler:
    """A sampler whose readings the test takes itself (the thread polls once an hour)."""
    return DeviceSampler([lambda r=r: r for r in readers], interval_s=3600.0, index=0).start()


def test_the_sampler_tracks_the_run_peak_and_each_phase():
    s = manual(Scripted([None, 1 * GB, 3 * GB, 2 * GB, 5 * GB, 4 * GB]))
    s.sample()  # None: nothing read yet (mem_get_info before CUDA starts)
    assert s.peak is None and s.samples == 0
    s.phase_start("model_load")  # reads 1 GB
    s.sample()  # 3 GB
    s.phase_end("model_load")  # 2 GB
    s.phase_start("train")  # 5 GB
    s.phase_end("train")  # 4 GB
    s.stop()  # one last reading: 4 GB
    assert s.peak_bytes() == 5 * GB and s.samples == 6
    assert s.phase_peak("model_load") == 3 * GB and s.phase_peak("train") == 5 * GB
    summary = s.summary()
    assert summary["device_peak_gb"] == pytest.approx(5.0)
    assert summary["device_method"] == "fake" and summary["device_note"] == "fake caveat"


def test_the_thread_polls_and_stops_cleanly():
    reader = Scripted([2 * GB])
    s = DeviceSampler([lambda: reader], interval_s=0.001, index=0).start()
    assert device_memory.wait_for(s, 3)
    thread = s._thread
    s.stop()
    assert not thread.is_alive() and reader.closed
    reads = reader.reads
    s.sample()
    s.stop()  # idempotent
    assert reader.reads == reads  # nothing read after stop
    assert not [t for t in threading.enumerate() if t.name == "device-memory-sampler"]


@pytest.mark.parametrize(("value", "interval"), [("0.05", 0.05), ("", 0.005), ("fast", 0.005), ("-1", 0.005)])
def test_the_poll_interval_is_read_from_the_environment_when_it_is_a_positive_number(
    value, interval, monkeypatch
):
    monkeypatch.setenv(device_memory.INTERVAL_ENV, value)
    s = DeviceSampler([lambda: Scripted([1 * GB])], index=0)
    assert s.interval_s == interval and s.summary()["device_interval_s"] == interval
    assert DeviceSampler([lambda: Scripted([1 * GB])], interval_s=0.5, index=0).interval_s == 0.5


def test_a_reader_that_fails_at_start_gives_way_to_the_next_method():
    def broken():
        raise ImportError("No module named 'pynvml'")

    s = DeviceSampler([broken, lambda: Scripted([1 * GB], "second")], interval_s=3600.0, index=0).start()
    s.sample()
    s.stop()
    assert s.summary()["device_method"] == "second" and "pynvml" in s.failures[0]


def test_a_reader_that_fails_before_any_reading_gives_way_too():
    first = Scripted([RuntimeError("NVML_ERROR_NOT_SUPPORTED")], "first")
    s = manual(first, Scripted([1 * GB], "second"))
    for _ in range(device_memory.MAX_FAILURES + 1):
        s.sample()  # never raises
    assert s.summary()["device_method"] == "second" and first.closed


def test_a_reader_that_fails_mid_run_records_null_with_the_reason():
    s = manual(Scripted([1 * GB, *[RuntimeError("GPU is lost")] * device_memory.MAX_FAILURES]))
    for _ in range(device_memory.MAX_FAILURES + 2):
        s.sample()
    s.stop()
    summary = s.summary()
    assert summary["device_peak_gb"] is None and summary["device_method"] is None
    assert "failed during the run" in summary["device_note"] and "GPU is lost" in summary["device_note"]


def test_no_method_at_all_is_null_with_the_reason():
    def broken():
        raise ImportError("No module named 'pynvml'")

    s = DeviceSampler([broken], index=0).start()
    assert s._thread is None
    s.stop()
    summary = s.summary()
    assert summary["device_peak_gb"] is None and "pynvml" in summary["device_note"]


def test_quiet_holds_back_cuda_runtime_readers_only():
    cuda, nvml = Scripted([1 * GB], "mem_get_info", uses_cuda=True), Scripted([1 * GB], "nvml")
    a, b = manual(cuda), manual(nvml)
    with device_memory.quiet():  # a CUDA-graph capture
        a.sample()
        b.sample()
    assert (cuda.reads, nvml.reads) == (0, 1)
    a.sample()
    assert cuda.reads == 1
    a.stop(), b.stop()


class FakeNvml:
    """pynvml's calls the reader makes: a device whose used memory and process list the test sets."""

    def __init__(self, used: float, processes=()):
        self.used, self.processes, self.inits = used, list(processes), 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=self.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes]


def test_nvml_prefers_this_process_entry():
    nvml = FakeNvml(used=10 * GB)  # another process already holds 10 GB
    s = DeviceSampler([lambda: NvmlReader(nvml, 0, pid=42)], interval_s=3600.0, index=0).start()
    nvml.used, nvml.processes = 12.5 * GB, [(7, 10 * GB), (42, 2.5 * GB)]
    s.sample()
    s.stop()
    summary = s.summary()
    assert summary["device_method"] == "nvml-process"
    assert summary["device_peak_gb"] == pytest.approx(2.5)
    assert summary["device_baseline_gb"] == pytest.approx(10.0) and nvml.inits == 0


def test_nvml_without_this_pid_listed_uses_the_device_less_the_baseline():
    """In a container NVML lists host PIDs: this process is not found under its own."""
    nvml = FakeNvml(used=0.5 * GB)
    s = DeviceSampler([lambda: NvmlReader(nvml, 0, pid=42)], interval_s=3600.0, index=0).start()
    nvml.used, nvml.processes = 2.0 * GB, [(123456, None)]
    s.phase_start("train")
    nvml.used = 3.0 * GB
    s.phase_end("train")
    s.stop()
    summary = s.summary()
    assert summary["device_method"] == "nvml-device"
    assert summary["device_peak_gb"] == pytest.approx(2.5) and summary["device_baseline_gb"] == pytest.approx(
        0.5
    )
    assert s.phase_peak("train") == pytest.approx(2.5 * GB)


def test_cuda_is_not_sampled_on_a_machine_without_it():
    assert torch.cuda.is_available() or device_memory.start_for_run() is None


# ------------------------------------------------------------------------------------ results JSON
class CudaFabric:
    device = torch.device("cuda", 0)
    global_rank, world_size = 0, 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """The CUDA calls RunResults makes, answered on the CPU: 1 GB allocated, 1.5 GB reserved."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1.0 * GB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 1.5 * GB)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")


def test_the_results_json_records_the_whole_device_peak(fake_cuda):
    nvml = FakeNvml(used=0.25 * GB)
    sampler = DeviceSampler([lambda: NvmlReader(nvml, 0, pid=42)], interval_s=3600.0, index=0).start()
    log = RunResults(RunConfig(recipe="t", results_dir="unused"), device=sampler)
    log.attach(CudaFabric())
    nvml.used = 1.0 * GB  # the CUDA context
    with log.phase("model_load"):
        nvml.used = 1.5 * GB
    with log.phase("train"):
        nvml.used = 2.55 * GB  # 1.5 GB reserved + 0.8 GB outside the allocator
    nvml.used = 2.0 * GB
    mem = log.payload(gather=False)["memory"]
    assert mem["device_method"] == "nvml-device"
    assert mem["device_peak_gb"] == pytest.approx(2.3)
    assert mem["device_baseline_gb"] == pytest.approx(0.25)
    assert mem["device_overhead_gb"] == pytest.approx(0.8)  # device peak - run peak reserved
    assert mem["phases"]["model_load"]["device_peak_gb"] == pytest.approx(1.25)
    assert mem["phases"]["train"]["device_peak_gb"] == pytest.approx(2.3)
    assert mem["phases"]["train"]["per_rank"][0]["device_gb"] == pytest.approx(2.3)
    assert mem["device_per_rank"] is None and mem["device_samples"] >= 4
    assert not sampler._thread.is_alive()  # the payload ends the sampling
    assert "whole device 2.30 GB (nvml-device, 0.80 GB outside the allocator)" in results.summary(
        log.payload(gather=False)
    )


def test_a_cpu_run_records_why_there_is_no_device_peak():
    mem = RunResults(RunConfig(recipe="t", results_dir="unused")).payload(gather=False)["memory"]
    assert mem["device_peak_gb"] is None and mem["device_method"] is None
    assert mem["device_overhead_gb"] is None and mem["device_note"] == "not measured: not a CUDA run"


# ------------------------------------------------------------------------------------------ report
def _row(recipe: str, device_gb: float | None) -> dict:
    return {
        "schema_version": 1,
        "recipe": recipe,
        "status": "ok",
        "config": {"batch_size": 4},
        "provenance": {"gpu_name": "NVIDIA H100"},
        "memory": {
            "kind": "cuda",
            "peak_reserved_gb": 1.0,
            "peak_allocated_gb": 0.9,
            "device_peak_gb": device_gb,
        },
        "timing": {},
    }


def test_the_report_shows_a_device_peak_column_when_a_row_has_it():
    table = render.render_table([_row("01_baseline", 1.83), _row("02_x", None)])
    header = table.splitlines()[0].split(" | ")
    assert "device peak GB" in header
    column = header.index("device peak GB")
    cells = [line.split(" | ")[column] for line in table.splitlines()[2:]]
    assert cells == ["1.83", "—"]
    assert "device peak GB" not in render.render_table([_row("01_baseline", None)])


# --------------------------------------------------------------------------------------- lifecycle
def test_the_lifecycle_hands_its_sampler_to_the_results_and_stops_it(tmp_path, monkeypatch):
    """Started before the flags are parsed (a flag check may start CUDA), discarded for a CPU run,
    else handed to the run's results and stopped when the run ends."""
    from fabric_memory_recipes.training import lifecycle

    started = []

    def start():
        started.append(manual(Scripted([1 * GB])))
        return started[-1]

    monkeypatch.setattr(device_memory, "start_for_run", start)
    seen = []
    argv = ["--results-dir", str(tmp_path), "--accelerator", "cpu"]
    assert (
        lifecycle.run_recipe(
            lambda cfg, results: seen.append(results.device), RunConfig(recipe="x"), "d", argv
        )
        == 0
    )
    assert seen == [None] and started[0].summary()["device_note"] == "not a CUDA run"
    assert not started[0]._thread.is_alive()
    sampler = manual(Scripted([1 * GB]))
    cfg = RunConfig(recipe="y", results_dir=str(tmp_path))
    assert lifecycle._run_main(lambda cfg, results: seen.append(results.device), cfg, "d", sampler) == 0
    assert seen[-1] is sampler and not sampler._thread.is_alive()

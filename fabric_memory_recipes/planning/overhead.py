"""The card overhead: device memory a CUDA process holds outside PyTorch's caching allocator.

A card must hold the run's peak *reserved* memory plus what the process holds beside the allocator:
the CUDA context, library handles (cuBLAS, cuDNN) and loaded kernels. The planner predicts the
whole-device peak as predicted peak reserved + this overhead, for the GPU kind and mode, so that
``--fit 8GB`` answers for an 8 GB card and ``--memory-budget-gb 8`` emulates one.

The overhead is measured, never assumed. :func:`measure` reads results JSONs (recursively) and takes,
per GPU kind (``h100``, ``h200``: :func:`~fabric_memory_recipes.measurement.results_file.gpu_slug`)
and mode (``eager``; ``compiled``: torch.compile and/or CUDA graphs; ``inference``: ``--infer``, which
loads no backward or optimizer kernels), the largest overhead seen in

* ``memory.device_overhead_gb`` of a successful one-GPU run (the whole-device sampler,
  fabric_memory_recipes/measurement/device_memory.py), or of a row of an inference check's summary
  (``inference_check.json``: whole device - peak reserved), and
* the allocator's out-of-memory message of a one-GPU run, which states what the process had in use
  and what PyTorch held: ``this process has 4.51 GiB memory in use ... 3.66 GiB is allocated by
  PyTorch, and 45.70 MiB is reserved by PyTorch but unallocated`` (in use - allocated - reserved
  unallocated, to the message's 0.01 GiB, at the moment of the error).

Runs of several processes on one machine (``world_size`` > 1, one node) go to the table's ``sharded``
part, per GPU kind, processes and mode: ``memory.device_overhead_gb`` is the largest whole-device peak
over the ranks less the largest peak reserved, per GPU. NCCL's communicators and buffers and the other
processes' contexts are in it (measurement/card_overhead.py: :func:`overhead_per_gpu`).

``python -m fabric_memory_recipes.planning.overhead results --write`` stores the table, with the
files it came from, in ``fabric_memory_recipes/measurement/device_overhead.json`` (committed); the
planner and ``--memory-budget-gb`` read it through ``measurement.card_overhead``. A kind or mode it lacks falls back to the largest overhead it holds, and says so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import sys
from pathlib import Path
from typing import Any

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.measurement.card_overhead import (
    TABLE_FILE,
    Overhead,
    card_overhead,  # noqa: F401 - re-exported: the planner and its tests read it here
    load_table,  # noqa: F401 - re-exported: its tests read it here
    overhead_mode,
    overhead_per_gpu,
)
from fabric_memory_recipes.measurement.results_file import (
    GB,
    SCHEMA_VERSION,
    gpu_slug,
    kinds_table,
    write_json_atomic,
)
from fabric_memory_recipes.planning.planner.calibration import (
    RESULTS_DIR,
    ReservedRatio,
    sharded_reserved_ratio,
)
from fabric_memory_recipes.planning.simulation.allocator import RESIDUAL, RESIDUAL_SOURCE

REPO = Path(__file__).resolve().parents[2]
_SIZE = r"([\d.]+) (GiB|MiB|KiB|B)\b"
OOM_MESSAGE = re.compile(
    rf"this process has {_SIZE} memory in use.*?allocated memory {_SIZE} is allocated by PyTorch,"
    rf" and {_SIZE} is reserved by PyTorch but unallocated",
    re.DOTALL,
)
UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One run's overhead: GB outside the caching allocator, and how it was read."""

    gpu: str
    mode: str
    overhead_gb: float
    path: str
    how: str  # the sampler's method (nvml-process, ...) or 'oom-message'


def oom_overhead_gb(message: str) -> float | None:
    """In use - allocated - reserved-but-unallocated, from an allocator OOM message (GB), or None."""
    match = OOM_MESSAGE.search(message or "")
    if not match:
        return None
    v = [float(match.group(i)) * UNITS[match.group(i + 1)] for i in (1, 3, 5)]
    return (v[0] - v[1] - v[2]) / GB


def sample_of(result: dict[str, Any], path: str) -> Sample | None:
    """The overhead a results payload measured (one CUDA device), or None."""
    if not isinstance(result, dict) or result.get("schema_version") != SCHEMA_VERSION:
        return None
    memory, prov = result.get("memory") or {}, result.get("provenance") or {}
    if memory.get("kind") != "cuda" or prov.get("world_size", 1) != 1:
        return None  # several ranks: NCCL's buffers are outside the allocator too (sharded_sample_of)
    gpu, mode = gpu_slug(prov.get("gpu_name")), overhead_mode(result.get("config") or {})
    if result.get("status") == "ok" and memory.get("device_overhead_gb") is not None:
        return Sample(gpu, mode, float(memory["device_overhead_gb"]), path, str(memory.get("device_method")))
    if result.get("status") == "oom":
        value = oom_overhead_gb(result.get("error") or "")
        if value is not None:
            return Sample(gpu, mode, value, path, "oom-message")
    return None


def inference_check_samples(payload: dict[str, Any], path: str) -> list[Sample]:
    """The overheads of the runs an inference check summarises (``inference_check.json``, written by
    planning/inference/check.py: each row's measured whole-device peak and peak reserved), mode 'inference';
    each named ``path#run``. The runs' own results JSONs travel in the check's tar."""
    if not isinstance(payload, dict) or not isinstance(payload.get("rows"), list) or "target" not in payload:
        return []
    return [
        Sample(
            gpu_slug(r.get("gpu")),
            "inference",
            r["measured_device_gb"] - r["measured_reserved_gb"],
            f"{path}#{r.get('run')}",
            "inference-check",
        )
        for r in payload["rows"]
        if isinstance(r, dict)
        and r.get("status") == "ok"
        and r.get("gpu")
        and r.get("measured_device_gb") is not None
        and r.get("measured_reserved_gb") is not None
    ]


def sharded_sample_of(result: dict[str, Any], path: str) -> tuple[str, Sample] | None:
    """(processes on the machine, the per-GPU overhead) of a successful run of several processes on one
    node, or None."""
    if not isinstance(result, dict) or result.get("schema_version") != SCHEMA_VERSION:
        return None
    memory, prov, config = (
        result.get("memory") or {},
        result.get("provenance") or {},
        result.get("config") or {},
    )
    if memory.get("kind") != "cuda" or prov.get("world_size", 1) < 2 or prov.get("num_nodes", 1) != 1:
        return None
    if result.get("status") != "ok" or memory.get("device_overhead_gb") is None:
        return None
    gpu, mode = gpu_slug(prov.get("gpu_name")), overhead_mode(config)
    value = float(memory["device_overhead_gb"])
    return str(prov["world_size"]), Sample(gpu, mode, value, path, str(memory.get("device_method")))


def _entry(samples: list[Sample]) -> dict[str, Any]:
    mine = sorted(samples, key=lambda s: -s.overhead_gb)
    return {
        "overhead_gb": round(mine[0].overhead_gb, 4),
        "runs": len(mine),
        "smallest_gb": round(mine[-1].overhead_gb, 4),
        "largest_from": mine[0].path,
        "methods": sorted({s.how for s in mine}),
        "sources": sorted(s.path for s in mine),
    }


# Runs that shared one GPU through CUDA MPS (their NOTES.md says so): an MPS client's memory outside the
# allocator is not a lone process's, so they do not set the table.
SHARED_THROUGH_MPS = ("results/published/h100/convergence/",)


def measure(folders: list[str | Path]) -> dict[str, Any]:
    """The table: per kind and mode, the largest overhead of the runs below ``folders``, their count,
    the smallest, and every source file (relative to the repository when inside it)."""
    samples: list[Sample] = []
    sharded: list[tuple[str, Sample]] = []
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.json")):
            try:
                payload = json.loads(path.read_text())
            except (OSError, ValueError, UnicodeDecodeError):
                continue
            resolved = path.resolve()
            shown = resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else resolved
            if str(shown).startswith(SHARED_THROUGH_MPS) or "/wip/" in str(shown):
                continue  # MPS clients hold another overhead; wip/: code still being worked on
            sample = sample_of(payload, str(shown))
            if sample is not None:
                samples.append(sample)
            samples += inference_check_samples(payload, str(shown))
            several = sharded_sample_of(payload, str(shown))
            if several is not None:
                sharded.append(several)
    kinds: dict[str, dict[str, Any]] = {}
    for gpu, mode in sorted({(s.gpu, s.mode) for s in samples}):
        kinds.setdefault(gpu, {})[mode] = _entry([s for s in samples if (s.gpu, s.mode) == (gpu, mode)])
    per_gpu: dict[str, dict[str, dict[str, Any]]] = {}
    for gpu, n, mode in sorted({(s.gpu, n, s.mode) for n, s in sharded}):
        mine = [s for m, s in sharded if (s.gpu, m, s.mode) == (gpu, n, mode)]
        per_gpu.setdefault(gpu, {}).setdefault(n, {})[mode] = _entry(mine)
    return {
        "what": "GB a CUDA process held outside PyTorch's caching allocator (CUDA context, library handles,"
        " kernels): whole-device peak - peak reserved; the largest per GPU kind and mode",
        "how": "python -m fabric_memory_recipes.planning.overhead "
        + " ".join(map(str, folders))
        + " --write",
        "kinds": kinds,
        "sharded": per_gpu,
    }


RESERVED_RULE = (
    "the simulated step replayed through a model of the caching allocator (planning/simulation/allocator.py)"
    " x the largest measured/replayed ratio of the committed eager runs (planning/reserved.py)"
)


def replayed_card(replayed_gb: float | None, over: Overhead, processes: int = 1) -> dict[str, Any]:
    """One simulated step's card from its allocator replay (``replayed_gb``:
    planning/simulation/allocator.py), as the ladder's estimate and the estimate for your own model both
    take it: the replay is the prediction of peak reserved (``replayed_reserved_gb``; + the card overhead, ``replayed_device_gb``:
    what ``--check`` compares with a run), and what a planner budgets is the replay x
    :data:`~fabric_memory_recipes.planning.simulation.allocator.RESIDUAL`, the largest measured/replayed
    ratio of the committed eager runs (``peak_reserved_gb``; + the overhead, ``device_peak_gb``: what fits
    a card)."""
    budget = None if replayed_gb is None else replayed_gb * RESIDUAL
    device = None if replayed_gb is None or over.gb is None else replayed_gb + over.gb
    return {
        "peak_reserved_gb": None if budget is None else round(budget, 6),
        "device_peak_gb": None if budget is None or over.gb is None else round(budget + over.gb, 6),
        "replayed_reserved_gb": None if replayed_gb is None else round(replayed_gb, 6),
        "replayed_device_gb": None if device is None else round(device, 6),
        "reserved_rule": RESERVED_RULE,
        "reserved_residual": RESIDUAL,
        "reserved_residual_source": RESIDUAL_SOURCE,
        "overhead_gb": over.gb,
        "overhead_source": over.source,
        "overhead_legend": over.phrase(processes),  # 'measured' only where it was
    }


def card_prediction(
    allocated_gb: float | None,
    *,
    replayed_gb: float | None = None,
    graphs: bool,
    compiled: bool,
    gpu: str,
    sharded: ReservedRatio | None = None,
    table: dict[str, Any] | None = None,
    devices: int = 1,
) -> dict[str, Any]:
    """A simulated step taken to the card, per GPU, with the overhead of ``gpu`` in its mode and with
    ``devices`` processes on the machine (:func:`overhead_per_gpu`). One process: :func:`replayed_card`
    of the step's allocator replay ``replayed_gb``. Several: the simulated peak allocated x the largest
    reserved/simulated ratio of the committed sharded runs (``sharded``; the replay does not model FSDP's
    all-gathers and reduce-scatters on streams of their own), the prediction and the budget
    alike."""
    over = overhead_per_gpu(gpu, "compiled" if compiled or graphs else "eager", devices, table)
    if devices > 1:
        ratio = sharded or committed_sharded_ratio()
        reserved = None if allocated_gb is None else allocated_gb * ratio.ratio
        device = None if reserved is None or over.gb is None else reserved + over.gb
        card = {
            "peak_reserved_gb": reserved,
            "device_peak_gb": device,
            "replayed_reserved_gb": None,
            "replayed_device_gb": None,
            "reserved_rule": f"peak allocated x {ratio.line()}",
            "reserved_ratio": ratio.ratio,
            "overhead_gb": over.gb,
            "overhead_source": over.source,
            "overhead_legend": over.phrase(devices),
        }
    else:
        card = replayed_card(replayed_gb, over)
    return {"gpu": gpu, "peak_allocated_gb": allocated_gb, **card, "devices": devices}


def predicted_reserved(card: dict[str, Any]) -> tuple[float | None, float | None]:
    """(peak reserved, whole-device peak) that a card predicts for a run: the replay's, or with several
    processes the sharded ratio's (what ``--check`` compares)."""
    if card["devices"] > 1:
        return card["peak_reserved_gb"], card["device_peak_gb"]
    return card["replayed_reserved_gb"], card["replayed_device_gb"]


@functools.cache
def committed_sharded_ratio() -> ReservedRatio:
    """The reserved/simulated ratio of runs of several processes, from the committed sharded runs."""
    return sharded_reserved_ratio((str(RESULTS_DIR),))


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m fabric_memory_recipes.planning.overhead", description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="*", default=["results"], help="results folders, read recursively")
    p.add_argument("--write", action="store_true", help=f"store the table in {TABLE_FILE.relative_to(REPO)}")
    args = p.parse_args(argv)
    table = measure(args.folders)
    for gpu, modes in table["kinds"].items():
        for mode, e in modes.items():
            print(
                f"{gpu} {mode}: {e['overhead_gb']:.3f} GB (largest of {e['runs']}, smallest"
                f" {e['smallest_gb']:.3f}; {', '.join(e['methods'])}; {e['largest_from']})"
            )
    for gpu, counts in table["sharded"].items():
        for n, modes in counts.items():
            for mode, e in modes.items():
                print(
                    f"{gpu} x{n} {mode}: {e['overhead_gb']:.3f} GB per GPU (largest of {e['runs']},"
                    f" smallest {e['smallest_gb']:.3f}; {e['largest_from']})"
                )
    if not table["kinds"]:
        print("no run with a measured overhead in " + ", ".join(args.folders), file=sys.stderr)
        return 2
    if args.write:
        write_json_atomic(str(TABLE_FILE), table)
        kinds_table.cache_clear()
        print(f"-> {TABLE_FILE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

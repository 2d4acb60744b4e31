"""The card overhead as measured: device memory a CUDA process holds outside PyTorch's caching
allocator (CUDA context, library handles, loaded kernels), per GPU kind and mode, read from the committed
table ``device_overhead.json`` beside this module.

The measurement layer owns it because a run needs it: ``--memory-budget-gb X`` caps the allocator at X
less this overhead (training/lifecycle.py), so that a capped run stands for an X GB card. The planner adds
it to a predicted peak reserved to answer for a card. How the table is made from results JSONs, and
rewritten: ``python -m fabric_memory_recipes.planning.overhead``.

Several processes on one machine hold more outside the allocator per GPU than one process does: NCCL's
communicators and buffers, and a context per process. The table's ``sharded`` part holds that per GPU
kind, processes per machine and mode, measured by the committed sharded runs; :func:`overhead_per_gpu`
is what a planner asks with the device count.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fabric_memory_recipes.measurement.results_file import kinds_table

TABLE_FILE = Path(__file__).with_name("device_overhead.json")
OVERHEAD_MODES = ("eager", "compiled", "inference")


def overhead_mode(mode_or_config: str | dict[str, Any]) -> str:
    """'eager' or 'compiled' for a planner mode ('fast', 'eager') or a results JSON's config; 'inference' for
    ``--infer`` (eager, without the backward's and the optimizer's kernels: less outside the allocator)."""
    if isinstance(mode_or_config, dict):
        c = mode_or_config
        if c.get("infer"):
            return "inference"
        return "compiled" if c.get("compile") or c.get("cuda_graphs") else "eager"
    if mode_or_config in ("eager", "inference"):
        return mode_or_config
    return "compiled"


def load_table(path: str = str(TABLE_FILE)) -> dict[str, Any]:
    """The committed table (an empty one when the file is missing or unreadable)."""
    return kinds_table(path)


@dataclasses.dataclass(frozen=True)
class Overhead:
    """The overhead the planner adds for a GPU kind and mode, and where it comes from."""

    gpu: str
    mode: str
    gb: float | None  # None: nothing measured anywhere
    source: str  # one line: the measurement, or the fallback and why
    measured: bool = True  # False: another kind's, mode's or process count's value, assumed

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "mode": self.mode,
            "overhead_gb": self.gb,
            "source": self.source,
            "measured": self.measured,
        }

    def phrase(self, processes: int = 1) -> str:
        """How a planner's legend names it: 'measured' only when it was, for this kind, mode and count."""
        what = f"{self.gpu}{f' x{processes}' if processes > 1 else ''} {self.mode}"
        if self.gb is None:
            return f"no card overhead ({what}: none measured)"
        if self.measured:
            return f"the card overhead measured for {what} ({self.gb:.2f} GB{' per GPU' * (processes > 1)})"
        return f"a card overhead assumed for {what}, which no run measured: {self.source.split(': ', 1)[-1]}"


def card_overhead(gpu: str, mode: str, table: dict[str, Any] | None = None) -> Overhead:
    """The measured overhead of ``gpu`` in ``mode`` ('fast'/'eager', 'compiled'/'eager' or 'inference'); a kind
    without a measurement of the mode takes the largest of the mode measured on other kinds (the mode decides
    it more than the card: an H200's mT5 generate() held 0.71 GB outside the allocator, within the H100's
    20 inference runs' 0.71-0.74, where both kinds' compiled training runs hold 0.79-0.90), else inference its
    kind's eager one, else the largest measured one (said in ``source``)."""
    table = load_table() if table is None else table
    mode = overhead_mode(mode)
    kinds = table.get("kinds") or {}
    entry = (kinds.get(gpu) or {}).get(mode)
    where = f"{TABLE_FILE.name}" if table is load_table() else "the table"
    if entry:
        return Overhead(
            gpu,
            mode,
            entry["overhead_gb"],
            f"{gpu} {mode}: {entry['overhead_gb']:.2f} GB, the largest of {entry['runs']} measured"
            f" run(s) ({', '.join(entry['methods'])}; largest: {entry['largest_from']}; {where})",
        )
    same_mode = [(e[mode]["overhead_gb"], g) for g, e in kinds.items() if mode in e]
    if same_mode:
        value, g = max(same_mode)
        return Overhead(
            gpu,
            mode,
            value,
            measured=False,
            source=f"no {gpu} {mode} measurement: {g}'s {mode} overhead is assumed ({value:.2f} GB; {where})",
        )
    eager = (kinds.get(gpu) or {}).get("eager")
    if mode == "inference" and eager:  # training loads more kernels than inference: an upper bound
        return Overhead(
            gpu,
            mode,
            eager["overhead_gb"],
            measured=False,
            source=f"no {gpu} inference measurement: the eager training runs' overhead is assumed"
            f" ({eager['overhead_gb']:.2f} GB; {where})",
        )
    known = [(e["overhead_gb"], g, m) for g, modes in kinds.items() for m, e in modes.items()]
    if not known:
        return Overhead(
            gpu, mode, None, f"no measured overhead in {where}: the whole-device peak is unknown", False
        )
    value, g, m = max(known)
    return Overhead(
        gpu,
        mode,
        value,
        measured=False,
        source=f"no {gpu} {mode} measurement: the largest measured overhead is assumed"
        f" ({g} {m}, {value:.2f} GB; {where})",
    )


def overhead_per_gpu(gpu: str, mode: str, devices: int, table: dict[str, Any] | None = None) -> Overhead:
    """What one GPU of a run with ``devices`` processes on the machine holds outside the caching
    allocator: :func:`card_overhead` for one process; for several, the largest measured by committed runs
    of ``devices`` processes of that kind and mode. Without one: the closest measurement of several
    processes, the same mode first (compiled and eager differ most), then the same process count, then
    the same kind, the largest among equally close ones (said in ``source``, ``measured`` False); else
    None (never the one-process value, which lacks NCCL)."""
    if devices <= 1:
        return card_overhead(gpu, mode, table)
    table = load_table() if table is None else table
    mode = overhead_mode(mode)
    where = f"{TABLE_FILE.name}" if table is load_table() else "the table"
    kind = (table.get("sharded") or {}).get(gpu) or {}
    entry = (kind.get(str(devices)) or {}).get(mode)
    if entry:
        return Overhead(
            gpu,
            mode,
            entry["overhead_gb"],
            f"{gpu} x{devices} {mode}: {entry['overhead_gb']:.2f} GB per GPU, the largest of"
            f" {entry['runs']} measured sharded run(s) ({entry['largest_from']}; {where})",
        )
    known = [
        ((m == mode, n == str(devices), g == gpu, e["overhead_gb"]), g, n, m)
        for g, ns in (table.get("sharded") or {}).items()
        for n, modes in ns.items()
        for m, e in modes.items()
    ]
    if not known:
        return Overhead(
            gpu,
            mode,
            None,
            f"no run of several processes measured in {where}: the whole-device"
            " peak per GPU is unknown (NCCL's buffers are outside the allocator)",
            False,
        )
    (*_, value), g, n, m = max(known)
    return Overhead(
        gpu,
        mode,
        value,
        measured=False,
        source=f"no {gpu} x{devices} {mode} measurement: the closest measured is assumed"
        f" ({g} x{n} {m}, {value:.2f} GB per GPU; {where})",
    )

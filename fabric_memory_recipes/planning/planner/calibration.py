"""What the committed GPU runs say, for the planner (``python -m fabric_memory_recipes.planning --fit``): how far a
sharded run's peak *reserved* memory sits above the simulated peak *allocated* (:func:`sharded_reserved_ratio`;
one GPU's is the allocator replay, planning/reserved.py), and how fast a configuration trained (:func:`measured_speed`; ``fabric_memory_recipes.planning.planner.speed`` models the rest).

Every results JSON below the folders given (by default the repository's ``results/``, recursively) is
read the same way, so new runs (a ``results/published/h100/compare/`` call, say) count without a change here. A
run counts if it succeeded on one CUDA device with a ViT model and its recipe declares a single-GPU
rung; its technique set is read from that rung (``techniques.TechniqueSet.of_config``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
from pathlib import Path
from typing import Any

from fabric_memory_recipes.config import DATA_DIR, VIT_MODELS, RunConfig
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.measurement.results_file import SCHEMA_VERSION, gpu_slug
from fabric_memory_recipes.techniques import TechniqueSet

REPO = Path(__file__).resolve().parents[3]  # the checkout
RESULTS_DIR = REPO / "results"  # the committed runs (results/published/)
RUNS_DIR = REPO / "runs"  # a user's own runs: they calibrate the planner for that user's GPU
REFERENCE_GPU = "h100"  # the kind with a measured ladder: what other kinds fall back to
# Runs whose memory no longer says what the code does (their speed still counts), and why.
SUPERSEDED_MEMORY = {
    "published/h100/history/fast-probe/05_gradient_accumulation.json": "made before fast mode made the gradients before the"
    " warm-up and returned free pages before the first optimizer step (docs/fast_mode.md)",
}
# Runs that calibrate nothing, in memory or speed, and why.
_RUNG_11_COMPARED = (
    "the comparison's run of rung 11 with its side-stream copies (results/published/h100/compare/NOTES.md,"
    " calls 5 and 6): its eager 29.9 img/s is below the other eager runs of that code (35.1 and 35.7 img/s,"
    " compare/NOTES.md and levers/NOTES.md), unexplained (not profiled); rung 11 calibrates on the"
    " ladder's runs"
)
SUPERSEDED = {
    "published/h100/compare/runs/11_activation_offload-fast.json": _RUNG_11_COMPARED,
    "published/h100/compare/runs/11_activation_offload-eager.json": _RUNG_11_COMPARED,
}
# Recipes whose runs calibrate the model but are not the runs of a planned command (rung 15 compiles
# the whole model, the planned Adam rungs compile each block).
NOT_LOOKED_UP = {"15_speed"}
# What nothing committed can replace (stated in the planner's output with this reason).
BUILT_IN_RESERVED_RATIO = (1.15, "no committed run with an estimate found: assumed")


@dataclasses.dataclass(frozen=True)
class Measured:
    """One committed run, as the planner reads it."""

    path: str  # relative to the results folder it was found in
    recipe: str
    gpu: str
    model: str
    precision: str
    batch_size: int
    accumulation_steps: int
    micro: int  # config.micro_batch_size: RunConfig works it out, the JSON records it
    mode: str  # fast (compiled + graphs) | eager | compiled | graphs
    techniques: TechniqueSet  # the rung's optimizer and planned techniques
    images_per_s: float | None
    reserved_gb: float  # the whole run's peak (model load, training with its warm-up, evaluation)
    estimate_gb: float | None  # the simulated peak allocated the run recorded
    offloaded_gb: float | None  # rungs 11 and 14: bytes one micro-batch sent to the host

    @property
    def step_s(self) -> float:
        return self.batch_size / self.images_per_s


def run_mode(config: dict[str, Any]) -> str:
    compiled, graphs = bool(config.get("compile")), bool(config.get("cuda_graphs"))
    return {(True, True): "fast", (False, True): "graphs", (True, False): "compiled"}.get(
        (compiled, graphs), "eager"
    )


@functools.cache
def rung_of(recipe: str) -> RunConfig | None:
    """The rung ``recipes/<recipe>.py`` declares (read once), or None if there is none."""
    try:
        return declared_rung(recipe)[0]
    except (FileNotFoundError, ValueError, SyntaxError):
        return None


# Folders whose runs shared the GPU with other runs (their NOTES.md say so): each run's memory is its
# own process's, but its speed is not the rung's, so they calibrate memory only.
SHARED_GPU_FOLDERS = ("convergence", "estimate")


def _published_kind(path: Path, root: Path) -> str | None:
    """``compare`` for ``.../published/<gpu>/compare/...``: what kind of committed run a file is."""
    parts = path.relative_to(root).parts
    if "published" in parts[:-1]:
        i = parts.index("published")
        return parts[i + 2] if len(parts) > i + 3 else None
    return parts[0] if len(parts) > 1 else None


def shared_gpu(path: Path, root: Path) -> bool:
    return _published_kind(path, root) in SHARED_GPU_FOLDERS


# Folders that repeat committed configurations calibrate nothing: counted, they would weigh those
# configurations two or three times. devtools.ab_ladder's (results/published/<gpu>/ab/)
# run them on two versions of the code to show that the numbers did not move; results/published/<gpu>/quick/
# is a committed sample of ./run_all.sh --quick. A user's own runs (runs/quick/, say) do calibrate.
# results/published/<gpu>/wip/ holds first measurements of code still being worked on: they
# calibrate nothing until that code's evidence is complete. The convergence benchmark's runs (digits at
# 64 px, sharing the GPU through MPS) are no configuration the planner plans: they calibrate nothing.
# results/published/<gpu>/levers/ holds what a lever did: the code before and after it, side by side,
# and sweeps of one rung's flags; the old code's runs must not calibrate the new.
# results/published/<gpu>/your-model/ proves the estimate for models outside the ladder: the ladder's
# planner calibrates on the ladder's own runs.
REPEAT_KINDS = ("ab", "quick", "wip", "convergence", "levers", "your-model")


def repeats_committed(path: Path, root: Path) -> bool:
    parts = path.relative_to(root).parts
    return "published" in parts[:-1] and _published_kind(path, root) in REPEAT_KINDS


def _read(path: Path, root: Path) -> Measured | None:
    if repeats_committed(path, root) or path.relative_to(root).as_posix() in SUPERSEDED:
        return None
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("schema_version") != SCHEMA_VERSION or d.get("status") != "ok":
        return None
    config, memory = d.get("config") or {}, d.get("memory") or {}
    prov, timing = d.get("provenance") or {}, d.get("timing") or {}
    rung = rung_of(str(d.get("recipe")))
    if memory.get("kind") != "cuda" or prov.get("world_size", 1) != 1 or rung is None:
        return None
    if config.get("memory_timeline") or config.get("snapshot") or config.get("lost_updates"):
        return None  # profiled or instrumented: its time is not the rung's
    if config.get("memory_budget_gb"):
        return None  # capped (devtools.planner_proof): its peak shows the cap, and it tests the planner
    if config.get("bf16_update") not in (None, "plain"):
        return None  # another optimizer implementation (fabric_memory_recipes/training/techniques/bf16.py) than the rung's
    if rung.sharding != "none" or config.get("model") not in VIT_MODELS or not memory.get("peak_reserved_gb"):
        return None
    if rung.weights_offload:
        return None  # rung 16: its own copy streams' pools, and not a planned command (fit.NOT_PLANNED)
    if not config.get("micro_batch_size"):
        return None  # a JSON from before the micro-batch was recorded
    reserved = max(memory.get("run_peak_reserved_gb") or 0.0, memory["peak_reserved_gb"])
    return Measured(
        path=str(path.relative_to(root)),
        recipe=d["recipe"],
        gpu=gpu_slug(prov.get("gpu_name")),
        model=config["model"],
        precision="32-true" if config.get("precision") == "32" else config.get("precision"),
        batch_size=int(config["batch_size"]),
        accumulation_steps=int(config.get("accumulation_steps") or 1),
        micro=int(config["micro_batch_size"]),
        mode=run_mode(config),
        techniques=TechniqueSet.of_config(rung),
        images_per_s=None if shared_gpu(path, root) else timing.get("images_per_s"),
        reserved_gb=reserved,
        estimate_gb=(d.get("estimate") or {}).get("peak_allocated_gb"),
        offloaded_gb=(d.get("extra") or {}).get("offloaded_gb_per_micro_batch"),
    )


def _shipped_runs() -> list[dict[str, Any]]:
    """The committed runs as the package ships them (fabric_memory_recipes/planning/planner/snapshot.py)."""
    try:
        return json.loads((DATA_DIR / "planner_runs.json").read_text())
    except (OSError, ValueError):
        return []


@functools.cache
def load_runs(folders: tuple[str, ...] = (str(RESULTS_DIR), str(RUNS_DIR))) -> tuple[Measured, ...]:
    """Every usable run below ``folders`` (recursively; a folder that does not exist has none)."""
    found = []
    for folder in folders:
        root = Path(folder)
        if root == RESULTS_DIR and not root.is_dir():  # an installed wheel: the runs it ships
            found += [
                Measured(**{**r, "techniques": TechniqueSet(**r["techniques"])}) for r in _shipped_runs()
            ]
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.json")):
            run = _read(path, root)
            if run is not None:
                found.append(run)
    return tuple(found)


# ------------------------------------------------------------------------------------------- memory
@dataclasses.dataclass(frozen=True)
class ReservedRatio:
    """Peak reserved (the whole run) over the simulated peak allocated: the largest in the runs."""

    mode: str
    ratio: float
    runs: int
    smallest: float
    worst: str  # the run that sets it, or the reason for a built-in value

    def line(self) -> str:
        if not self.runs:
            return f"{self.mode}: x {self.ratio:.3f} ({self.worst})"
        return (
            f"{self.mode}: x {self.ratio:.3f}, the largest of {self.runs} committed runs"
            f" ({self.smallest:.3f}-{self.ratio:.3f}; largest: {self.worst})"
        )


def measured_speed(
    runs: tuple[Measured, ...],
    gpu: str,
    model: str,
    techniques: TechniqueSet,
    precision: str,
    batch_size: int,
    accumulation_steps: int,
    mode: str,
) -> tuple[float, list[str]] | None:
    """The median img/s of the committed runs of exactly this configuration on ``gpu``, and their files."""
    same = [
        r
        for r in runs
        if r.images_per_s
        and r.recipe not in NOT_LOOKED_UP
        and r.gpu == gpu
        and r.model == model
        and (r.techniques, r.precision, r.batch_size, r.accumulation_steps, r.mode)
        == (techniques, precision, batch_size, accumulation_steps, mode)
    ]
    if not same:
        return None
    return statistics.median(r.images_per_s for r in same), sorted(r.path for r in same)


# ------------------------------------------------------------------------------ several processes
def sharded_reserved_ratio(folders: tuple[str, ...] = (str(RESULTS_DIR),)) -> ReservedRatio:
    """Peak reserved per GPU over the simulated peak allocated per GPU, the largest of the committed
    sharded runs (several processes, CUDA, ok, with the estimate they recorded): FSDP's all-gathers and
    reduce-scatters allocate on streams of their own, so a one-GPU ratio does not carry over. None
    committed: :data:`BUILT_IN_RESERVED_RATIO`, said in the ratio's line."""
    pairs = []
    for folder in folders:
        root = Path(folder)
        for path in sorted(root.rglob("*.json")) if root.is_dir() else []:
            if repeats_committed(path, root) or path.relative_to(root).as_posix() in SUPERSEDED:
                continue
            try:
                d = json.loads(path.read_text())
            except (OSError, ValueError, UnicodeDecodeError):
                continue
            if (
                not isinstance(d, dict)
                or d.get("schema_version") != SCHEMA_VERSION
                or d.get("status") != "ok"
            ):
                continue
            memory, prov = d.get("memory") or {}, d.get("provenance") or {}
            estimate = (d.get("estimate") or {}).get("peak_allocated_gb")
            if memory.get("kind") != "cuda" or prov.get("world_size", 1) < 2 or not estimate:
                continue
            reserved = max(memory.get("run_peak_reserved_gb") or 0.0, memory.get("peak_reserved_gb") or 0.0)
            if reserved:
                pairs.append((reserved / estimate, str(path.relative_to(root))))
    if not pairs:
        value, why = BUILT_IN_RESERVED_RATIO
        return ReservedRatio("sharded", value, 0, value, why.replace("run", "sharded run"))
    worst = max(pairs)
    return ReservedRatio("sharded", worst[0], len(pairs), min(pairs)[0], worst[1])

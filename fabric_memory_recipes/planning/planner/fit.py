"""Which rungs does my GPU need? The planner behind ``python -m fabric_memory_recipes.planning --fit 6GB``.

It combines the ladder's techniques as the recipes run them: precision; micro-batch x accumulation
for the requested effective batch; the optimizer (Adam, SGD, 8-bit Adam); activation checkpointing,
activation offload and the step in backward (each with the rung that runs it); fast or eager mode.
For each combination it predicts

* the peak *reserved* memory: the simulated step replayed through a model of the caching allocator
  (planning/simulation/allocator.py; fast mode's CUDA graphs under expandable segments:
  planning/simulation/expandable.py) x the largest measured/replayed ratio of the committed eager runs,
  as your own model's estimate budgets it (:func:`~fabric_memory_recipes.planning.overhead.replayed_card`),
* the whole-device peak a card must hold: that plus the measured card overhead of the GPU kind and
  mode (CUDA context, libraries, kernels: :mod:`~fabric_memory_recipes.planning.overhead`); a
  budget is a card's memory, and a configuration fits when this is within it, and
* the throughput on the chosen GPU kind: the committed runs of exactly that command where they exist,
  else :class:`~fabric_memory_recipes.planning.planner.calibration.SpeedModel`.

The search is fast: combinations are visited from the fastest down; one whose weights, gradients and
optimizer state alone (arithmetic, no simulation) exceed the budget is ruled out unsimulated, and the
search stops once ``top`` fitting ones are faster than anything left. Fast and eager mode share one
simulation (each mode takes its own replay of it), and simulations are cached on disk (``FMR_PLAN_CACHE``, default
``~/.cache/fabric-memory-recipes/simulations.json``), keyed by the estimator's source and torch's
version.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from fabric_memory_recipes.config import DATA_DIR, RECIPES_DIR, RunConfig
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.measurement.card_overhead import Overhead, card_overhead
from fabric_memory_recipes.planning.overhead import replayed_card
from fabric_memory_recipes.planning.plan import CUDA_WORKSPACE_BYTES, GB, allocator_of, plan_for
from fabric_memory_recipes.planning.planner import calibration
from fabric_memory_recipes.planning.planner import speed as speed_mod
from fabric_memory_recipes.planning.simulation.allocator import RESIDUAL
from fabric_memory_recipes.planning.simulation.cache import SimulationCache
from fabric_memory_recipes.planning.simulation.simulate import simulate
from fabric_memory_recipes.techniques import (
    ACTIVATION_OFFLOAD,
    LOWBIT_STATE,
    MODES,
    OPTIMIZER_IN_BACKWARD,
    OPTIMIZERS,
    PRECISIONS,
    TechniqueSet,
    subset,
)
from fabric_memory_recipes.training.models import meta_ladder_model

# What the ladder's planner combines: one precision of each memory and speed (bf16-mixed has 16-mixed's),
# the optimizers the ladder's rungs run (AdamW's memory and speed are Adam's), every mode.
PLANNED_PRECISIONS = subset(PRECISIONS, "bf16-true", "16-mixed", "32-true")
PLANNED_OPTIMIZERS = subset(OPTIMIZERS, "adam", "sgd", LOWBIT_STATE.name)
# Numbered rungs that are not the recipe of a planned command, and why.
NOT_PLANNED = {
    "07_init_module": "rung 06's step; its comparison phase also builds the fp32 model on the GPU",
    "15_speed": "rung 05's memory; whole-model compile is not a memory technique",
    "16_weights_on_cpu": "its step is the CPU's Adam step and the PCIe copies, which the speed model does not"
    " model (its memory: python -m fabric_memory_recipes.planning --recipe 16)",
}


def rung_names(folder: Path = RECIPES_DIR) -> list[str]:
    """The numbered recipes in ``folder``; without it (an installed wheel), those the package ships."""
    if folder.is_dir():
        return sorted(p.stem for p in folder.glob("[0-9][0-9]_*.py"))
    return sorted(json.loads((DATA_DIR / "rungs.json").read_text()))


def families(folder: Path = RECIPES_DIR) -> dict[TechniqueSet, list[RunConfig]]:
    """The single-GPU rungs by technique set (``TechniqueSet.of_config``)."""
    found: dict[TechniqueSet, list[RunConfig]] = {}
    for name in rung_names(folder):
        rung, _ = declared_rung(name, folder)
        if rung.sharding == "none" and not rung.cpu_variant and rung.recipe not in NOT_PLANNED:
            found.setdefault(TechniqueSet.of_config(rung), []).append(rung)
    return found


@dataclasses.dataclass
class Candidate:
    """One configuration: the rung that runs it, its flags, and what the planner predicts for it."""

    rung: RunConfig  # the family's recipe, with this candidate's flags
    mode: str
    techniques: TechniqueSet
    lower_bound_gb: float  # predicted card peak from weights + gradients + optimizer state alone
    speed_bound: float  # img/s with nothing offloaded: no more than this
    images_per_s: float | None = None  # the prediction, once known
    speed_source: str = "model"
    simulated_gb: float | None = None
    offloaded_gb: float | None = None
    replayed_gb: float | None = None  # peak reserved, the allocator replay
    predicted_gb: float | None = None  # peak reserved budgeted: the replay x RESIDUAL (replayed_card)
    overhead_gb: float = 0.0  # the card overhead of the GPU kind and mode (0 when none is measured)

    @property
    def card_gb(self) -> float | None:
        """The predicted whole-device peak: peak reserved + the card overhead."""
        return None if self.predicted_gb is None else self.predicted_gb + self.overhead_gb

    @property
    def key(self) -> tuple:
        """What the simulation depends on (later micro-batches repeat the second: k >= 2 share one)."""
        r = self.rung
        t = self.techniques
        return (r.model, r.precision, t.optimizer, t.used, r.micro_batch_size, min(r.accumulation_steps, 2))

    def argv(self) -> list[str]:
        """The recipe's flags that differ from its rung's defaults, and the mode."""
        base = calibration.rung_of(self.rung.recipe)
        argv = []
        for name in ("precision", "batch_size", "accumulation_steps", "model"):
            if getattr(self.rung, name) != getattr(base, name):
                argv += ["--" + name.replace("_", "-"), str(getattr(self.rung, name))]
        return argv + ["--mode", self.mode]

    @property
    def command(self) -> str:
        return shlex.join(["python", f"recipes/{self.rung.recipe}.py", *self.argv()])

    def label(self) -> str:
        r = self.rung
        batch = f"{r.batch_size}" + (
            f" = {r.micro_batch_size} x {r.accumulation_steps}" if r.accumulation_steps > 1 else ""
        )
        return f"{r.precision}, batch {batch}, {self.techniques.label()}, {self.mode}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "recipe": self.rung.recipe,
            "argv": self.argv(),
            "mode": self.mode,
            "precision": self.rung.precision,
            "batch_size": self.rung.batch_size,
            "accumulation_steps": self.rung.accumulation_steps,
            "technique": self.techniques.label(),
            "predicted_peak_gb": self.predicted_gb,
            "simulated_peak_allocated_gb": self.simulated_gb,
            "replayed_peak_reserved_gb": self.replayed_gb,
            "overhead_gb": self.overhead_gb,
            "predicted_device_peak_gb": self.card_gb,
            "lower_bound_gb": self.lower_bound_gb,
            "predicted_images_per_s": self.images_per_s,
            "speed_source": self.speed_source,
        }


def pick_rung(family: list[RunConfig], precision: str, batch: int, k: int, model: str) -> RunConfig:
    """The family's rung that needs the fewest changed flags (a tie: the later rung)."""
    want = {"precision": precision, "batch_size": batch, "accumulation_steps": k}
    best = min(reversed(family), key=lambda r: sum(getattr(r, n) != v for n, v in want.items()))
    return best.with_flags(**want, model=model)


def static_bytes(rung: RunConfig, techniques: TechniqueSet, parameters: int) -> float:
    """Weights, plus gradients kept across micro-batches, plus optimizer state, plus the cuBLAS
    workspace: all alive at any steady-state peak, so the simulated peak is never below this."""
    width = 2 if rung.precision in ("bf16-true", "16-true") else 4
    grads = width if rung.accumulation_steps > 1 and not techniques.uses(OPTIMIZER_IN_BACKWARD) else 0
    state = {"adam": 2 * width, "adamw": 2 * width, "adamw8bit": 2, "sgd-momentum": width}.get(
        techniques.optimizer, 0
    )
    return parameters * (width + grads + state) + CUDA_WORKSPACE_BYTES


def order(c: Candidate) -> tuple:
    """Fastest first; on a tie, fewer techniques, then less memory."""
    return (-c.images_per_s, c.techniques.count(), c.card_gb)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_candidates(
    batch_size: int,
    model: str,
    precisions=PLANNED_PRECISIONS,
    modes=MODES,
    optimizers=PLANNED_OPTIMIZERS,
    folder: Path = RECIPES_DIR,
) -> list[tuple[RunConfig, TechniqueSet, str]]:
    """Every (rung with flags, technique set, mode) the recipes can run for ``batch_size``."""
    out = []
    for used, family in families(folder).items():
        if used.optimizer not in optimizers:
            continue
        for precision in precisions:
            for k in [1] if used.uses(OPTIMIZER_IN_BACKWARD) else divisors(batch_size):  # no accumulation
                rung = pick_rung(family, precision, batch_size, k, model)
                out += [(rung.with_flags(mode=mode), used, mode) for mode in modes]
    return out


# ---------------------------------------------------------------------------------------- the search
@dataclasses.dataclass
class Fit:
    """The planner's answer for one budget."""

    budget_gb: float
    batch_size: int
    model: str
    gpu: str
    fits: list[Candidate]  # fastest first, at most ``top``
    rejected: Candidate | None  # the fastest predicted not to fit, among those faster than the last pick
    smallest: Candidate | None  # when nothing fits: the one with the smallest predicted peak
    considered: int
    bounded: int  # ruled out by arithmetic, unsimulated
    cache: SimulationCache
    speed: speed_mod.SpeedModel
    overheads: dict[str, Overhead]  # by mode: what a card holds beside the allocator


class Planner:
    """Predictions for one model, effective batch and GPU kind; :meth:`fit` answers one budget (a
    planner answers several budgets from the same simulations)."""

    def __init__(
        self,
        batch_size: int,
        model: str = "vit_l_16",
        gpu: str = calibration.REFERENCE_GPU,
        *,
        precisions=PLANNED_PRECISIONS,
        modes=MODES,
        optimizers=PLANNED_OPTIMIZERS,
        folders: tuple[str, ...] | None = None,
        cache: SimulationCache | None = None,
        recipes: Path = RECIPES_DIR,
        overhead_table: dict | None = None,
    ) -> None:
        self.batch_size, self.model, self.gpu = batch_size, model, gpu
        self.overheads = {m: card_overhead(gpu, m, overhead_table) for m in MODES}
        self.runs = calibration.load_runs(folders or (str(calibration.RESULTS_DIR),))
        self.parameters = sum(p.numel() for p in meta_ladder_model(model).parameters())
        self.speed = speed_mod.speed_model(gpu, model, self.parameters, self.runs)
        self.cache = cache or SimulationCache()
        self.candidates = []
        for rung, used, mode in enumerate_candidates(
            batch_size, model, precisions, modes, optimizers, recipes
        ):
            over = self.overheads[mode].gb or 0.0  # the replay holds at least the static bytes
            bound = RESIDUAL * static_bytes(rung, used, self.parameters) / GB + over
            c = Candidate(rung, mode, used, bound, 0.0, overhead_gb=over)
            measured = calibration.measured_speed(
                self.runs, gpu, model, used, rung.precision, batch_size, rung.accumulation_steps, mode
            )
            if measured:
                c.images_per_s, files = measured
                c.speed_source = "measured: " + ", ".join(files)
                c.speed_bound = c.images_per_s
            else:
                c.speed_bound = self._speed(c, 0.0)
                if not used.uses(ACTIVATION_OFFLOAD):  # offload's speed needs the simulated bytes
                    c.images_per_s = c.speed_bound
            self.candidates.append(c)
        self.candidates.sort(key=lambda c: (-c.speed_bound, c.techniques.count(), c.lower_bound_gb))

    def _speed(self, c: Candidate, offloaded_gb: float) -> float:
        r = c.rung
        step = self.speed.step_s(
            r.precision,
            c.techniques,
            r.micro_batch_size,
            r.accumulation_steps,
            c.mode,
            offloaded_gb,
            self.parameters,
        )
        return r.batch_size / step

    def predict(self, c: Candidate) -> Candidate:
        """Simulate (or take from the cache): the predicted peak reserved and, with offload, the speed."""
        if c.predicted_gb is None:
            rung = c.rung.with_flags(accelerator="cuda")

            def simulated():
                return simulate(meta_ladder_model(rung.model), plan_for(rung), model_name=rung.model)

            # the replay of the mode's allocator: fast mode's CUDA graphs under expandable segments, or the default
            got = self.cache.lookup(c.key, simulated, c.command, allocator_of(rung))
            c.simulated_gb, c.offloaded_gb, c.replayed_gb = got
            c.predicted_gb = replayed_card(c.replayed_gb, self.overheads[c.mode])["peak_reserved_gb"]
            if c.images_per_s is None:
                c.images_per_s = self._speed(c, c.offloaded_gb)
        return c

    def fit(self, budget_gb: float, top: int = 5) -> Fit:
        """The ``top`` fastest configurations predicted to fit, and the fastest one faster than the
        last of them that does not (a candidate bounded out by arithmetic is simulated only to show it)."""
        fits, too_big, bounded = search(self.candidates, self.predict, budget_gb, top)
        rejected = fastest(too_big, self.predict)
        smallest_one = None if fits else self.smallest()
        return Fit(
            budget_gb,
            self.batch_size,
            self.model,
            self.gpu,
            fits,
            rejected,
            smallest_one,
            len(self.candidates),
            bounded,
            self.cache,
            self.speed,
            self.overheads,
        )

    def fastest_rejected(self, budget_gb: float) -> Candidate | None:
        """The fastest configuration of all predicted not to fit (``devtools.planner_proof`` runs it).
        With accumulation (k >= 2) the peak grows with the micro-batch, so a configuration whose
        larger micro-batch fits is known to fit without a simulation."""
        fitting: list[Candidate] = []
        found: list[Candidate] = []
        for c in self.candidates:
            if found and max(x.images_per_s for x in found) >= c.speed_bound:
                break
            if c.lower_bound_gb > budget_gb:
                found.append(c)
                continue
            if any(
                self._same_plan(c, d) and c.rung.micro_batch_size <= d.rung.micro_batch_size for d in fitting
            ):
                continue
            self.predict(c)
            (fitting if c.card_gb <= budget_gb else found).append(c)
        return fastest(found, self.predict)

    @staticmethod
    def _same_plan(c: Candidate, d: Candidate) -> bool:
        same = (c.rung.precision, c.techniques, c.mode) == (d.rung.precision, d.techniques, d.mode)
        return same and min(c.rung.accumulation_steps, d.rung.accumulation_steps) >= 2

    def smallest(self) -> Candidate:
        """The candidate with the smallest predicted whole-device peak."""
        return smallest(self.candidates, self.predict)


# ------------------------------------------------------------ the search, shared with planning/your_model/sets.py
def search(candidates: list, predict, budget_gb: float, top: int) -> tuple[list, list, int]:
    """The ``top`` fastest of ``candidates`` (sorted by their speed bound, fastest first) predicted to fit
    ``budget_gb``; those found too big; how many of these arithmetic ruled out unsimulated. It stops once
    ``top`` fitting ones are faster than anything left; ``predict(c)`` fills a candidate's peak and speed."""
    fits, too_big, bounded = [], [], 0
    for c in candidates:
        if len(fits) >= top and fits[top - 1].images_per_s >= c.speed_bound:
            break  # nothing left can be faster than the picks
        if c.lower_bound_gb > budget_gb:
            bounded += c.predicted_gb is None
            too_big.append(c)
            continue
        predict(c)
        (fits if c.card_gb <= budget_gb else too_big).append(c)
        fits.sort(key=order)
    return fits[:top], too_big, bounded


def fastest(candidates: list, predict):
    """The fastest of ``candidates``, simulating only what could be it (None if there is none)."""
    best = None
    for c in sorted(candidates, key=lambda x: -x.speed_bound):
        if best is not None and best.images_per_s >= c.speed_bound:
            break
        predict(c)
        best = c if best is None or c.images_per_s > best.images_per_s else best
    return best


def smallest(candidates: list, predict):
    """The candidate with the smallest predicted whole-device peak (visited from the smallest lower bound)."""
    best = None
    for c in sorted(candidates, key=lambda x: x.lower_bound_gb):
        if best is not None and best.card_gb <= c.lower_bound_gb:
            break
        predict(c)
        if best is None or (c.card_gb, -c.images_per_s) < (best.card_gb, -best.images_per_s):
            best = c
    return best

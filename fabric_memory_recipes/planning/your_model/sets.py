"""``fmr-estimate --model SOURCE:NAME --fit SIZE``: the fastest technique sets for your own model whose
predicted whole-device peak fits a card of SIZE, each with the ``recipes/your_model.py`` command that
trains it (one set, its command, label and row: planning/your_model/choice.py).

By default a technique set changes only how memory is used, never what is trained: micro-batch x
accumulation for the requested batch; checkpointing of the repeated blocks, activation offload and the
step in backward (with the user's optimizer); with ``--devices N``, FSDP over the N GPUs (one unit per
repeated block: weights, gradients and optimizer state sharded), with checkpointing or without, with FSDP's
CPU offload or without (planning/your_model/set_speed.py), the memory per GPU. The precision and the optimizer stay the user's
(``--precision``, ``--optimizer``) unless ``--may-change precision,optimizer`` lets the planner try
others (bf16-true, bf16-mixed, 32-true; AdamW, SGD, 8-bit AdamW); each such row then carries the accuracy
cost the convergence benchmark measured for the change (planning/planner/advice.py). Memory
is simulated (planning/your_model/estimate.py: peak allocated, reserved from the allocator replay with its
margin, + the card overhead); the replay is the set's run's allocator setting (:func:`allocator_of_set`: fast
mode's expandable segments, with its CUDA graphs for an image model).

Speed (planning/your_model/set_speed.py): each set's simulated step, op by op, on the GPU kind's fitted
ceilings (planning/your_model/step_time.py);
the simulation that gives a set's memory gives its op costs. The search visits the sets from the fastest
bound down and stops once ``top`` fitting ones are faster than anything left. A set's bound is the predicted
speed of the same set without its memory techniques (the same precision, optimizer, mode, fused loss and
micro-batch x accumulation): checkpointing's recompute, offload's copies and the step in backward's hooks
only add to the step the time model sums, so the first pick is the predicted fastest set that fits. Until
that plain set is simulated, its bound is a floor of its step scaled from the one at the whole batch (the
matmul FLOPs grow with the micro-batch, the launches and the host's work do not), so a slow micro-batch is
never simulated. Ranking
the technique sets of one model is what it is for; its absolute samples/s are an estimate: ``--measure`` runs
the top ones on the GPU at hand and ranks them by what they did (planning/your_model/measure.py).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable, Iterator

from fabric_memory_recipes.planning.plan import ALLOCATORS, GB, Plan
from fabric_memory_recipes.planning.planner import advice, workers
from fabric_memory_recipes.planning.planner.fit import divisors, fastest, smallest, static_bytes
from fabric_memory_recipes.planning.simulation.costs import OpCosts
from fabric_memory_recipes.planning.simulation.modelled import STRIDED_FALLBACK
from fabric_memory_recipes.planning.your_model import offload_bound, set_speed, step_time
from fabric_memory_recipes.planning.your_model.choice import Choice
from fabric_memory_recipes.planning.your_model.estimate import (
    card,
    estimate,
    meta_user_model,
    partitioned_blocks,
    sharding_of,
)
from fabric_memory_recipes.techniques import (
    ACTIVATION_CHECKPOINTING,
    ACTIVATION_OFFLOAD,
    CHECKPOINT_MODE,
    LORA,
    MODES,
    OPTIMIZER_IN_BACKWARD,
    PRECISIONS,
    TechniqueSet,
    subset,
    switches,
)
from fabric_memory_recipes.training.techniques import refusal_of
from fabric_memory_recipes.training.your_model import models
from fabric_memory_recipes.training.your_model import runner as user_run

# What --may-change tries besides yours: one precision of each memory and speed (bf16-mixed, what a user of
# their own model trains with, for 16-mixed), and one optimizer of each kind of state (AdamW for Adam too).
PRECISIONS_TRIED = subset(PRECISIONS, "bf16-true", "bf16-mixed", "32-true")
OPTIMIZERS_TRIED = subset(user_run.OPTIMIZERS, "adamw", "sgd", "adamw8bit")
# Each set's techniques (Technique.flag): every combination but activation offload with the step in backward.
SETS = (
    (),
    (ACTIVATION_CHECKPOINTING,),
    (ACTIVATION_OFFLOAD,),
    (ACTIVATION_CHECKPOINTING, ACTIVATION_OFFLOAD),
    (OPTIMIZER_IN_BACKWARD,),
    (ACTIVATION_CHECKPOINTING, OPTIMIZER_IN_BACKWARD),
)
# What else each set is tried with: its mode, what a checkpointed block keeps, each switch its model allows.
MODES_TRIED = subset(MODES, "fast", "eager")
SPEED_SOURCE = "model: the simulated step's op costs"
MOST_AHEAD = 4 * workers.MOST  # how far down its queue the search looks for what workers may simulate


class UserPlanner:
    """Predictions for one model, batch and sequence length on one GPU kind. ``precision`` and
    ``optimizer`` are the user's; ``may_change`` (a subset of :data:`MAY_CHANGE`) lets the planner
    try the others. ``devices`` > 1: every set is FSDP over that many GPUs, its memory per GPU (the
    measured overhead of that many processes) and its samples/s those of all GPUs."""

    def __init__(
        self,
        ref: str,
        batch_size: int,
        seq_len: int,
        gpu: str = "h100",
        *,
        precision: str = "bf16-mixed",
        optimizer: str = "adamw",
        may_change: tuple[str, ...] = (),
        devices: int = 1,
        lora_rank: int = 0,
        lora_targets: str | None = None,
        target_len: int | None = None,
    ) -> None:
        self.um, self.model, self.blocks, self.found_by = meta_user_model(ref, lora_rank, lora_targets)
        lora = [LORA.flag, str(lora_rank)] if lora_rank else []
        lora += ["--lora-targets", lora_targets] if lora_rank and lora_targets else []
        self.ref, self.batch_size, self.gpu = ref, batch_size, gpu
        self.precision, self.optimizer, self.may_change = precision, optimizer, tuple(may_change)
        self.devices = devices
        self.seq_len = seq_len if self.um.is_text else None
        self.target_len = target_len if self.um.task == "seq2seq_lm" else None  # None: --seq-len
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.ceilings, self.ceilings_source = step_time.ceilings(gpu)
        self.compiled = bool(models.compilable(self.model, self.blocks))  # fast mode fuses ops only then
        # what fast sets run as inductor partitions it, as the run's own estimate (an encoder-decoder's blocks)
        self.partitioned = partitioned_blocks(self.um, self.blocks) if self.compiled else ()
        # (peak allocated, budgeted peak reserved per allocator setting, offloaded, op costs); None: it failed
        self.simulated: dict[tuple, tuple[float, dict[str, float], float, OpCosts] | None] = {}
        self.failed: dict[tuple, str] = {}  # sets whose simulation failed: their first label and the error
        self.falls_back: set[tuple] = set()  # steps whose eager attention falls back to math on CUDA
        self.bounded = False  # every choice's speed_bound set (:meth:`bound`)
        self.plains: dict[tuple, Choice] = {}  # the sets without memory techniques, by Choice.plain
        self.pool: workers.Ahead | None = None  # simulating ahead of the search (planner/workers.py)
        # (how many, all at once) for :meth:`fit`: workers.wanted(), the CLI's
        self.workers_asked = (0, False)
        self.ahead: Callable[[], list[Choice]] = list  # what the search most likely simulates next, in order
        self.progress: Callable[[UserPlanner, Choice], None] | None = None  # told of each simulated choice
        self.simulations = 0
        modes = MODES_TRIED  # sharded: fast mode is FSDP2 with compiled blocks, eager mode FSDP
        overhead = {m: card(_Floor(), gpu, m, devices) for m in modes}  # the card overhead alone, per GPU
        self.overhead_source = "; ".join(f"{m}: {o['overhead_source']}" for m, o in overhead.items())
        self.overhead_legend = "; ".join(f"{m} mode: {o['overhead_legend']}" for m, o in overhead.items())
        runner = user_run.default_config()
        precisions = _first(precision, PRECISIONS_TRIED if "precision" in self.may_change else ())
        optimizers = _first(optimizer, OPTIMIZERS_TRIED if "optimizer" in self.may_change else ())
        allowed = [t.name for t in switches() if t.applies_to(self.um.task) and not refusal_of(t, self.model)]
        switched = [s for n in range(len(allowed) + 1) for s in itertools.combinations(allowed, n)]
        self.choices = []
        cost = functools.cache(advice.cost)  # each reads the benchmark's run files
        for prec, opt, mode, switch, on in itertools.product(precisions, optimizers, modes, switched, SETS):
            changes = tuple(
                cost(what, value, gpu)
                for what, value, mine in (("precision", prec, precision), ("optimizer", opt, optimizer))
                if value != mine
            )
            used = TechniqueSet.of(opt, *on)
            if used.uses(ACTIVATION_CHECKPOINTING) and not self.blocks:
                continue
            if devices > 1 and (used.uses(ACTIVATION_OFFLOAD) or used.uses(OPTIMIZER_IN_BACKWARD)):
                continue  # FSDP: with checkpointing or without (the sharded rungs' sets)
            over = overhead[mode]["overhead_gb"] or 0.0
            offloads = (False, True) if devices > 1 and opt != "adamw8bit" else (False,)  # FSDP's CPU offload
            checkpoint_modes = (
                CHECKPOINT_MODE.choices if used.uses(ACTIVATION_CHECKPOINTING) else (CHECKPOINT_MODE.default,)
            )
            accumulations = [1] if used.uses(OPTIMIZER_IN_BACKWARD) else divisors(batch_size)
            for keeps, k, off in itertools.product(checkpoint_modes, accumulations, offloads):
                rung = runner.with_flags(
                    model=ref, precision=prec, batch_size=batch_size, accumulation_steps=k, optimizer=opt
                )
                frozen = (self.parameters - self.trainable) * (2 if prec in ("bf16-true", "16-true") else 4)
                lower = 0.0 if off else (static_bytes(rung, used, self.trainable) + frozen) / GB / devices
                c = Choice(
                    rung,
                    mode,
                    used,
                    lower + over,
                    math.inf,
                    speed_source=SPEED_SOURCE,
                    overhead_gb=over,
                    seq_len=self.seq_len,
                    changes=changes,
                    devices=devices,
                    switched=switch,
                    checkpoint_mode=keeps,
                    lora=tuple(lora),
                    target_len=self.target_len,
                    cpu_offload=off,
                )
                self.choices.append(c)
        self.index = {id(c): n for n, c in enumerate(self.choices)}  # what a worker is told to simulate

    def weights_gb(self) -> float:
        """The weights alone in the narrowest precision the planner may use: no card below this fits (with
        several GPUs FSDP's CPU offload keeps them on the host: no floor)."""
        if self.devices > 1:
            return 0.0
        narrow = "bf16-true" if "precision" in self.may_change else self.precision
        return self.parameters * (2 if narrow in ("bf16-true", "16-true") else 4) / GB / self.devices

    def bound(self) -> None:
        """Every choice's ``speed_bound``, an upper bound of its predicted speed: that of its set without
        memory techniques (:attr:`Choice.plain`) once that is simulated, and before, the floor of that set's
        step (step_time.floor_step_seconds) from the simulation of the same set at the whole batch (one
        micro-batch), the one simulation each group of plain sets needs up front."""
        if not self.bounded:
            self.plains = {c.plain: c for c in self.choices if not c.techniques.used and not c.cpu_offload}
            wholes = (self.plains[(*p[:5], c.rung.batch_size, 1)] for p, c in self.plains.items())
            first = list({id(w): w for w in wholes}.values())  # what the loop below simulates first
            self.ahead = lambda: first
            for c in self.choices:
                c.speed_bound = set_speed.optimistic(self, self.plains[c.plain])
            self.bounded = True

    def predict(self, c: Choice) -> Choice:
        if c.predicted_gb is None:
            simulations = self.simulations
            # the eager step, unless a fast set's own step does not depend on it (partitioned blocks)
            if c.key not in self.simulated and not (c.mode != "eager" and self.compiled and self.partitioned):
                self._simulate(c, c.key, compiled=False)
            key = self._key(c)
            if key not in self.simulated:  # fast mode's compiled blocks (:meth:`_key`)
                self._simulate(c, key, compiled=True)
            if self.simulated[key] is None:  # its simulation failed
                c.predicted_gb, c.images_per_s = math.inf, 0.0
                return c
            c.simulated_gb, reserved, c.offloaded_gb, collector = self.simulated[key]
            c.predicted_gb = reserved[allocator_of_set(c, self.um)]
            c.images_per_s = set_speed.step_speed(self, c, collector)
            if self.simulations > simulations and self.progress is not None:
                self.progress(self, c)
        return c

    def simulation_of(self, c: Choice) -> tuple[float, dict[str, float], float, OpCosts] | None:
        """The simulated step ``c`` is predicted from; None: not simulated yet, or it failed."""
        return self.simulated.get(self._key(c))

    def _key(self, c: Choice) -> tuple:
        """``c``'s simulated step in ``self.simulated``: the mode changes the card overhead, the time and the
        replay (sharded: the step, :attr:`Choice.key`), not the step, unless an eager CUDA step runs attention
        on math where compiled blocks keep the fused kernel, or blocks are :attr:`partitioned`: then its own."""
        compiled = (
            c.mode != "eager" and self.compiled and (bool(self.partitioned) or c.key in self.falls_back)
        )
        return (c.key, "compiled") if compiled else c.key

    def _simulate(self, c: Choice, key: tuple, compiled: bool) -> None:
        """Simulate ``c``'s step into ``self.simulated[key]`` (None: it failed, said in ``self.failed``), or take
        it from the worker that simulated it ahead (planner/workers.py)."""
        args = (self.index[id(c)], compiled)
        outcome = self.pool.run(key, args) if self.pool is not None else self._outcome(*args)
        self.simulations += 1
        error, peak_gb, reserved, host_gb, collector, fell_back = outcome
        used = c.techniques
        if error and not used.used:
            raise RuntimeError(f"the simulation of {c.label()} failed: {error}")
        if error:  # a technique this model's step cannot run: the set is left out, said once
            self.failed.setdefault((used, c.switched, c.checkpoint_mode), f"{c.label()}: {error}")
            self.simulated[key] = None
            return
        if fell_back:
            self.falls_back.add(key)
        self.simulated[key] = (peak_gb, reserved, host_gb, collector)

    def _outcome(self, index: int, compiled: bool) -> tuple:
        """The simulation of choice ``index``'s step: (its error or None, peak allocated GB, budgeted peak
        reserved GB per allocator setting, offloaded GB, op costs, whether eager attention fell back to math)."""
        c = self.choices[index]
        # the same simulation gives the op costs the step time is predicted from (its blocks' ops fuse)
        collector = OpCosts(self.blocks)
        try:
            est = estimate(
                self.model,
                self.um,
                self.plan_of(c, compiled),
                self.seq_len or 0,
                op_costs=collector,
                target_len=self.target_len,
            )
            error = est.error
        except Exception as e:
            error = f"{type(e).__name__}: {str(e)[:200]}"
        if error:
            return error, None, None, None, None, False
        reserved = {a: card(est, self.gpu, c.mode, c.devices, a)["peak_reserved_gb"] for a in ALLOCATORS}
        fell_back = STRIDED_FALLBACK in est.kernels
        return None, est.peak_gb, reserved, est.activations_host_gb, collector, fell_back

    def plan_of(self, c: Choice, compiled: bool) -> Plan:
        """The plan of ``c``'s simulated step (``compiled``: fast mode's compiled blocks): what its entry in
        :attr:`simulated` holds, under :attr:`Choice.key`."""
        r, used = c.rung, c.techniques
        return Plan(
            precision=r.precision,
            micro_batch_size=r.micro_batch_size,
            accumulation_steps=r.accumulation_steps,
            optimizer=used.optimizer,
            activation_checkpointing=self.blocks if used.uses(ACTIVATION_CHECKPOINTING) else (),
            activation_offload=used.uses(ACTIVATION_OFFLOAD),
            optimizer_in_backward=used.uses(OPTIMIZER_IN_BACKWARD),
            **sharding_of(c.devices > 1, c.mode == "fast", r.precision),
            checkpoint_mode=c.checkpoint_mode,
            switched=c.switched,
            shard_units=self.blocks,
            world_size=c.devices,
            cpu_offload=c.cpu_offload,
            compile=compiled,
            compiled_blocks=self.partitioned if compiled else (),
        )

    def _wanted(self) -> Iterator[tuple[tuple, tuple]]:
        """(key, what :meth:`_outcome` takes) of what the search will most likely simulate next (:attr:`ahead`)."""
        return ((x.key, (self.index[id(x)], False)) for x in self.ahead() if x.key not in self.simulated)

    def fit(self, budget_gb: float, top: int = 5) -> tuple[list[Choice], Choice | None]:
        """The ``top`` fastest choices predicted to fit, and the fastest predicted not to fit among those
        faster than the last pick (None if there is none): the ladder planner's search (planning/planner/fit.py),
        on the bounds of :meth:`bound`, with :attr:`workers_asked` worker processes (planner/workers.py)."""
        asked = self.workers_asked
        self.pool = workers.Ahead(self._outcome, self._wanted, *asked) if asked[0] else None
        try:
            return self._search(budget_gb, top)
        finally:
            if self.pool is not None:
                self.pool.close()
                self.pool = None

    def _search(self, budget_gb: float, top: int) -> tuple[list[Choice], Choice | None]:
        self.bound()
        shown: dict[tuple, Choice] = {}  # each set once, at its fastest micro-batch that fits
        too_big = []
        queue = [
            (-c.speed_bound, c.techniques.count(), c.lower_bound_gb, n, c) for n, c in enumerate(self.choices)
        ]
        heapq.heapify(queue)
        while queue:  # fastest bound first
            c = heapq.heappop(queue)[-1]
            self.ahead = lambda: self._next(queue, budget_gb, shown)
            ranked = sorted(shown.values(), key=lambda x: -x.images_per_s)
            if len(ranked) >= top and ranked[top - 1].images_per_s >= c.speed_bound:
                break  # nothing left can be faster than the picks
            known = shown.get(c.family)
            if known is not None and known.images_per_s >= c.speed_bound:
                continue  # a micro-batch of this set at least as fast fits already
            if c.lower_bound_gb > budget_gb:
                too_big.append(c)
                continue
            exact = min(
                set_speed.optimistic(self, self.predict(self.plains[c.plain])), offload_bound.of(self, c)
            )
            if exact < c.speed_bound:  # its plain set simulated now: back in the queue at that bound
                c.speed_bound = exact
                heapq.heappush(queue, (-exact, c.techniques.count(), c.lower_bound_gb, id(c), c))
                continue
            self.predict(c)
            if c.predicted_gb == math.inf:
                continue  # its simulation failed (self.failed says why)
            if c.card_gb > budget_gb:
                too_big.append(c)
            elif known is None or c.images_per_s > known.images_per_s:
                shown[c.family] = c
        fits = sorted(shown.values(), key=lambda x: -x.images_per_s)[:top]
        self.ahead = lambda: sorted(too_big, key=lambda x: -x.speed_bound)  # as fastest() visits them
        return fits, fastest(too_big, self.predict)

    def _next(self, queue: list, budget_gb: float, shown: dict[tuple, Choice]) -> list[Choice]:
        """What the search simulates when it visits the heads of ``queue`` (its plain set first, until that
        is simulated), as far as its state tells now: a few per worker."""
        out = []
        for *_, x in heapq.nsmallest(MOST_AHEAD, queue):
            known = shown.get(x.family)
            if x.lower_bound_gb > budget_gb or (known is not None and known.images_per_s >= x.speed_bound):
                continue
            plain = self.plains[x.plain]
            out.append(plain if plain.predicted_gb is None else x)
        return out

    def smallest(self) -> Choice:
        return smallest(self.choices, self.predict)

    def speed_lines(self, verbose: bool = False) -> list[str]:
        """How samples/s were predicted (planning/your_model/set_speed.py)."""
        return set_speed.lines(self, verbose)


def _first(mine: str, others: tuple[str, ...]) -> tuple[str, ...]:
    """The user's value first, then the others allowed."""
    return tuple(dict.fromkeys((mine, *others)))


def allocator_of_set(c: Choice, um: models.UserModel) -> str:
    """The caching allocator a set's run trains under (plan.ALLOCATORS): fast mode on one GPU sets expandable
    segments (config.FAST_ALLOCATOR), its steps in CUDA graphs where step_time.uses_graphs says so."""
    if step_time.uses_graphs(c, um):
        return "graphs"
    return "expandable" if c.mode == "fast" and c.devices == 1 else "default"


class _Floor:
    """An estimate of nothing: :func:`card` of it gives the overhead alone."""

    peak_gb = 0.0
    reserved_gb = 0.0

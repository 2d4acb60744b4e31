"""What a run chooses, each named once: the memory techniques, the precisions, the optimizers, the modes.

A memory technique is one :class:`Technique` record: its name (the one spelling: the configuration
field that turns it on, or the optimizer whose state it is), the words a plan's row and the docs use, its
code (``fabric_memory_recipes/training/techniques/<module>.py``, shared by the ladder and the your-model
runner) and the rung that teaches it. The recipes' flags, :class:`~fabric_memory_recipes.config.RunConfig`,
the estimate, the planners, the speed model and their labels read these records; ``docs/architecture.md``
lists them and ``tests/test_architecture.py`` holds the code to them. A :class:`TechniqueSet` is what the
planners combine: an optimizer and the planned techniques (:data:`PLANNED`), by name, never by position;
a technique with a flag that is not planned is a switch (:func:`switches`: the fused loss), tried with each
set. Where a technique is applied in more than one way, each choice is an :class:`Option` of its record
(the checkpointing's :data:`CHECKPOINT_MODE`): its flag, choices and default, which the runner's flags, the
estimate's plan and your model's planner read. The code that reads the records reads them when it runs
(:func:`flagged`, :func:`switches`), so that a new record needs no edit there
(``tests/test_adding_a_technique.py``).

:data:`PRECISIONS`, :data:`OPTIMIZERS`, :data:`MODES` and :data:`BF16_UPDATES` are every value a run may
take; where a tool offers fewer, it takes a :func:`subset` of these and says why. This module imports
nothing, so that ``config.py`` (the flags' choices) and every layer below can read it.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("32-true", "32", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true")  # Fabric's
MODES = ("fast", "eager")  # fast: compiled blocks and one CUDA graph per optimizer step
BF16_UPDATES = ("plain", "stochastic", "kahan")  # how bf16-true weights store an update (bf16.py)
# What changes what is trained, not only its memory: your model's planner tries other values only when asked
# (fmr-estimate --model ... --fit SIZE --may-change precision,optimizer).
MAY_CHANGE = ("precision", "optimizer")
# The optimizers the estimate models, with the words a plan's row uses for each.
OPTIMIZERS = {
    "adam": "Adam",
    "adamw": "AdamW",
    "adamw8bit": "8-bit Adam",
    "sgd": "SGD",
    "sgd-momentum": "SGD with momentum",
    "none": "no optimizer",
}


def subset(choices, *names: str) -> tuple[str, ...]:
    """``names``, in this order, each checked to be one of ``choices`` (a tool's narrower offer)."""
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not one of {', '.join(choices)}")
    return names


@dataclass(frozen=True)
class Option:
    """How a technique is applied, where there is a choice: a flag with a value (the checkpointing's
    ``--checkpoint-mode``), its field of the your-model runner's configuration, of the estimate's plan and
    of a plan's row. The first choice is the default, which a command and a row's label leave unsaid; any
    other is said before the technique's label ("selective checkpointing")."""

    flag: str  # "--checkpoint-mode"
    choices: tuple[str, ...]  # the default first
    help: str = ""  # the flag's help

    @property
    def field(self) -> str:
        """The configuration field (the plan's, a row's key) its flag sets: ``--checkpoint-mode`` sets
        ``checkpoint_mode``."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def default(self) -> str:
        return self.choices[0]

    def flags(self, value: str) -> list[str]:
        """The flag and its value that choose ``value`` (none for the default)."""
        return [] if value == self.default else [self.flag, value]

    def label(self, value: str, technique: Technique) -> str:
        """``technique``'s words with ``value`` said before them unless it is the default."""
        return technique.label if value == self.default else f"{value} {technique.label}"


@dataclass(frozen=True)
class Technique:
    """One memory technique."""

    name: str  # the configuration field that turns it on, or the optimizer whose state it is
    label: str  # a plan's row and the docs: "SGD + checkpointing"
    module: str  # its code: fabric_memory_recipes/training/techniques/<module>.py (a dot: a sub-folder)
    rung: str  # the recipe that teaches it: recipes/<rung>.py
    flag: str | None = None  # the your-model runner's flag that turns it on (recipes/your_model.py)
    planned: bool = False  # the planners combine it, on or off, with every optimizer
    help: str = ""  # the flag's help
    tasks: tuple[str, ...] = ()  # the model tasks it applies to ("causal_lm"); (): every task
    options: tuple[Option, ...] = ()  # how it is applied, where there is a choice (its flag's options)
    valued: bool = False  # its flag takes a value (--lora-rank R), its field the runner's own: not flagged()

    @property
    def field(self) -> str | None:
        """The runner's configuration field its flag sets: ``--fused-loss`` sets ``fused_loss``."""
        return self.flag.removeprefix("--").replace("-", "_") if self.flag else None

    def applies_to(self, task: str) -> bool:
        """Whether it applies to a model of ``task`` (its :attr:`tasks`; none named: every task)."""
        return not self.tasks or task in self.tasks


# name, label, module, the rung that teaches it; the your-model runner's: its flag (with its help, the tasks it
# applies to, the options that say how), and whether the planners combine it (planned) or switch it (switches())
CHECKPOINT_MODE = Option(  # what a checkpointed block keeps (training/techniques/checkpointing.py)
    "--checkpoint-mode",
    ("full", "selective"),
    help="what a checkpointed block keeps: full (its input only) or selective (also its matmuls and attention)",
)
ACTIVATION_CHECKPOINTING = Technique(
    "activation_checkpointing",
    "checkpointing",
    "checkpointing",
    "10_activation_checkpointing",
    flag="--checkpoint-blocks",
    planned=True,
    help="activation checkpointing of every repeated block of the model",
    options=(CHECKPOINT_MODE,),
)
ACTIVATION_OFFLOAD = Technique(
    "activation_offload",
    "offload",
    "offload",
    "11_activation_offload",
    flag="--activation-offload",
    planned=True,
    help="keep saved activations in pinned host memory (rung 11)",
)
OPTIMIZER_IN_BACKWARD = Technique(
    "optimizer_in_backward",
    "step in backward",
    "step_in_backward",
    "12_optimizer_in_backward",
    flag="--optimizer-in-backward",
    planned=True,
    help="one optimizer per parameter, stepped inside backward (rung 12; no accumulation)",
)
FUSED_LOSS = Technique(
    "fused_loss",
    "fused loss",
    "fused_loss",
    "your_model",
    flag="--fused-loss",
    help="causal LMs, encoder-decoders: the loss of the output projection in chunks, without the full logits"
    " (liger-kernel on CUDA)",
    tasks=("causal_lm", "seq2seq_lm"),
)
LOWBIT_STATE = Technique("adamw8bit", "8-bit Adam", "lowbit", "13_lowbit_optimizer")
BF16_UPDATE = Technique("bf16_update", "bf16 updates", "bf16", "03_true_half_precision")
FUSED_ATTENTION = Technique("fused_attention", "fused attention", "attention", "15_speed")
FLOAT8 = Technique("float8", "float8 matrix products", "float8", "15_speed")
WEIGHTS_OFFLOAD = Technique("weights_offload", "weights on the CPU", "weights_offload", "16_weights_on_cpu")
LLM_TOGGLES = Technique("llm_toggles", "the LLM fine-tune's toggles", "llm_toggles", "bonus_llm_finetune")
LORA = Technique("lora_rank", "LoRA", "lora", "your_model", flag="--lora-rank", valued=True)  # the rank
# inference: the frozen weights stored in int8 (--weights-quant int8)
WEIGHTS_QUANT = Technique(
    "weights_quant",
    "int8 weights",
    "inference.weights_quant",
    "your_model",
    flag="--weights-quant",
    valued=True,
)

TECHNIQUES = (
    ACTIVATION_CHECKPOINTING,
    FUSED_LOSS,
    ACTIVATION_OFFLOAD,
    OPTIMIZER_IN_BACKWARD,
    LOWBIT_STATE,
    BF16_UPDATE,
    FUSED_ATTENTION,
    FLOAT8,
    WEIGHTS_OFFLOAD,
    LLM_TOGGLES,
    LORA,
    WEIGHTS_QUANT,
)
PLANNED = tuple(t for t in TECHNIQUES if t.planned)  # in the order a label names them


def flagged() -> tuple[Technique, ...]:
    """The techniques the your-model runner turns on with an on/off flag (its flags, its results' ``config``),
    in the order of :data:`TECHNIQUES`, read when asked; a flag that takes a value (:attr:`Technique.valued`:
    LoRA's rank) is the runner's own field, neither flagged nor a switch."""
    return tuple(t for t in TECHNIQUES if t.flag and not t.valued)


def switches() -> tuple[Technique, ...]:
    """The flagged techniques that are not planned: each switched on or off on top of a technique set. The
    estimate applies each to the model through its module's ``apply(model, batch_fn)`` (what the recipe's
    lines do), and your model's planner tries each on and off where its :attr:`Technique.tasks` allow and its
    module does not refuse the model (``refusal(model)``, where the module has one: the fused loss's)."""
    return tuple(t for t in flagged() if not t.planned)


@dataclass(frozen=True)
class TechniqueSet:
    """The optimizer and the planned techniques one configuration combines: what the planners enumerate,
    a committed run is matched by and the speed model is calibrated on. ``used`` holds names of
    :data:`PLANNED`, kept in that order (so equal sets are equal tuples, and a JSON file can hold one)."""

    optimizer: str
    used: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        planned = [t.name for t in PLANNED]
        unknown = [n for n in self.used if n not in planned]
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not a planned technique ({', '.join(planned)})")
        object.__setattr__(self, "used", tuple(n for n in planned if n in self.used))

    @classmethod
    def of(cls, optimizer: str, *techniques: Technique) -> TechniqueSet:
        return cls(optimizer, tuple(t.name for t in techniques))

    @classmethod
    def of_config(cls, config) -> TechniqueSet:
        """A configuration's set: its optimizer and the planned techniques its fields turn on."""
        return cls(config.optimizer, tuple(t.name for t in PLANNED if getattr(config, t.name)))

    def uses(self, technique: Technique) -> bool:
        return technique.name in self.used

    def count(self) -> int:
        """How many memory techniques beyond the optimizer's choice (8-bit state counts as one)."""
        return len(self.used) + (self.optimizer == LOWBIT_STATE.name)

    def label(self) -> str:
        """'SGD + checkpointing + offload + step in backward'."""
        optimizer = OPTIMIZERS.get(self.optimizer, self.optimizer)
        return " + ".join([optimizer, *(t.label for t in PLANNED if self.uses(t))])

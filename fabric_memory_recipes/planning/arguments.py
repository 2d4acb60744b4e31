"""The one command line of ``fmr-estimate``: every mode's flags in named groups of one parser.

The mode is chosen from the parsed namespace (:func:`mode_of`), after one parse: ``--model SOURCE:NAME``
your own model (with ``--fit``: its planner), else ``--fit`` the ladder's planner, else ``--ladder`` or
``--check``, else a rung's estimate. The flags of a run (``RunConfig``'s, and your model's technique
set) default to None here and are filled after parsing from the mode's configuration: the ``--recipe``
rung's, the ladder's defaults, or ``recipes/your_model.py``'s (:func:`filled`). A flag given to a mode
that does nothing with it is refused in one line (:func:`refuse_foreign`).
"""

from __future__ import annotations

import argparse
from typing import Any

from fabric_memory_recipes.config import VIT_MODELS, RunConfig, at_least
from fabric_memory_recipes.console import Parser, comma_list, fail
from fabric_memory_recipes.paths import output_folder
from fabric_memory_recipes.planning.plan import ATTENTION_CHOICES
from fabric_memory_recipes.planning.planner import calibration
from fabric_memory_recipes.planning.planner.cli import gpu_kind
from fabric_memory_recipes.planning.planner.fit import PLANNED_OPTIMIZERS, PLANNED_PRECISIONS
from fabric_memory_recipes.techniques import MAY_CHANGE, MODES, OPTIMIZERS
from fabric_memory_recipes.training import cli
from fabric_memory_recipes.training.your_model import models, runner

MODES_HELP = """fmr-estimate: predicted peak memory, and what fits a card. Its modes:
  fmr-estimate --recipe NN [flags]          a rung's predicted peak (component table; --json, --plot PNG)
  fmr-estimate --fit SIZE [--batch-size N]  which configurations of the ladder fit a card of SIZE
  fmr-estimate --check DIR...               predicted against measured for every results JSON in DIR
  fmr-estimate --ladder DIR                 every rung of DIR predicted at full size (DIR/predicted.json)
  fmr-estimate --model SOURCE:NAME [--seq-len N] [--fit SIZE [--measure] [--may-change precision,optimizer]]
                                            your own model (torchvision:, timm:, hf:CONFIG): its estimate, and
                                            with --fit the technique sets that fit

A run's flags (hardware, training, data and model, ...) default to the --recipe rung's values; without
--recipe to the ladder's defaults, and with --model SOURCE:NAME to recipes/your_model.py's (each flag's
help names both). A flag that the chosen mode does nothing with is refused."""

ESTIMATE, CHECK, LADDER, FIT, YOURS = "estimate", "check", "ladder", "fit", "your model"
WHERE = {
    ESTIMATE: "a rung's estimate (--recipe NN, or no mode flag)",
    CHECK: "--check DIR",
    LADDER: "--ladder DIR",
    FIT: "the ladder's --fit SIZE (your own model's: --model SOURCE:NAME --fit SIZE)",
    YOURS: "--model SOURCE:NAME",
}
FIT_BATCH = 16  # the ladder planner's effective batch unless --batch-size


def yours_only() -> tuple[str, ...]:
    """Your model's own flags (its technique set, --seq-len, ...): not flags of a rung. --optimizer is both.
    Read from the records when asked, so that a technique registered after import is one of them."""
    rung = {g.name for g in RunConfig.flag_fields()}
    return tuple(f.name for f in runner.YourModelConfig.flag_fields() if f.name not in rung | {"optimizer"})


def _shown(value: Any) -> Any:
    return "not set" if value is None else "on" if value is True else "off" if value is False else value


def _help(name: str) -> str:
    """A run's flag's help with its defaults: the ladder's (unless only your model has it) and your model's."""
    cls, yours = runner.YourModelConfig, runner.default_config()
    fld = next(f for f in cls.flag_fields() if f.name == name)
    text = RunConfig.HELP.get(name, fld.metadata["help"])
    if name == "model":
        return (
            f"a model of the ladder, {text}; or your own model: {cls.HELP['model']} (default: the --recipe rung's, else"
            f" vit_l_16; --fit: vit_l_16)"
        )
    if name in yours_only():
        text += "" if "default" in text else f" (default: {_shown(getattr(yours, name))})"
        return f"your model: {text}"
    if "default" not in text:  # unless the help says it itself (--mode, --compile, ...)
        ladder = getattr(RunConfig(), name)
        extra = f"; your model: {_shown(getattr(yours, name))}" if getattr(yours, name) != ladder else ""
        extra += f"; --fit: {FIT_BATCH}" if name == "batch_size" else ""
        text += f" (default: the --recipe rung's, else {_shown(ladder)}{extra})"
    return text + (
        f"; your model: {cls.HELP[name]}"
        if cls.HELP.get(name, text) != RunConfig.HELP.get(name, text)
        else ""
    )


def build() -> Parser:
    """The parser: the modes, then each mode's flags, then a run's flags by RunConfig's groups."""
    p = Parser(description=MODES_HELP)
    m = p.add_argument_group(
        "modes (none of these: a rung's estimate; --model SOURCE:NAME: your own model's)"
    )
    m.add_argument("--recipe", help="estimate the configuration declared in recipes/<NAME>.py (its RUNG)")
    m.add_argument(
        "--fit",
        metavar="SIZE",
        help="which configurations fit a card of SIZE (6GB, 6.5GB, 512MB, 8GiB),"
        " fastest first: the ladder's, or your own model's technique sets with --model SOURCE:NAME",
    )
    m.add_argument(
        "--check",
        nargs="+",
        metavar="DIR",
        help="predict every results JSON in DIR from its config and compare with its measured peak (ViT rungs"
        " measured on a CUDA GPU with status ok; files it cannot read are named on stderr; exit 2, with"
        " the reason, when nothing can be compared)",
    )
    m.add_argument(
        "--ladder",
        metavar="DIR",
        help="predict every rung with a results JSON in DIR (none there: every"
        " rung) at full size (ViT-L/16, GPU config) and write DIR/predicted.json for the report",
    )
    out = p.add_argument_group("output and card (every mode but --ladder)")
    out.add_argument("--json", action="store_true", help="print the answer as JSON")
    out.add_argument(
        "--gpu",
        default=calibration.REFERENCE_GPU,
        type=gpu_kind,
        help="GPU kind whose measured card overhead (and, with --fit, committed runs) apply (h100, h200, ...)",
    )
    out.add_argument(
        "--plot",
        metavar="PNG",
        help="a rung's estimate: write the simulated timeline as a PNG; --check: predicted vs measured",
    )
    e = p.add_argument_group("a rung's estimate (--recipe NN)")
    e.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto", help="attention kernel to model")
    e.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        help=f"override the recipe's optimizer (your model: one of {', '.join(runner.OPTIMIZERS)}) (default: the"
        " --recipe rung's; your model: adamw)",
    )
    e.add_argument("--checkpoint", help="comma-separated module classes to checkpoint (e.g. EncoderBlock)")
    f = p.add_argument_group("--fit SIZE (the ladder's planner; --top and --verbose also for your model's)")
    f.add_argument("--top", type=at_least(1), default=5, help="how many fitting configurations to print")
    f.add_argument("--verbose", action="store_true", help="every speed constant with the runs it comes from")
    f.add_argument(
        "--precisions",
        type=comma_list(PLANNED_PRECISIONS),
        default=PLANNED_PRECISIONS,
        help="precisions to combine",
    )
    f.add_argument(
        "--optimizers",
        type=comma_list(PLANNED_OPTIMIZERS),
        default=PLANNED_OPTIMIZERS,
        help="optimizers to combine (SGD and 8-bit Adam change the training: docs/06, docs/13)",
    )
    f.add_argument("--modes", type=comma_list(MODES), default=MODES, help="modes to combine")
    f.add_argument(
        "--results",
        nargs="+",
        default=[str(calibration.RESULTS_DIR)],
        metavar="DIR",
        help="folders of committed results JSON to calibrate on (read recursively)",
    )
    f.add_argument("--no-cache", action="store_true", help="simulate again instead of reading the cache")
    y = p.add_argument_group("your model's --fit SIZE (--model SOURCE:NAME)")
    y.add_argument(
        "--may-change",
        type=comma_list(MAY_CHANGE),
        default=(),
        metavar="WHAT",
        help="also try other precisions and/or optimizers (precision,optimizer); each such row shows the"
        " accuracy cost the convergence benchmark measured (default: keep yours)",
    )
    y.add_argument(
        "--measure",
        action="store_true",
        help="run the top sets on this machine's CUDA GPU, a few steps"
        " each on the emulated card, and rank them by measured samples/s",
    )
    y.add_argument(
        "--measure-steps", type=at_least(4), default=15, metavar="N", help="optimizer steps per measured set"
    )
    y.add_argument(
        "--measure-dir",
        type=output_folder("--measure-dir"),
        metavar="DIR",
        help="where --measure writes plan.json, plan.md and the runs (default: runs/fit/<model>-<SIZE>)",
    )
    cls = (
        runner.YourModelConfig
    )  # RunConfig's flags and your model's technique set; the estimate's --optimizer
    cli.add_flags(
        p,
        cls,
        help_of=_help,
        data_choices=tuple(dict.fromkeys((*RunConfig.DATA_CHOICES, *cls.DATA_CHOICES))),
        skip=("optimizer",),
        titles={**cls.GROUPS, "technique": "your model's technique set (--model SOURCE:NAME)"},
    )
    p.set_defaults(
        **{f.name: None for f in cls.flag_fields() if f.name != "optimizer"}
    )  # filled after parsing
    return p


def mode_of(args: argparse.Namespace) -> str:
    """The mode the parsed flags ask for."""
    if models.is_user_model(args.model):
        return YOURS
    if args.fit is not None:
        return FIT
    if args.ladder:
        return LADDER
    return CHECK if args.check else ESTIMATE


def allowed(mode: str) -> set[str]:
    """The flags (argparse dests) that do something in ``mode``."""
    run = {f.name for f in RunConfig.flag_fields()}
    fit = {"fit", "gpu", "top", "json", "verbose"}
    return {
        ESTIMATE: run | {"recipe", "attention", "optimizer", "checkpoint", "gpu", "json", "plot"},
        CHECK: {"check", "json", "plot"},
        LADDER: {"ladder"},
        FIT: fit | {"precisions", "optimizers", "modes", "results", "no_cache", "batch_size", "model"},
        YOURS: run
        | set(yours_only())
        | fit
        | {"optimizer", "may_change", "measure", "measure_steps", "measure_dir"},
    }[mode]


def refuse_foreign(parser: Parser, args: argparse.Namespace, mode: str) -> None:
    """One line and exit 2 for a flag given (a value other than its default) that ``mode`` ignores."""
    ok = allowed(mode)
    for action in parser._actions:
        if action.dest in ok or not action.option_strings or action.dest == "help":
            continue
        if getattr(args, action.dest) != action.default:
            fail(
                f"{action.option_strings[0]} does nothing with {WHERE[mode]} (--help lists each mode's flags)"
            )


def filled(args: argparse.Namespace, base: RunConfig) -> dict[str, Any]:
    """The run's flag values: those given, the rest ``base``'s; a --data that ``base``'s family lacks is refused."""
    values = {f.name: getattr(args, f.name) for f in type(base).flag_fields()}
    values = {k: getattr(base, k) if v is None else v for k, v in values.items()}
    if values["data"] not in base.DATA_CHOICES:
        fail(
            f"argument --data: invalid choice: {values['data']!r} (choose from {', '.join(base.DATA_CHOICES)})"
        )
    return values


def ladder_model(args: argparse.Namespace) -> None:
    """The ladder planner's --model and --batch-size (not a rung's: its own defaults)."""
    args.model = args.model or "vit_l_16"
    if args.model not in VIT_MODELS:
        fail(
            f"--model {args.model!r} is not one of: {', '.join(VIT_MODELS)}; your own model:"
            f" {models.EXAMPLES} (docs/your_model.md)"
        )
    args.batch_size = args.batch_size or FIT_BATCH


def parse(argv: list[str]) -> tuple[Parser, argparse.Namespace, str]:
    """One parse of ``argv``: the parser, its namespace and the mode."""
    parser = build()
    args = parser.parse_args(argv)
    mode = mode_of(args)
    refuse_foreign(parser, args, mode)
    return parser, args, mode

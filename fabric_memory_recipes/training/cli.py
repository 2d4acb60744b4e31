"""The command line of every recipe, built from its rung's :class:`~fabric_memory_recipes.config.RunConfig`.

``python recipes/05_gradient_accumulation.py`` reproduces the rung (the flags' defaults are the rung's
declared values) and every flag can still be changed. :func:`parse` turns the command line into a
checked copy of the rung; an impossible request is refused before any model, data or device memory is
set up: one line on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fabric_memory_recipes import faults, paths
from fabric_memory_recipes.config import Hardware, RunConfig, UsageError
from fabric_memory_recipes.console import Parser, fail


def build_parser(rung: RunConfig, description: str = "") -> argparse.ArgumentParser:
    """The flags of ``type(rung)`` (its fields with a flag), with ``rung``'s values as defaults.

    A config class of another data and model family (the text recipes') replaces the ``--data``
    choices (``DATA_CHOICES``) and the help of ``--data``, ``--data-dir`` and ``--model`` (``HELP``)."""
    cls = type(rung)
    p = Parser(description=description)
    add_flags(p, cls)
    p.set_defaults(**{f.name: getattr(rung, f.name) for f in cls.flag_fields()})
    return p


def add_flags(
    p: argparse.ArgumentParser,
    cls: type[RunConfig],
    help_of: Callable[[str], str] | None = None,
    data_choices: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
    titles: dict[str, str] | None = None,
) -> None:
    """``cls``'s flags (its fields with a flag, but ``skip``) into ``p``, one argument group per
    ``cls.GROUPS`` key (``titles`` may add or retitle groups), each with its help (``help_of(name)``, else
    ``cls.HELP`` or the field's) and ``--data`` choosing from ``data_choices`` (else ``cls.DATA_CHOICES``)."""
    groups = {key: p.add_argument_group(title) for key, title in (titles or cls.GROUPS).items()}
    for f in cls.flag_fields():
        if f.name in skip:
            continue
        options = {k: v for k, v in f.metadata.items() if k not in ("group", "help")}
        if f.name == "data":
            options["choices"] = data_choices or cls.DATA_CHOICES
        help_text = help_of(f.name) if help_of else cls.HELP.get(f.name, f.metadata["help"])
        groups[f.metadata["group"]].add_argument("--" + f.name.replace("_", "-"), help=help_text, **options)


def detect_hardware() -> Hardware:
    """CUDA devices and CPU cores here; bf16 support asked only when needed (it starts CUDA)."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Hardware(
        cuda_devices=cuda, cpu_cores=os.cpu_count() or 1, bf16_supported=torch.cuda.is_bf16_supported
    )


# `fabric run --devices 2 script.py` consumes the hardware flags itself and hands them to the script in
# these variables; a recipe adopts them as its defaults.
FABRIC_RUN_ENV = {
    "accelerator": "LT_ACCELERATOR",
    "devices": "LT_DEVICES",
    "num_nodes": "LT_NUM_NODES",
    "precision": "LT_PRECISION",
}


def _fabric_run_values() -> dict[str, Any]:
    """Hardware settings given to ``fabric run`` (empty when the recipe was not started by it)."""
    if not os.environ.get("LT_CLI_USED"):
        return {}
    if os.environ.get("LT_STRATEGY"):
        fail(
            f"fabric run --strategy {os.environ['LT_STRATEGY']}: each recipe builds its own strategy; leave it out"
        )
    values: dict[str, Any] = {}
    for key, var in FABRIC_RUN_ENV.items():
        raw = os.environ.get(var)
        if raw is None:
            continue
        if key in ("devices", "num_nodes"):
            if not raw.isdigit():
                fail(
                    f"fabric run --{key.replace('_', '-')} {raw}: the recipes need a number of devices/nodes"
                )
            values[key] = int(raw)
        else:
            values[key] = raw
    return values


def _adopt_fabric_run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse with ``fabric run``'s settings as defaults; an explicit flag that disagrees is an error.

    The variables are then cleared: the recipe passes its (checked, resolved) values to Fabric, which
    would otherwise compare them with the variables and refuse e.g. 'cuda' against 'auto', and refuse
    ``fabric.launch()``. The processes ``fabric run`` started are found as under torchrun.
    """
    given = _fabric_run_values()
    parser.set_defaults(**given)
    args = parser.parse_args(argv)
    explicit = parser.parse_args(argv, namespace=argparse.Namespace(**{k: None for k in given}))
    for key, value in given.items():
        mine = getattr(explicit, key)
        if mine is not None and str(mine) != str(value):
            flag = "--" + key.replace("_", "-")
            fail(f"{flag} {mine} conflicts with `fabric run {flag} {value}`: give it to one of them")
    for var in (*FABRIC_RUN_ENV.values(), "LT_CLI_USED", "LT_STRATEGY"):
        os.environ.pop(var, None)
    return args


def parse(
    rung: RunConfig,
    argv: Sequence[str] | None = None,
    description: str = "",
    *,
    hardware: Hardware | None = None,
    refuse_wrong_machine: bool = True,
) -> RunConfig:
    """The command line as a checked copy of ``rung``; exits 2 on bad input.

    ``refuse_wrong_machine`` (a run, not a tool reading the flags): a GPU-sized run that would start on
    the CPU only because no GPU was found is refused (``faults.wrong_machine``)."""
    parser = build_parser(rung, description)
    cfg = rung.with_flags(**vars(_adopt_fabric_run(parser, argv)))
    if cfg.bf16_update == rung.bf16_update != "plain" and cfg.precision != "bf16-true":
        # a rung's compensated default is for bf16-true weights; with another precision there is nothing
        # to round, and the rung runs its own optimizer (an explicit other rule is still checked)
        cfg = cfg.with_flags(bf16_update="plain")
    if cfg.model not in cfg.model_choices:
        fail(f"--model {cfg.model!r} is not one of: {', '.join(cfg.model_choices)}")
    if cfg.tag is not None and (reason := paths.name_problem(cfg.tag)):  # it names files and folders
        fail(f"--tag {cfg.tag!r}: {reason}")
    hardware = hardware or detect_hardware()
    if refuse_wrong_machine and cfg.accelerator == "auto" and hardware.cuda_devices == 0:
        refusal = faults.wrong_machine(cfg)
        if refusal:
            fail(refusal)
    try:
        return cfg.checked(hardware)
    except UsageError as e:
        fail(str(e))

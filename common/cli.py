"""The flags every recipe accepts, parsed and validated in one place.

Each recipe calls :func:`run` with its own defaults (the article's configuration for that rung), so
``python recipes/05_gradient_accumulation.py`` reproduces the rung and every flag can still be changed.
Impossible requests are refused before any model, data or device memory is set up: one line on
stderr, exit code 2, no traceback (DESIGN.md principle 6). The recipe has imported torch and lightning
by then (a few seconds), which keeps the recipes' imports at the top where readers expect them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from common import faults

PRECISIONS = ("32-true", "32", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true")
ACCELERATORS = ("auto", "cpu", "cuda", "gpu")
MODES = ("fast", "eager")
DATA_CHOICES = ("auto", "cifar10", "digits", "synthetic")
WEIGHTS_CHOICES = ("auto", "pretrained", "none")
# The help of the flags whose meaning depends on the recipe's data and model family; a recipe of
# another family (the bonus text recipes) replaces it with ``help_overrides`` (see common/text.py).
HELP = {
    "data": "auto falls back to digits (real, bundled with scikit-learn) when CIFAR-10 is unreachable;"
    " synthetic: memory/speed runs only (its accuracy is not a score)",
    "data_dir": "where CIFAR-10 is (or will be downloaded)",
    "model": "vit_l_16 (the ladder), vit_b_16, vit_tiny (CPU/tests)",
}

# Defaults shared by every recipe; a recipe overrides what its rung changes.
BASE_DEFAULTS: dict[str, Any] = {
    "accelerator": "auto",
    "devices": 1,
    "num_nodes": 1,
    "precision": "32-true",
    "tf32": True,
    "mode": None,
    "compile": None,
    "cuda_graphs": None,
    "batch_size": 64,
    "accumulation_steps": 1,
    "epochs": 1,
    "max_steps": None,
    "lr": 5e-5,
    "bf16_update": "plain",
    "lost_updates": None,
    "data": "auto",
    "data_dir": "data",
    "weights": "auto",
    "model": "vit_l_16",
    "seed": 123,
    "num_workers": 0,
    "results_dir": "results",
    "tag": None,
    "eval_batches": None,
    "log_every": 10,
    "checkpoint_every": None,
    "checkpoint_dir": None,
    "resume": None,
    "checkpoint_on_stop": None,  # None: on when --checkpoint-every or --resume is given
    "keep_checkpoints": 2,
    "memory_timeline": False,
    "snapshot": False,
    "profile_steps": 3,
}


class UsageError(Exception):
    """A request that cannot be satisfied; reported as one line and exit code 2."""


def fail(message: str) -> None:
    """Print one line on stderr and exit with code 2 (the contract for bad input)."""
    prog = os.path.basename(sys.argv[0]) or "recipe"
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; we keep it to one line
        fail(message)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for integers >= ``minimum`` (``at_least(1)``: a positive count)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser(
    description: str,
    defaults: dict[str, Any],
    *,
    data_choices: tuple[str, ...] | None = None,
    help_overrides: dict[str, str] | None = None,
) -> argparse.ArgumentParser:
    """The shared parser. ``defaults`` are BASE_DEFAULTS updated with the recipe's own.

    ``data_choices`` replaces the ``--data`` choices (CIFAR-10's) and ``help_overrides`` the help of the
    flags in :data:`HELP` (keyed like it, by dest), for recipes of other data and model families.
    """
    d = {**BASE_DEFAULTS, **defaults}
    unknown = set(help_overrides or {}) - set(HELP)
    if unknown:
        raise ValueError(f"help_overrides: no overridable help for {sorted(unknown)}; only {sorted(HELP)}")
    helps = {**HELP, **(help_overrides or {})}
    p = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("hardware")
    g.add_argument("--accelerator", choices=ACCELERATORS, help="cpu, cuda/gpu, or auto (cuda if present)")
    g.add_argument("--devices", type=at_least(1), help="devices per node (processes are launched for >1)")
    g.add_argument("--num-nodes", type=at_least(1), help="number of machines (with torchrun/SLURM)")
    g.add_argument("--precision", choices=PRECISIONS, help="Fabric precision: the main lever of rungs 02-03")
    g.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        help="TF32 tensor-core matmuls for fp32 tensors (CUDA)",
    )
    g.add_argument(
        "--mode",
        choices=MODES,
        help="fast: compiled blocks and one CUDA graph per optimizer step (what --compile and"
        " --cuda-graphs default to); eager: neither (default: fast with CUDA, eager on CPU)",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="torch.compile each transformer block (default: on in fast mode)",
    )
    g.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="capture each optimizer step as a CUDA graph after a 2-step warm-up (default: on in fast"
        " mode; one CUDA device only)",
    )
    g = p.add_argument_group("training")
    g.add_argument(
        "--batch-size", type=at_least(1), help="effective batch size per device and optimizer step"
    )
    g.add_argument(
        "--accumulation-steps",
        type=at_least(1),
        help="micro-batches per optimizer step; micro-batch = batch-size / accumulation-steps",
    )
    g.add_argument("--epochs", type=at_least(1), help="passes over the training split")
    g.add_argument("--max-steps", type=at_least(1), help="stop after this many optimizer steps")
    g.add_argument("--lr", type=_positive_float, help="learning rate")
    g.add_argument("--seed", type=int, help="random seed")
    g = p.add_argument_group("bf16 weight updates (single-GPU rungs; see common/bf16.py)")
    g.add_argument(
        "--bf16-update",
        choices=("plain", "stochastic", "kahan"),
        help="how bf16-true weights store an update: plain rounding (loses small updates), stochastic"
        " rounding, or Kahan-compensated (+2 bytes/parameter)",
    )
    g.add_argument(
        "--lost-updates",
        type=at_least(1),
        metavar="N",
        help="every N optimizer steps, measure the fraction of parameters whose update was lost"
        " (costs a copy of the weights and a sync in those steps)",
    )
    g = p.add_argument_group("data and model")
    g.add_argument("--data", choices=data_choices or DATA_CHOICES, help=helps["data"])
    g.add_argument("--data-dir", help=helps["data_dir"])
    g.add_argument("--weights", choices=WEIGHTS_CHOICES, help="auto falls back to random init when offline")
    g.add_argument("--model", help=helps["model"])
    g.add_argument("--num-workers", type=int, help="DataLoader worker processes")
    g.add_argument("--eval-batches", type=at_least(1), help="limit validation/test to this many batches")
    g = p.add_argument_group("checkpoints (resumable runs)")
    g.add_argument(
        "--checkpoint-every", type=at_least(1), help="save a Fabric checkpoint every N optimizer steps"
    )
    g.add_argument("--checkpoint-dir", help="where checkpoints go (default: checkpoints/<recipe>[-<tag>])")
    g.add_argument(
        "--resume", help="a checkpoint file to continue from, or 'auto' for the newest in --checkpoint-dir"
    )
    g.add_argument(
        "--checkpoint-on-stop",
        action=argparse.BooleanOptionalAction,
        help="save a checkpoint when stopped by SIGINT/SIGTERM/SIGUSR1 (default: on with --checkpoint-every or --resume)",
    )
    g.add_argument(
        "--keep-checkpoints", type=at_least(0), help="keep the newest N checkpoints (0: all; default 2)"
    )
    g = p.add_argument_group("output")
    g.add_argument("--results-dir", help="where results/<recipe>.json is written")
    g.add_argument("--tag", help="suffix for the results file: <recipe>-<tag>.json")
    g.add_argument("--log-every", type=at_least(1), help="optimizer steps between logged losses")
    g = p.add_argument_group("memory anatomy (see common/profiling.py)")
    g.add_argument(
        "--memory-timeline",
        action="store_true",
        help="profile the first --profile-steps steps; write <recipe>-timeline.html/.png/.json by category",
    )
    g.add_argument(
        "--snapshot",
        action="store_true",
        help="CUDA only: dump <recipe>-snapshot.pickle of the allocator history (open in pytorch.org/memory_viz)",
    )
    g.add_argument(
        "--profile-steps", type=at_least(1), help="optimizer steps recorded by the two flags above"
    )
    p.set_defaults(**d)
    return p


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_accelerator(requested: str) -> str:
    """'auto' -> 'cuda' when a GPU is present, else 'cpu'; 'gpu' is an alias of 'cuda'."""
    if requested == "auto":
        return "cuda" if _cuda_count() > 0 else "cpu"
    return "cuda" if requested == "gpu" else requested


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Check what argparse cannot: combinations and what the hardware can do. Raises UsageError.

    A recipe whose own flags decide the precision leaves ``precision`` None by default, sets it in
    ``main`` and calls this again (it is idempotent) so that the final value is checked too.
    """
    if args.batch_size % args.accumulation_steps != 0:
        raise UsageError(
            f"--accumulation-steps {args.accumulation_steps} does not divide --batch-size {args.batch_size}"
            " (the micro-batch must be a whole number of samples)"
        )
    if args.num_workers < 0:
        raise UsageError(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.precision == "32":
        args.precision = "32-true"
    args.accelerator = resolve_accelerator(args.accelerator)
    if args.accelerator == "cuda":
        have = _cuda_count()
        if have == 0:
            raise UsageError("--accelerator cuda was requested but no CUDA device is available")
        _choose_mode(args)  # before anything starts CUDA: fast mode may configure the allocator
        import torch

        if args.precision and args.precision.startswith("bf16") and not torch.cuda.is_bf16_supported():
            raise UsageError(f"--precision {args.precision}: this GPU does not support bfloat16")
    else:
        have = os.cpu_count() or 1
        if args.precision == "16-mixed":
            raise UsageError("--precision 16-mixed needs a CUDA GPU; on CPU use bf16-mixed or bf16-true")
    if args.devices > have:
        what = "CUDA devices" if args.accelerator == "cuda" else "CPU cores"
        raise UsageError(f"--devices {args.devices} requested but this machine has {have} {what}")
    if getattr(args, "bf16_update", "plain") not in ("plain", None) and args.precision != "bf16-true":
        raise UsageError(
            f"--bf16-update {args.bf16_update} needs --precision bf16-true, not {args.precision}"
        )
    if getattr(args, "snapshot", False) and args.accelerator != "cuda":
        raise UsageError(
            "--snapshot needs CUDA: it records the CUDA caching allocator's history; on a CPU use --memory-timeline"
        )
    if args.weights == "pretrained" and args.model == "vit_tiny":
        raise UsageError(f"--weights pretrained: no pretrained weights exist for --model {args.model}")
    _choose_mode(args)
    if getattr(args, "lost_updates", None) and args.cuda_graphs:
        raise UsageError(
            "--lost-updates reads the weights between steps: use it with --no-cuda-graphs or --mode eager"
        )
    args.micro_batch_size = args.batch_size // args.accumulation_steps
    return args


# The caching allocator's setting in fast mode (read when CUDA starts): cached blocks left over from the
# eager warm-up steps can be returned page by page before the CUDA graph's own pool is made.
FAST_ALLOCATOR = "expandable_segments:True"


def _choose_mode(args: argparse.Namespace) -> None:
    """Resolve --mode into --compile and --cuda-graphs (idempotent; refuses impossible combinations)."""
    if args.mode is None:
        # Small batches are launch-bound on a GPU; on a CPU compiling costs more than it saves.
        args.mode = "fast" if args.accelerator == "cuda" else "eager"
    if args.compile is None:
        args.compile = args.mode == "fast"
    one_device = args.devices == 1 and args.num_nodes == 1
    profiling = getattr(args, "memory_timeline", False) or getattr(args, "snapshot", False)
    if args.cuda_graphs is None:
        args.cuda_graphs = args.mode == "fast" and args.accelerator == "cuda" and one_device and not profiling
    elif args.cuda_graphs:
        if args.accelerator != "cuda":
            raise UsageError("--cuda-graphs needs CUDA (on a CPU the fast mode is the eager mode)")
        if not one_device:
            raise UsageError("--cuda-graphs works on one device; with several, leave it out (DDP/FSDP run eagerly)")
        if profiling:
            raise UsageError("--cuda-graphs with --memory-timeline/--snapshot: profile the eager steps (--no-cuda-graphs)")
    if args.cuda_graphs and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = FAST_ALLOCATOR


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


def _adopt_fabric_run(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse with ``fabric run``'s settings as defaults; an explicit flag that disagrees is an error.

    The variables are then cleared: the recipe passes its (validated, resolved) values to Fabric, which
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


def parse_args(
    description: str,
    defaults: dict[str, Any],
    argv: list[str] | None = None,
    extra: Callable | None = None,
    model_choices: tuple[str, ...] | None = None,
    data_choices: tuple[str, ...] | None = None,
    help_overrides: dict[str, str] | None = None,
    *,
    recipe: str | None = None,
    cpu_variant: str | None = None,
) -> argparse.Namespace:
    """Parse and validate; ``extra(parser)`` may add recipe-specific flags; ``model_choices`` replaces
    the ViT names, ``data_choices`` the ``--data`` choices and ``help_overrides`` the help of the flags
    in :data:`HELP`, for recipes of other model and data families. Exits 2 on bad input.

    With ``recipe`` (a run, not a tool reading the flags) a GPU-sized run that would start on the CPU
    only because no GPU was found is refused (``faults.wrong_machine``; ``cpu_variant`` as there)."""
    parser = build_parser(description, defaults, data_choices=data_choices, help_overrides=help_overrides)
    if extra is not None:
        extra(parser)
    args = _adopt_fabric_run(parser, argv)
    from common.models import MODEL_NAMES  # cheap: no torch import at module level

    choices = model_choices or MODEL_NAMES
    if args.model not in choices:
        fail(f"--model {args.model!r} is not one of: {', '.join(choices)}")
    if recipe is not None and args.accelerator == "auto" and _cuda_count() == 0:
        refusal = faults.wrong_machine(recipe, args, choices, cpu_variant)
        if refusal:
            fail(refusal)
    try:
        return validate(args)
    except UsageError as e:
        fail(str(e))
    raise AssertionError("unreachable")


def _resolve_checkpoints(args: argparse.Namespace, recipe: str) -> None:
    """Fill in the default checkpoint folder, decide ``--checkpoint-on-stop``, and turn ``--resume
    auto`` into the newest intact checkpoint (or None). A checkpoint that cannot be used, or a new run
    that would write its checkpoints among an earlier run's, is refused here, before anything is built."""
    from common import checkpoints
    from common.net import note

    if args.checkpoint_dir is None:
        args.checkpoint_dir = os.path.join("checkpoints", recipe + (f"-{args.tag}" if args.tag else ""))
    if args.checkpoint_on_stop is None:
        args.checkpoint_on_stop = args.checkpoint_every is not None or args.resume is not None
    if args.resume == "auto":
        args.resume = checkpoints.latest_intact(args.checkpoint_dir, say=note)
        if args.resume is None:
            note(f"[resume] no usable checkpoint in {args.checkpoint_dir}: starting from the beginning")
    elif args.resume is not None:
        reason = checkpoints.problem(args.resume)
        if reason is not None:
            fail(f"--resume {args.resume}: {reason}")
    newest = checkpoints.latest(args.checkpoint_dir)
    writes = args.checkpoint_every is not None or args.checkpoint_on_stop
    if writes and args.resume is None and newest is not None:
        fail(
            f"--checkpoint-dir {args.checkpoint_dir} holds an earlier run's checkpoints (newest {os.path.basename(newest)}):"
            " continue it with --resume auto, or start over in another --checkpoint-dir"
        )


def checkpointing(args: argparse.Namespace) -> dict[str, Any]:
    """The checkpoint/resume keyword arguments of ``common.loop.fit``, from the parsed flags."""
    return {
        "checkpoint_every": args.checkpoint_every,
        "checkpoint_dir": args.checkpoint_dir,
        "resume": args.resume,
        "checkpoint_on_stop": args.checkpoint_on_stop,
        "keep_checkpoints": args.keep_checkpoints,
    }


def _prepare_outputs(args: argparse.Namespace, recipe: str) -> faults.RunLock:
    """Before anything is built: the results (and, when used, checkpoint and log) folders exist and
    take a file, and no other run of this rung writes to the same results folder. Exits 2 otherwise.
    Returns the held lock (a lock that holds nothing in the processes Fabric or a launcher started)."""
    from common.metrics import LOG_DIR

    name = recipe + (f"-{args.tag}" if args.tag else "")
    lock = faults.RunLock(args.results_dir, name)
    try:
        faults.check_writable(args.results_dir, "--results-dir")
        if args.checkpoint_every is not None or args.checkpoint_on_stop:
            faults.check_writable(args.checkpoint_dir, "--checkpoint-dir")
        faults.check_writable(LOG_DIR, "the log folder (FMR_LOG_DIR)")
        if faults.first_process():  # the process that writes the results JSON
            lock.acquire()
    except faults.BadInput as e:
        fail(str(e))
    return lock


def run(
    main: Callable,
    *,
    recipe: str,
    description: str,
    defaults: dict[str, Any],
    argv: list[str] | None = None,
    extra: Callable | None = None,
    model_choices: tuple[str, ...] | None = None,
    data_choices: tuple[str, ...] | None = None,
    help_overrides: dict[str, str] | None = None,
    cpu_variant: str | None = None,
) -> int:
    """Parse flags, check the outputs, run ``main(args, log)``, and record the outcome.

    A CUDA out-of-memory error is caught here and written as ``"status": "oom"`` with its config, so a
    ladder run loses nothing; the process then exits 3 (``run_all.sh`` reports it and moves on).
    SIGINT, SIGTERM and SIGUSR1 stop the run at the next optimizer step (common/faults.py): it is
    recorded as ``"status": "interrupted"``, one line says where it stopped and how to resume, and the
    process exits 130, 143 or 138. A bad input file (data, checkpoint) is one line and exit code 2.
    ``cpu_variant``: the recipe to suggest on a machine without a GPU when this one needs CUDA.
    """
    with faults.handling_signals():  # from here on, a signal stops the run at an optimizer-step boundary
        args = parse_args(
            description, defaults, argv, extra, model_choices, data_choices, help_overrides,
            recipe=recipe, cpu_variant=cpu_variant,
        )  # fmt: skip
        _resolve_checkpoints(args, recipe)
        lock = _prepare_outputs(args, recipe)
        try:
            return _run_main(main, recipe, args, description)
        finally:
            lock.release()


def _run_main(main: Callable, recipe: str, args: argparse.Namespace, description: str) -> int:
    from common.metrics import MetricsLogger

    log = MetricsLogger(recipe, args, description=description.strip().splitlines()[0])
    import torch

    try:
        main(args, log)
    except faults.Interrupted as stop:
        # Every process stopped after the same step (loop.fit agrees on it): gathering is safe.
        log.extra["stopped"] = stop.record()
        log.finish(status="interrupted", error=str(stop), gather=True)
        if log.fabric is None or log.fabric.global_rank == 0:
            print(faults.interrupted_line(stop), file=sys.stderr, flush=True)
        faults.outlive_launcher(log.fabric)
        return stop.exit_code
    except torch.cuda.OutOfMemoryError as e:
        log.finish(status="oom", error=str(e).splitlines()[0])
        return 3
    except (UsageError, faults.BadInput) as e:
        fail(str(e))
    except Exception as e:
        # Record what ran and how it ended, then let the traceback through (exit code 1).
        if log.fabric is not None:
            log.finish(
                status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            )
        raise
    log.finish(status="ok")
    return 0

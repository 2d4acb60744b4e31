"""One typed run configuration: every flag a recipe accepts, what follows from them, and the checks.

A recipe declares its rung at the top as a :class:`RunConfig` (the article's configuration for that
rung, and the technique's facts the flags do not say: which optimizer, what is checkpointed, sharded or
offloaded). ``fabric_memory_recipes.training.cli`` builds the command line from the fields below (each flag's default, type and
help live here, once), parses it into a copy of the rung, and :meth:`RunConfig.checked` refuses what
cannot run: one line, exit code 2, before any model, data or device memory is set up. The memory
estimator plans from the same object (``fabric_memory_recipes.planning.plan_for``).

This module imports nothing else from ``fabric_memory_recipes`` but the names of what a run chooses
(``techniques.py``: the precisions, modes, optimizers and memory techniques), and no third-party package:
the hardware the checks need (device counts, bf16 support) is handed to them as a :class:`Hardware`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from fabric_memory_recipes.techniques import BF16_UPDATES, MODES, PRECISIONS

ACCELERATORS = ("auto", "cpu", "cuda", "gpu")
DATA_CHOICES = ("auto", "cifar10", "digits", "synthetic")
WEIGHTS_CHOICES = ("auto", "pretrained", "none")
VIT_MODELS = ("vit_l_16", "vit_b_16", "vit_tiny")  # the ladder's model, a smaller one, the CPU/test size
# The caching allocator's setting in fast mode (read when CUDA starts): cached blocks left over from the
# eager warm-up steps can be returned page by page before the CUDA graph's own pool is made.
FAST_ALLOCATOR = "expandable_segments:True"
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
# package data: what a wheel plans with (planning/planner/snapshot.py)
DATA_DIR = Path(__file__).resolve().parent / "data"
RENAMED_FIELDS = {"checkpoint": "activation_checkpointing"}  # former name -> field: older files still read


class UsageError(Exception):
    """A request that cannot be satisfied; reported as one line and exit code 2."""


# --------------------------------------------------------------------------------------- flag types
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


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def flag(default: Any, group: str, help: str, **argparse_options: Any) -> Any:
    """A field that is also a command-line flag (``--field-name``): its argparse group, help, and the
    options of ``add_argument`` (type, choices, action, metavar)."""
    return field(default=default, metadata={"group": group, "help": help, **argparse_options})


BOOL = argparse.BooleanOptionalAction


@dataclass(frozen=True)
class Hardware:
    """What the checks need to know about the machine (``fabric_memory_recipes.training.cli.detect_hardware`` asks torch)."""

    cuda_devices: int
    cpu_cores: int
    bf16_supported: Callable[[], bool] = lambda: True  # asked only when bf16 on CUDA is requested

    @classmethod
    def planned(cls) -> Hardware:
        """Enough of everything: for predictions of a run on a GPU machine (the estimator)."""
        return cls(cuda_devices=1 << 16, cpu_cores=1 << 16)


# ------------------------------------------------------------------------------------------ the config
@dataclass
class RunConfig:
    """A rung: the flags (with this rung's defaults) and the technique (fields without a flag)."""

    recipe: str = ""  # the results file's name: <results_dir>/<recipe>[-<tag>].json
    # hardware
    accelerator: str = flag(
        "auto", "hardware", "cpu, cuda/gpu, or auto (cuda if present)", choices=ACCELERATORS
    )
    devices: int = flag(1, "hardware", "devices per node (processes are launched for >1)", type=at_least(1))
    num_nodes: int = flag(1, "hardware", "number of machines (with torchrun/SLURM)", type=at_least(1))
    precision: str = flag(
        "32-true", "hardware", "Fabric precision: the main lever of rungs 02-03", choices=PRECISIONS
    )
    tf32: bool = flag(True, "hardware", "TF32 tensor-core matmuls for fp32 tensors (CUDA)", action=BOOL)
    mode: str | None = flag(
        None,
        "hardware",
        "fast: compiled blocks and one CUDA graph per optimizer step (what --compile and --cuda-graphs"
        " default to); eager: neither (default: fast with CUDA, eager on CPU)",
        choices=MODES,
    )
    compile: bool | None = flag(
        None, "hardware", "torch.compile each transformer block (default: on in fast mode)", action=BOOL
    )
    cuda_graphs: bool | None = flag(
        None,
        "hardware",
        "capture each optimizer step as a CUDA graph after a 2-step warm-up (default: on in fast mode;"
        " one CUDA device only)",
        action=BOOL,
    )
    memory_budget_gb: float | None = flag(
        None,
        "hardware",
        "CUDA: act as cards of GB (1e9 bytes) each: every process's caching allocator is capped on its GPU at"
        " GB less the measured card overhead per GPU (torch.cuda.set_per_process_memory_fraction, before the"
        " model is built)",
        type=positive_float,
        metavar="GB",
    )
    # training
    batch_size: int = flag(
        64, "training", "effective batch size per device and optimizer step", type=at_least(1)
    )
    accumulation_steps: int = flag(
        1,
        "training",
        "micro-batches per optimizer step; micro-batch = batch-size / accumulation-steps",
        type=at_least(1),
    )
    epochs: int = flag(1, "training", "passes over the training split", type=at_least(1))
    max_steps: int | None = flag(None, "training", "stop after this many optimizer steps", type=at_least(1))
    lr: float = flag(5e-5, "training", "learning rate", type=positive_float)
    warmup_steps: int = flag(
        0,
        "training",
        "linear learning-rate warm-up over the first N optimizer steps, times the rung's own schedule",
        type=at_least(0),
        metavar="N",
    )
    seed: int = flag(123, "training", "random seed", type=int)
    # bf16 weight updates
    bf16_update: str = flag(
        "plain",
        "bf16",
        "how bf16-true weights store an update: plain rounding (loses small updates), stochastic"
        " rounding, or Kahan-compensated (+2 bytes/parameter)",
        choices=BF16_UPDATES,
    )
    lost_updates: int | None = flag(
        None,
        "bf16",
        "every N optimizer steps, measure the fraction of parameters whose update was lost"
        " (costs a copy of the weights and a sync in those steps)",
        type=at_least(1),
        metavar="N",
    )
    # data and model
    data: str = flag("auto", "data", "data")  # choices and help: DATA_CHOICES and HELP (per family)
    data_dir: str = flag("data", "data", "data_dir")
    weights: str = flag(
        "auto", "data", "auto falls back to random init when offline", choices=WEIGHTS_CHOICES
    )
    model: str = flag("vit_l_16", "data", "model")
    image_size: int | None = flag(
        None,
        "data",
        "input side in pixels (default: the model's; ViT-L/16: 224, other sizes need --weights none)",
        type=at_least(16),
        metavar="PX",
    )
    num_workers: int = flag(0, "data", "DataLoader worker processes", type=at_least(0))
    eval_batches: int | None = flag(
        None, "data", "limit validation/test to this many batches", type=at_least(1)
    )
    # checkpoints
    checkpoint_every: int | None = flag(
        None, "checkpoints", "save a Fabric checkpoint every N optimizer steps", type=at_least(1)
    )
    checkpoint_dir: str | None = flag(
        None, "checkpoints", "where checkpoints go (default: runs/checkpoints/<recipe>[-<tag>])"
    )
    resume: str | None = flag(
        None,
        "checkpoints",
        "a checkpoint file to continue from, or 'auto' for the newest in --checkpoint-dir",
    )
    checkpoint_on_stop: bool | None = flag(
        None,
        "checkpoints",
        "save a checkpoint when stopped by SIGINT/SIGTERM/SIGUSR1/SIGHUP (default: on with --checkpoint-every or --resume)",
        action=BOOL,
    )
    keep_checkpoints: int = flag(
        2, "checkpoints", "keep the newest N checkpoints (0: all; default 2)", type=at_least(0)
    )
    # output
    results_dir: str = flag(
        "runs", "output", "folder of <recipe>.json (not inside results/published/ unless FMR_PUBLISH=1)"
    )
    tag: str | None = flag(None, "output", "suffix for the results file: <recipe>-<tag>.json (a plain name)")
    log_every: int = flag(10, "output", "optimizer steps between logged losses", type=at_least(1))
    # memory anatomy
    memory_timeline: bool = flag(
        False,
        "anatomy",
        "profile the first --profile-steps steps; write <recipe>-timeline.html/.png/.json by category",
        action="store_true",
    )
    snapshot: bool = flag(
        False,
        "anatomy",
        "CUDA only: dump <recipe>-snapshot.pickle of the allocator history (open in pytorch.org/memory_viz)",
        action="store_true",
    )
    profile_steps: int = flag(
        3, "anatomy", "optimizer steps recorded by the two flags above", type=at_least(1)
    )

    # The technique, for the estimator and the checks (no flags): what the rung's code does.
    optimizer: str = "adam"  # one of techniques.OPTIMIZERS
    optimizer_impl: str = "fused"  # fused | foreach | for-loop
    activation_checkpointing: tuple[str, ...] = ()  # module classes whose activations are recomputed
    sharding: str = "none"  # none | fsdp | fsdp2
    shard_units: tuple[str, ...] = ()  # module classes that are one FSDP unit each
    cpu_offload: bool = False  # FSDP keeps parameters, gradients and optimizer state in host memory
    activation_offload: bool = False  # rung 11: saved activations in pinned host memory
    optimizer_in_backward: bool = False  # one optimizer per parameter, stepped in backward: no accumulation
    fused_attention: bool = False  # rung 15: fused-qkv + SDPA attention (training/techniques/attention.py)
    offload_window_mb: int = 0  # rung 11: MiB of copies in flight per side stream
    weights_offload: bool = False  # rung 16: weights, gradients, optimizer state on the host, blocks streamed
    model_choices: tuple[str, ...] = VIT_MODELS
    cpu_variant: str | None = None  # a rung that needs CUDA: the recipe that runs its technique on a CPU

    # The argparse groups, in the order --help shows them; a subclass may add its own.
    GROUPS: ClassVar[dict[str, str]] = {
        "hardware": "hardware",
        "training": "training",
        "bf16": "bf16 weight updates (single-GPU rungs; see fabric_memory_recipes/training/techniques/bf16.py)",
        "data": "data and model",
        "checkpoints": "checkpoints (resumable runs)",
        "output": "output",
        "anatomy": "memory anatomy (see fabric_memory_recipes/measurement/profiling.py)",
    }
    # The flags whose meaning depends on the data and model family (the text recipes replace them).
    DATA_CHOICES: ClassVar[tuple[str, ...]] = DATA_CHOICES
    HELP: ClassVar[dict[str, str]] = {
        "data": "auto falls back to digits (real, bundled with scikit-learn) when CIFAR-10 is unreachable;"
        " synthetic: memory/speed runs only (its accuracy is not a score)",
        "data_dir": "where CIFAR-10 is (or will be downloaded)",
        "model": "vit_l_16 (the ladder), vit_b_16, vit_tiny (CPU/tests)",
    }

    # ------------------------------------------------------------------------------- derived values
    @property
    def micro_batch_size(self) -> int:
        """The samples of one forward pass: batch-size / accumulation-steps (checked to divide)."""
        return self.batch_size // self.accumulation_steps

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def run_name(self) -> str:
        """``<recipe>[-<tag>]``: the stem of the results file, the lock and the default checkpoint folder."""
        return self.recipe + (f"-{self.tag}" if self.tag else "")

    @classmethod
    def flag_fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if "help" in f.metadata]

    def flags(self) -> dict[str, Any]:
        """Every flag's value, plus the micro-batch: the results JSON's ``config``."""
        values = {f.name: getattr(self, f.name) for f in self.flag_fields()}
        values["micro_batch_size"] = self.micro_batch_size
        return values

    def with_flags(self, **values: Any) -> RunConfig:
        """A copy with flag values changed (what the command line does to the rung)."""
        return dataclasses.replace(self, **values)

    # ------------------------------------------------------------------------------------- the checks
    def checked(self, hardware: Hardware) -> RunConfig:
        """A resolved copy ('auto' accelerator, '32', the mode), or :class:`UsageError` for what cannot
        run: combinations argparse cannot see and what the hardware cannot do. Idempotent.

        Fast mode with CUDA graphs sets ``PYTORCH_CUDA_ALLOC_CONF`` (unless it is set) here, before
        anything starts CUDA."""
        c = dataclasses.replace(self)
        if c.batch_size % c.accumulation_steps != 0:
            raise UsageError(
                f"--accumulation-steps {c.accumulation_steps} does not divide --batch-size {c.batch_size}"
                " (the micro-batch must be a whole number of samples)"
            )
        if c.optimizer_in_backward and c.accumulation_steps != 1:  # rungs 12 and 14
            raise UsageError(
                "--accumulation-steps must be 1: stepping in backward frees each gradient at once, "
                "and accumulation needs every gradient kept until the last micro-batch"
            )
        if c.precision == "32":
            c.precision = "32-true"
        if c.accelerator == "auto":
            c.accelerator = "cuda" if hardware.cuda_devices > 0 else "cpu"
        elif c.accelerator == "gpu":
            c.accelerator = "cuda"
        if c.accelerator == "cuda":
            have = hardware.cuda_devices
            if have == 0:
                raise UsageError("--accelerator cuda was requested but no CUDA device is available")
            c._choose_mode()  # before anything starts CUDA: fast mode may configure the allocator
            if c.precision and c.precision.startswith("bf16") and not hardware.bf16_supported():
                raise UsageError(f"--precision {c.precision}: this GPU does not support bfloat16")
        else:
            have = hardware.cpu_cores
            if c.precision == "16-mixed":
                raise UsageError("--precision 16-mixed needs a CUDA GPU; on CPU use bf16-mixed or bf16-true")
        if c.devices > have:
            what = "CUDA devices" if c.accelerator == "cuda" else "CPU cores"
            raise UsageError(f"--devices {c.devices} requested but this machine has {have} {what}")
        if c.bf16_update not in ("plain", None) and c.precision != "bf16-true":
            raise UsageError(f"--bf16-update {c.bf16_update} needs --precision bf16-true, not {c.precision}")
        if c.snapshot and c.accelerator != "cuda":
            raise UsageError(
                "--snapshot needs CUDA: it records the CUDA caching allocator's history;"
                " on a CPU use --memory-timeline"
            )
        if c.weights == "pretrained" and c.model == "vit_tiny":
            raise UsageError(f"--weights pretrained: no pretrained weights exist for --model {c.model}")
        c._choose_mode()
        if c.cpu_variant and c.accelerator != "cuda":  # a rung whose strategy refuses the CPU (08, 09)
            raise UsageError(
                f"{c.recipe} needs CUDA GPUs (FSDPStrategy refuses the CPU); on CPU, recipes/{c.cpu_variant}.py"
                " runs the same sharding"
            )
        if c.lost_updates and c.cuda_graphs:
            raise UsageError(
                "--lost-updates reads the weights between steps: use it with --no-cuda-graphs or --mode eager"
            )
        if c.memory_budget_gb is not None and c.accelerator != "cuda":
            raise UsageError("--memory-budget-gb caps CUDA devices' memory: use it with GPUs, not on a CPU")
        return c

    def graphs_by_default(self) -> bool:
        """Whether fast mode captures CUDA graphs without --cuda-graphs (then :meth:`_choose_mode` sets
        FAST_ALLOCATOR): fast mode on one CUDA device, not profiling, and not torch-optimi's Kahan step (it
        uses the lr as a Python scalar, alpha=-lr: not capturable)."""
        one_device = self.devices == 1 and self.num_nodes == 1
        profiling = self.memory_timeline or self.snapshot
        return (
            self.mode == "fast"
            and self.accelerator == "cuda"
            and one_device
            and not profiling
            and (self.bf16_update != "kahan")
        )

    def _choose_mode(self) -> None:
        """Resolve --mode into --compile and --cuda-graphs (idempotent; refuses impossible combinations)."""
        if self.mode is None:
            # Small batches are launch-bound on a GPU; on a CPU compiling costs more than it saves.
            self.mode = "fast" if self.accelerator == "cuda" else "eager"
        if self.compile is None:
            self.compile = self.mode == "fast"
        one_device = self.devices == 1 and self.num_nodes == 1
        profiling = self.memory_timeline or self.snapshot
        if self.cuda_graphs is None:
            self.cuda_graphs = self.graphs_by_default()
        elif self.cuda_graphs:
            if self.accelerator != "cuda":
                raise UsageError("--cuda-graphs needs CUDA (on a CPU the fast mode is the eager mode)")
            if not one_device:
                raise UsageError(
                    "--cuda-graphs works on one device; with several, leave it out (DDP/FSDP run eagerly)"
                )
            if self.bf16_update == "kahan":
                raise UsageError(
                    "--cuda-graphs with --bf16-update kahan: torch-optimi's Kahan step reads"
                    " the learning rate as a Python number, which a graph cannot replay"
                )
            if profiling:
                raise UsageError(
                    "--cuda-graphs with --memory-timeline/--snapshot: profile the eager steps (--no-cuda-graphs)"
                )
        if self.cuda_graphs and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = FAST_ALLOCATOR

"""The estimator's inputs and output: :class:`Plan` (what besides the model decides a run's memory,
derived from a rung's :class:`~fabric_memory_recipes.config.RunConfig` by :func:`plan_for`) and :class:`Estimate`."""

from __future__ import annotations

import dataclasses
from typing import Any

from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.techniques import CHECKPOINT_MODE, OPTIMIZERS, switches
from fabric_memory_recipes.training.techniques.checkpointing import CheckpointedBlock

GB = 1e9
ALLOCATOR_ROUND = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes
# cuBLAS keeps a 32 MiB workspace per (thread, stream) on Hopper, taken from the caching allocator: one for
# the thread that runs the forward pass, one for autograd's device thread that runs the backward pass.
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
CUDA_WORKSPACE_BYTES = 2 * CUBLAS_WORKSPACE_BYTES

# Component names, in table order. Each simulated storage belongs to exactly one of them.
COMPONENTS = (
    "parameters",
    "gathered_parameters",
    "weight_copies",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "inputs",
    "workspace",
)
COMPONENT_HELP = {
    "parameters": "model weights (trainable and frozen), in the run's parameter dtype",
    "gathered_parameters": "FSDP: full (all-gathered) weights of the units in use, unsharded gradients"
    " (rung 16: the blocks streamed in from host memory)",
    "weight_copies": "low-precision copies of fp32 weights made by autocast, alive while saved",
    "gradients": ".grad of the trainable parameters",
    "optimizer_state": "Adam exp_avg + exp_avg_sq (2x trainable), SGD momentum (1x), none for SGD",
    "activations": "tensors saved by the forward pass for backward (one count per storage)",
    "temporaries": "working memory: gradients w.r.t. activations, recomputed blocks, kernel outputs",
    "inputs": "the micro-batch on the device",
    "workspace": "CUDA library workspace (cuBLAS) handed out by the caching allocator",
}
COMPONENT_COLORS = {
    "parameters": "darkgreen",
    "gathered_parameters": "yellowgreen",
    "weight_copies": "lightseagreen",
    "gradients": "mediumblue",
    "optimizer_state": "goldenrod",
    "activations": "red",
    "temporaries": "mediumpurple",
    "inputs": "black",
    "workspace": "grey",
}
OPTIMIZER_STATE_FACTOR = {"adam": 2, "adamw": 2, "adamw8bit": 2, "sgd": 0, "sgd-momentum": 1, "none": 0}
LOWBIT_BLOCK = 256  # torchao's 8-bit optimizer: one fp32 scale per block of 256 values
LOWBIT_MIN_NUMEL = 4096  # ...and smaller tensors keep full-precision state
OPTIMIZER_IMPLS = ("fused", "foreach", "for-loop")
# The caching allocator a run trains under, as the replay models it: PyTorch's default
# (planning/simulation/allocator.py); expandable segments with eager steps, and fast mode's CUDA graphs under
# them (planning/simulation/expandable.py; fast mode sets expandable segments: config.FAST_ALLOCATOR).
ALLOCATORS = ("default", "expandable", "graphs")
ATTENTION_CHOICES = ("auto", "fused", "math")
SHARDING_CHOICES = ("none", "fsdp", "fsdp2")
CHECKPOINT_WRAPPERS = (
    CheckpointedBlock.__name__,
    "CheckpointWrapper",
)  # modules that checkpoint their child (torch's too)
LOW_PRECISION = {
    "16-mixed": "float16",
    "bf16-mixed": "bfloat16",
    "16-true": "float16",
    "bf16-true": "bfloat16",
}


def _compile_phrase(p: Plan) -> str:
    if p.compiled_blocks:
        return f"on ({', '.join(p.compiled_blocks)} partitioned as inductor does)"
    return "on (eager graph traced)" if p.compile else "off"


def round_bytes(nbytes: int) -> int:
    """Bytes as the CUDA caching allocator hands them out (blocks of 512)."""
    return max(ALLOCATOR_ROUND, -(-nbytes // ALLOCATOR_ROUND) * ALLOCATOR_ROUND) if nbytes else 0


# ------------------------------------------------------------------------------------------------ plan
@dataclasses.dataclass
class Plan:
    """Everything besides the model that decides a run's memory (a recipe's comes from its rung:
    :func:`plan_for`).

    ``activation_checkpointing`` and ``shard_units`` name module classes (``"EncoderBlock"``): every module of that
    class is activation-checkpointed / is one FSDP unit (a model that checkpoints inside its own
    forward, like rung 10's, needs no ``activation_checkpointing``: the simulation runs it). ``world_size`` only
    matters when sharding. ``activation_offload`` models fabric_memory_recipes.training.techniques.offload.offload_activations (saved
    tensors of at least ``offload_min_bytes`` live in host memory, ``offload_window_bytes`` of them in flight
    on the GPU per side stream: copies out and prefetches in); ``optimizer_in_backward`` models a
    per-parameter step in a post-accumulate-grad hook that frees each gradient at once (rung 12).
    ``weights_offload`` models fabric_memory_recipes.training.techniques.weights_offload (rung 16, one GPU): parameters,
    gradients and optimizer state in host memory (0 on the GPU), the modules of ``shard_units`` streamed
    in on a copy stream by the technique's own hooks (planning/simulation/streamed.py: the unit in use and
    the one fetched ahead) and the rest of the model resident. ``mixed_precision_policy`` (FSDP2, sharding
    "fsdp2"): ``fully_shard``'s ``MixedPrecisionPolicy`` gathers the units in the compute dtype of a "-mixed"
    precision, as FSDP1 does under Lightning (your model's fast mode); without it FSDP2 gathers the master
    dtype (the ladder's rungs 08 and 09). ``switched`` names the switched techniques (``techniques.switches()``: the
    fused loss) that the estimate applies to the model through their modules before the step is simulated.
    ``compiled_blocks`` names the compiled block classes that the step runs as inductor partitions them
    (planning/simulation/compiled/partition.py: what they keep for backward); the others run the eager graph.
    """

    precision: str = "32-true"
    micro_batch_size: int = 1
    accumulation_steps: int = 1
    optimizer: str = "adam"
    optimizer_impl: str = "fused"
    activation_checkpointing: tuple[str, ...] = ()
    sharding: str = "none"
    shard_units: tuple[str, ...] = ()
    world_size: int = 1
    cpu_offload: bool = False
    attention: str = "auto"
    device: str = "cuda"
    compile: bool = False
    compiled_blocks: tuple[str, ...] = ()  # run as inductor partitions them (the docstring)
    prefetch_units: int = 2
    activation_offload: bool = False
    offload_min_bytes: int = 1 << 16
    offload_window_bytes: int = 0
    optimizer_in_backward: bool = False
    weights_offload: bool = False
    mixed_precision_policy: bool = False  # FSDP2 gathering in the compute dtype (the docstring)
    checkpoint_mode: str = CHECKPOINT_MODE.default  # what a checkpointed block keeps (its record's option)
    switched: tuple[str, ...] = ()  # techniques.switches() on, by name: each applied by its module
    allocator: str = "default"  # the caching allocator's setting (ALLOCATORS): which replay is reserved_gb

    def __post_init__(self) -> None:
        if self.precision == "32":
            self.precision = "32-true"
        if self.precision not in ("32-true", "64-true", *LOW_PRECISION):
            raise ValueError(f"precision {self.precision!r} is not supported by the estimator")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"optimizer_impl {self.optimizer_impl!r}: expected one of {OPTIMIZER_IMPLS}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator {self.allocator!r}: expected one of {', '.join(ALLOCATORS)}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention {self.attention!r}: expected one of {ATTENTION_CHOICES}")
        if self.sharding not in SHARDING_CHOICES:
            raise ValueError(f"sharding {self.sharding!r}: expected one of {SHARDING_CHOICES}")
        if self.mixed_precision_policy and self.sharding != "fsdp2":
            raise ValueError("mixed_precision_policy is FSDP2's (sharding='fsdp2')")
        if self.cpu_offload and self.sharding == "none":
            raise ValueError("cpu_offload is modelled for FSDP only (sharding='fsdp')")
        if self.weights_offload and (self.sharding != "none" or not self.shard_units):
            raise ValueError(
                "weights_offload streams the shard_units of one unsharded model (sharding='none')"
            )
        self.activation_checkpointing = tuple(self.activation_checkpointing)
        self.shard_units = tuple(self.shard_units)
        self.switched = tuple(self.switched)

    @property
    def attention_kernel(self) -> str:
        """'fused' or 'math': what scaled_dot_product_attention will run (both CUDA and CPU have fused
        kernels for the ViT's attention; 'math' is the meta device's path and the fallback)."""
        return "fused" if self.attention == "auto" else self.attention


def plan_for(cfg: RunConfig, **overrides: Any) -> Plan:
    """The plan of a rung's configuration: its flags (precision, micro-batch, accumulation, devices,
    compile) and its technique (optimizer, checkpointing, sharding, offload); ``overrides`` replace
    any field (the estimator's command line: --optimizer, --checkpoint, --attention)."""
    fields = dict(
        precision=cfg.precision,
        micro_batch_size=cfg.micro_batch_size,
        accumulation_steps=cfg.accumulation_steps,
        world_size=cfg.world_size if cfg.sharding != "none" else 1,  # replicas: per-GPU memory as for one
        device="cpu" if cfg.accelerator == "cpu" else "cuda",
        compile=bool(cfg.compile),
        optimizer=cfg.optimizer,
        optimizer_impl=cfg.optimizer_impl,
        activation_checkpointing=cfg.activation_checkpointing,
        sharding=cfg.sharding,
        shard_units=cfg.shard_units,
        cpu_offload=cfg.cpu_offload,
        activation_offload=cfg.activation_offload,
        offload_window_bytes=cfg.offload_window_mb << 20,
        optimizer_in_backward=cfg.optimizer_in_backward,
        weights_offload=cfg.weights_offload,
        allocator=allocator_of(cfg),
    )
    fields.update(overrides)
    return Plan(**fields)


def expandable_in(alloc_conf: str | None) -> bool:
    """Whether a ``PYTORCH_CUDA_ALLOC_CONF`` value turns expandable segments on."""
    options = (o.split(":", 1) for o in (alloc_conf or "").split(","))
    return any(o[0].strip() == "expandable_segments" and o[-1].strip() == "True" for o in options)


def allocator_of(cfg: RunConfig, expandable: bool | None = None) -> str:
    """The caching allocator a run of ``cfg`` (checked or not) trains under (:data:`ALLOCATORS`): 'graphs'
    when its steps are CUDA graphs, 'expandable' when they are not but its allocator has expandable segments,
    else 'default'. ``expandable``: whether it has them, where that is known (a committed run's provenance,
    the running process's ``PYTORCH_CUDA_ALLOC_CONF``, fast mode of a runner that turns the graphs off after
    RunConfig chose them); by default, when its steps are CUDA graphs (config.FAST_ALLOCATOR). CUDA graphs
    under the default allocator (a ``PYTORCH_CUDA_ALLOC_CONF`` of the user's) are replayed as 'default'."""
    if cfg.accelerator == "cpu":
        return "default"
    graphs = cfg.cuda_graphs
    if graphs is None:  # not checked yet: what fast mode will choose
        graphs = dataclasses.replace(cfg, accelerator="cuda", mode=cfg.mode or "fast").graphs_by_default()
    expandable = graphs if expandable is None else expandable
    return ("graphs" if graphs else "expandable") if expandable else "default"


# -------------------------------------------------------------------------------------------- estimate
@dataclasses.dataclass
class Estimate:
    """The prediction: components at the predicted peak (GB), the peak, and what it assumed."""

    peak_gb: float | None
    components_gb: dict[str, float]
    peak_phase: str
    static_gb: dict[str, float]
    activations_saved_gb: float | None
    parameters: dict[str, int]
    plan: Plan
    model: str
    seconds: float
    kernels: list[str] = dataclasses.field(default_factory=list)
    activations_host_gb: float = 0.0
    # the storages behind activations_saved_gb, unrounded: SavedTensorCounter.nbytes of a real forward pass
    activations_saved_bytes: int | None = None
    timeline: list[tuple[str, dict[str, float]]] = dataclasses.field(default_factory=list, repr=False)
    error: str | None = None
    largest_temporary_gb: float = 0.0  # the largest single block of working memory
    # peak reserved: the step's allocations replayed through the caching allocator (planning/simulation/allocator.py)
    # under the plan's setting (plan.allocator), and under each of ALLOCATORS
    reserved_gb: float | None = None
    reserved_by_allocator: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The ``estimate`` key of the results JSON (documented in fabric_memory_recipes/measurement/results_file.py)."""
        p = self.plan

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {
            "peak_allocated_gb": r(self.peak_gb),
            "components_gb": {k: r(v) for k, v in self.components_gb.items()},
            "peak_phase": self.peak_phase,
            "static_gb": {k: r(v) for k, v in self.static_gb.items()},
            "activations_saved_gb": r(self.activations_saved_gb),
            "activations_host_gb": r(self.activations_host_gb),
            "largest_temporary_gb": r(self.largest_temporary_gb),
            "peak_reserved_simulated_gb": r(self.reserved_gb),
            "parameters": self.parameters,
            "assumptions": {
                "method": "one training step on fake tensors (eager graph), storages tracked",
                "device": p.device,
                "attention_kernel": p.attention_kernel,
                "compile": p.compile,
                "compile_modelled": bool(p.compiled_blocks),
                "precision": p.precision,
                "micro_batch_size": p.micro_batch_size,
                "accumulation_steps": p.accumulation_steps,
                "optimizer": p.optimizer,
                "optimizer_impl": p.optimizer_impl,
                "activation_checkpointing": list(p.activation_checkpointing),
                "checkpoint_mode": p.checkpoint_mode,
                **{t.name: t.name in p.switched for t in switches()},
                "sharding": p.sharding,
                "mixed_precision_policy": p.mixed_precision_policy,
                "shard_units": list(p.shard_units),
                "world_size": p.world_size,
                "cpu_offload": p.cpu_offload,
                "activation_offload": p.activation_offload,
                "optimizer_in_backward": p.optimizer_in_backward,
                "weights_offload": p.weights_offload,
                "allocator": p.allocator,
                "workspace_gb": (CUDA_WORKSPACE_BYTES / GB) if p.device == "cuda" else 0.0,
            },
            "kernels": self.kernels,
            "model": self.model,
            "seconds": round(self.seconds, 2),
            "error": self.error,
        }

    def table(self) -> str:
        """A component table for the terminal."""
        if self.error:
            return f"estimate failed: {self.error}"
        p = self.plan
        lines = [
            f"Memory estimate: {self.model} | precision {p.precision} | micro-batch {p.micro_batch_size}"
            f" x {p.accumulation_steps} | optimizer {p.optimizer} ({p.optimizer_impl})"
            + (f" | checkpoint {','.join(p.activation_checkpointing)}" if p.activation_checkpointing else "")
            + (f" | {p.sharding} over {p.world_size}" if p.sharding != "none" else "")
            + (" + cpu offload" if p.cpu_offload else "")
            + (" + weights on the CPU" if p.weights_offload else ""),
            f"  device {p.device}, attention kernel {p.attention_kernel}, compile {_compile_phrase(p)}",
            "",
            f"  {'component':<22}{'GB at peak':>11}   what",
        ]
        for name in COMPONENTS:
            value = self.components_gb.get(name, 0.0)
            if value or name in ("parameters", "gradients", "optimizer_state", "activations"):
                lines.append(f"  {name:<22}{value:>11.3f}   {COMPONENT_HELP[name]}")
        lines.append(f"  {'-' * 22}{'-' * 11}")
        lines.append(f"  {'predicted peak':<22}{self.peak_gb:>11.3f}   during: {self.peak_phase}")
        lines.append("")
        s = self.static_gb
        lines.append(
            "  Static (arithmetic, per GPU): "
            + ", ".join(f"{k} {v:.3f}" for k, v in s.items())
            + f" GB | trainable {self.parameters['trainable']:,} of {self.parameters['total']:,} parameters"
        )
        if self.activations_saved_gb is not None:
            lines.append(
                f"  Activations saved by one micro-batch's forward pass: {self.activations_saved_gb:.3f} GB"
                + (
                    f" ({self.activations_host_gb:.3f} GB of it offloaded to host memory)"
                    if p.activation_offload
                    else ""
                )
            )
        lines.append(f"  ({self.seconds:.1f} s on CPU, no GPU memory used)")
        return "\n".join(lines)

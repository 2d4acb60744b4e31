"""What ``python -m fabric_memory_recipes.tools.compare.reference`` runs: each rung of this project, the article's
script it is compared with (:data:`RUNGS`), and the processes of one call in the order they go
(:func:`plan_runs`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from fabric_memory_recipes import techniques
from fabric_memory_recipes.measurement.results_file import WARMUP_STEPS
from fabric_memory_recipes.processes import Run

REPO = Path(__file__).resolve().parents[3]  # the checkout

SUBSTITUTION_NOTE = (
    "the article's scripts run unchanged (their Fabric set-up, precision, model, optimizer, loop, batch "
    "size and CPU data pipeline with its DataLoader workers) except for what needs the network: CIFAR-10 "
    "is replaced by deterministic random 32×32 images and labels of its sizes (50,000 / 10,000), read "
    "through CIFAR-10's own dataset class and the script's Resize/ToTensor transforms, and pretrained "
    "weights by a random init of the same architecture (fabric_memory_recipes/tools/compare/runner.py). Each stops after the "
    "same number of optimizer steps as the project's runs; memory and speed depend on shapes, not values."
)


@dataclass(frozen=True)
class Reference:
    """One of the article's scripts, as found in the top folder of its repository."""

    script: str
    devices: int = 1  # processes it needs (its Fabric(devices=...)); > 1 runs under torchrun
    like_for_like: bool = True  # False: not the rung's configuration; no ratios against it
    note: str | None = None
    cpu_offload: bool | None = None  # FSDPStrategy(cpu_offload=...) swapped in (None: as written)

    @property
    def key(self) -> str:
        """The run's name: the script's stem, and what was swapped in (one run per key serves its rows)."""
        return Path(self.script).stem + {None: "", False: "-no-offload", True: "-offload"}[self.cpu_offload]


@dataclass(frozen=True)
class Rung:
    rung: str
    recipe: str  # recipes/<recipe>.py
    reference: Reference | None = None
    devices: int = 1


_FSDP_NOTE = (
    "the article's ViT-L/16 FSDP script (fp32, batch 64 per GPU, Adam 5e-5, FSDP per EncoderBlock, activation "
    "checkpointing), run under torchrun with --devices processes (its Fabric(devices=4) set to that number). "
)
_NO_OFFLOAD = Reference(
    "11_delay-allocation.py",
    devices=4,
    cpu_offload=False,
    note=_FSDP_NOTE + "FSDPStrategy's cpu_offload=True set to False: rung 08's configuration",
)
_OFFLOAD = Reference(
    "11_delay-allocation.py",
    devices=4,
    note=_FSDP_NOTE + "As written, cpu_offload=True: rung 09's configuration",
)
RUNGS: dict[str, Rung] = {
    r.rung: r
    for r in (
        Rung(
            "01",
            "01_baseline",
            Reference(
                "01-2_pytorch-fabric.py",
                note="the script leaves float32 matmuls at full precision; the rung uses TF32 matmuls",
            ),
        ),
        Rung("02", "02_mixed_precision", Reference("02_mixed-precision.py")),
        Rung("03", "03_true_half_precision", Reference("03_bfloat16.py")),
        Rung("04", "04_lower_batch_size", Reference("04_lower-batchsize.py")),
        Rung("05", "05_gradient_accumulation", Reference("05_gradient-accum.py")),
        Rung("06", "06_sgd_cosine", Reference("06_sgd-with-scheduler.py")),
        Rung(
            "07",
            "07_init_module",
            Reference(
                "06_sgd-with-scheduler.py",
                note="the article's 07_0*_init-module.py scripts only build a model and print its memory (no "
                "training loop); rung 07 trains rung 06's configuration, so the 06 script is its reference "
                "(one run serves both rows)",
            ),
        ),
        Rung("08", "08_fsdp", _NO_OFFLOAD, devices=4),
        Rung("08-fsdp2", "08_fsdp2", _NO_OFFLOAD, devices=4),
        Rung("09", "09_cpu_offload", _OFFLOAD, devices=4),
        Rung("10", "10_activation_checkpointing"),
        Rung("11", "11_activation_offload"),
        Rung("12", "12_optimizer_in_backward"),
        Rung("13", "13_lowbit_optimizer"),
        Rung("14", "14_memory_floor"),
        Rung("15", "15_speed"),
    )
}
# The single-GPU ladder, in fast mode by default: what the comparison, the A/B (ab_ladder) and the
# equivalence check (check_equivalence) run. Rung 16 runs eagerly only (no graph to compare with eager).
SINGLE_GPU_RUNGS = ("01", "02", "03", "04", "05", "06", "07", "10", "11", "12", "13", "14", "15")
SHARDED_RUNGS = ("08", "08-fsdp2", "09")  # several GPUs: --devices N (default: each rung's own, 4)
MODES = techniques.subset(
    techniques.MODES, "eager", "fast"
)  # every mode, in the order each rung's rows show them
# The flags of every project run, and those of each mode ({mode} is replaced). `--eval-batches 2` keeps
# the evaluation short; it still runs, so its memory is in the whole-run peak.
PROJECT_ARGS = ("--data", "synthetic", "--weights", "none", "--eval-batches", "2")
MODE_ARGS = ("--tag", "{mode}", "--mode", "{mode}")
MIN_STEPS = WARMUP_STEPS + 2  # at least two timed intervals after the warm-up steps


# ------------------------------------------------------------------------------------------- the plan
def reference_json(runs_dir: Path, ref: Reference) -> Path:
    return runs_dir / f"reference-{ref.key}.json"


def devices_of(spec_devices: int, devices: int | None) -> int:
    """The processes of a run: one for a single-GPU rung or script, else ``devices`` (``--devices``) or
    its own number."""
    return spec_devices if spec_devices == 1 or devices is None else devices


def project_json(runs_dir: Path, recipe: str, mode: str) -> Path:
    return runs_dir / f"{recipe}-{mode}.json"  # results_file.results_path with --tag <mode>


def plan_runs(
    rungs: list[str],
    modes: list[str],
    reference_dir: Path,
    runs_dir: Path,
    steps: int,
    python: str = sys.executable,
    mapping: dict[str, Reference] | None = None,
    mode_args: tuple[str, ...] = MODE_ARGS,
    extra_args: tuple[str, ...] = (),
    devices: int | None = None,
) -> list[Run]:
    """The runs in the order they go: per rung, its reference script (once per script and what is
    swapped in), then each mode. ``devices``: the processes of the multi-GPU rungs and scripts."""
    mapping = mapping or {}
    runs: list[Run] = []
    by_key: dict[str, Run] = {}
    for rung in rungs:
        spec = RUNGS[rung]
        ref = mapping.get(rung, spec.reference)
        if ref is not None:
            if ref.key not in by_key:
                out = reference_json(runs_dir, ref)
                runner = [
                    "-m",
                    "fabric_memory_recipes.tools.compare.runner",
                    str(reference_dir / ref.script),
                ]
                launch, n = [python, *runner], devices_of(ref.devices, devices)
                if (
                    n > 1
                ):  # Fabric joins the processes torchrun starts (its own launcher would skip the runner)
                    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
                    launch = [python, *torchrun, *runner, "--devices", str(n)]
                if ref.cpu_offload is not None:
                    launch += ["--fsdp-cpu-offload", "on" if ref.cpu_offload else "off"]
                cmd = [*launch, "--steps", str(steps), "--out", str(out)]
                swapped = None if ref.cpu_offload is None else f"cpu_offload={ref.cpu_offload}"
                by_key[ref.key] = Run("reference", ref.script, swapped, cmd, out, out.with_suffix(".log"))
                runs.append(by_key[ref.key])
            by_key[ref.key].rows.append(rung)
        for mode in modes:
            out = project_json(runs_dir, spec.recipe, mode)
            cmd = [python, str(REPO / "recipes" / f"{spec.recipe}.py"), *PROJECT_ARGS]
            cmd += ["--max-steps", str(steps), "--results-dir", str(runs_dir)]
            if spec.devices > 1:
                cmd += ["--devices", str(devices_of(spec.devices, devices))]
            cmd += [a.format(mode=mode) for a in mode_args] + list(extra_args)
            runs.append(Run("project", rung, mode, cmd, out, out.with_suffix(".log"), rows=[rung]))
    return runs

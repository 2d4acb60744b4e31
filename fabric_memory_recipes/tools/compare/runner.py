"""Run one of the article's scripts offline and time its optimizer steps, without editing the script.

    python -m fabric_memory_recipes.tools.compare.runner SCRIPT --steps 25 --out run.json

SCRIPT is a training script from a checkout of the article's repository (rasbt/pytorch-memory-optim,
Apache-2.0), e.g. ``05_gradient-accum.py``. The script runs as ``__main__`` (runpy) in a temporary
working directory with its own folder first on ``sys.path`` (so ``from local_utilities import ...``
works), unchanged: its Fabric, precision, model, optimizer, loop, batch size, CPU transforms and
DataLoader (with its ``num_workers``) are its own. Only what needs the network is swapped:

* ``torchvision.datasets.CIFAR10`` -> the same class with random contents: deterministic random 32x32
  RGB uint8 images and random labels, 50,000 train / 10,000 test (CIFAR-10's sizes and layout), read
  through CIFAR-10's own ``__getitem__`` (PIL image -> the script's transforms).
* Pretrained weights -> random init of the same architecture: torchvision's ViT builders called with
  ``weights=...`` build the model those weights describe (image size, 1000 classes) without loading them.
  Memory and speed depend on shapes, not on values.
* ``watermark`` (and ``pandas``, which ``local_utilities`` imports only for its IMDb helpers) -> small
  stand-in modules, only when they are not installed.

Timing. A global optimizer step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``)
records a CUDA event after every optimizer step (``time.perf_counter`` when CUDA is not in use): no
synchronisation, no change to the work. After ``--steps`` steps it reads the peak memory and stops the
script by raising an exception that this runner catches (``reference_recorder.StepRecorder``). Like the project's metrics logger
(``fabric_memory_recipes.measurement.results``), the first ``WARMUP_STEPS`` intervals between steps are left out and
``images_per_s = effective batch x world size / median interval``.

Batch size. A forward pre-hook on the model counts the images that go through it in training mode
between two optimizer steps, so the effective batch is what the script really feeds per step (micro-batch
x accumulation), whatever constants it uses; the most common count over the timed intervals is taken.
The script's upper-case integer constants (``BATCHSIZE``, ``ACCUMULATION_STEPS``, ...) are recorded next
to it as a cross-check; they are the fallback when nothing was counted (a model that torchvision's ViT
builders did not make): ``batch_source`` says which. A step that the fp16 GradScaler skips (non-finite gradients, usually while its
scale calibrates in the first steps) calls no ``optimizer.step``: its images and time fall into the next
interval (``images_per_interval`` in the JSON shows it). The substitutions are in ``reference_substitutions``.

Memory. ``torch.cuda.max_memory_reserved/allocated`` (GB = 1e9 bytes) from the start of the process to
the last timed step: model load included, like the project's whole-run peak. ``memory.warmup`` is the
peak up to the end of the warm-up steps, ``memory.steady`` the peak after it (the stats are reset in
between, which changes no allocation).

Several processes (the FSDP scripts): launch the runner with ``torchrun --nproc-per-node N -m
fabric_memory_recipes.tools.compare.runner ... --devices N``; rank 0 writes ``--out``, rank r > 0 writes
``<out>.rank<r>.json``. A script's own ``fabric.launch()`` would start its processes by re-running the
script without this runner, so torchrun starts them, and ``--devices N`` sets its ``Fabric(devices=...)``
to their number. ``--fsdp-cpu-offload on|off`` sets ``FSDPStrategy(cpu_offload=...)`` (rung 08's
configuration is ``11_delay-allocation.py`` with it off). Both are recorded in ``substitutions``.

Exit code: 0 ok, 1 the script failed or ended before ``--steps`` steps, 2 bad arguments, 3 CUDA out of
memory. The JSON is written in every case but 2.
"""

from __future__ import annotations

import hashlib
import os
import runpy
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from fabric_memory_recipes.config import at_least
from fabric_memory_recipes.console import Parser, fail
from fabric_memory_recipes.measurement.results import environment
from fabric_memory_recipes.measurement.results_file import write_json_atomic
from fabric_memory_recipes.tools.compare.recorder import StepRecorder, StopRun
from fabric_memory_recipes.tools.compare.substitutions import parse_arch, substitutions

SCHEMA = "reference_run/1"


def run_script(script: Path, cwd: str) -> None:
    """``python SCRIPT`` in-process: __main__, argv [SCRIPT], its folder first on sys.path, in ``cwd``."""
    saved = os.getcwd(), sys.argv[:], sys.path[:]
    before = set(sys.modules)
    os.chdir(cwd)
    sys.argv = [str(script)]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        os.chdir(saved[0])
        sys.argv[:], sys.path[:] = saved[1], saved[2]
        for name in set(sys.modules) - before:  # the script's own helpers (local_utilities)
            path = getattr(sys.modules[name], "__file__", None) or ""
            if os.path.dirname(os.path.abspath(path)) == str(script.parent):
                del sys.modules[name]


# -------------------------------------------------------------------------------------------- main
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def rank_path(out: str, rank: int) -> str:
    return out if rank == 0 else f"{out[: -len('.json')] if out.endswith('.json') else out}.rank{rank}.json"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m fabric_memory_recipes.tools.compare.runner",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("script", help="one of the article's training scripts (e.g. 05_gradient-accum.py)")
    parser.add_argument("--steps", type=at_least(2), default=25, help="optimizer steps before stopping")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    parser.add_argument(
        "--vit-arch",
        default=os.environ.get("REFERENCE_RUNNER_VIT_ARCH"),
        help="tests: a tiny ViT instead, e.g. image_size=32,patch_size=8,num_layers=1 (env REFERENCE_RUNNER_VIT_ARCH)",
    )
    parser.add_argument("--devices", type=at_least(1), help="set the script's Fabric(devices=...) to N")
    parser.add_argument(
        "--fsdp-cpu-offload", choices=("on", "off"), help="set the script's FSDPStrategy(cpu_offload=...)"
    )
    args = parser.parse_args(argv)
    script = Path(args.script).resolve()
    if not script.is_file():
        fail(f"no such script: {args.script}")
    try:
        arch = parse_arch(args.vit_arch)
    except ValueError as e:
        fail(str(e))

    recorder = StepRecorder(script, args.steps)
    status, error = "ok", None
    start = time.perf_counter()
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="reference-run-") as cwd:
        offload = None if args.fsdp_cpu_offload is None else args.fsdp_cpu_offload == "on"
        with substitutions(recorder, arch, args.devices, offload) as notes:
            try:
                run_script(script, cwd)
                status = "error"
                error = f"the script ended after {len(recorder.marks)} of {args.steps} optimizer steps"
            except StopRun:
                pass
            except torch.cuda.OutOfMemoryError as e:
                status, error = "oom", _first_line(e)
            except SystemExit as e:  # the script called sys.exit() before the last step
                status = "error"
                error = f"the script exited ({e.code}) after {len(recorder.marks)} of {args.steps} optimizer steps"
            except Exception as e:
                traceback.print_exc()
                status, error = "error", _first_line(e)
    wall = time.perf_counter() - start
    payload = {
        "schema": SCHEMA,
        "script": script.name,
        "script_sha256": hashlib.sha256(script.read_bytes()).hexdigest(),
        "status": status,
        "error": error,
        "requested_steps": args.steps,
        **recorder.summary(),
        "substitutions": list(notes),
        "wall_s": wall,
        "provenance": {
            "gpu_name": torch.cuda.get_device_name() if recorder.cuda else None,
            **environment(),
        },
    }
    write_json_atomic(rank_path(args.out, payload["rank"]), payload)
    speed = payload["images_per_s"]
    print(
        f"reference_runner: {script.name}: {status}"
        + (f" ({error})" if error else "")
        + f", {payload['steps']} steps, peak reserved {payload['peak_reserved_gb'] or 0:.2f} GB, "
        + (f"{speed:.1f} img/s" if speed else "img/s n/a"),
        flush=True,
    )
    return {"ok": 0, "oom": 3}.get(status, 1)


if __name__ == "__main__":
    # the dataset class lives in reference_substitutions: DataLoader workers that are not forked import it by name
    raise SystemExit(main())

"""A recipe's life from the command line to its results file: :func:`run_recipe`.

    if __name__ == "__main__":
        raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))

In order: stop signals are handled from the start; the command line becomes a checked copy of the
rung (``fabric_memory_recipes.training.cli.parse``); the checkpoint folder and ``--resume auto`` are resolved; the outputs are
checked (the results folder takes a file, no other run of this rung writes there); then
``main(cfg, results)`` runs and its outcome is recorded. Anything refused on the way is one line on
stderr and exit code 2, before any model, data or device memory is set up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from fabric_memory_recipes import faults, paths
from fabric_memory_recipes.config import RunConfig, UsageError
from fabric_memory_recipes.console import fail, notice
from fabric_memory_recipes.measurement import card_overhead, device_memory
from fabric_memory_recipes.measurement import results as results_module
from fabric_memory_recipes.measurement.results import RunResults
from fabric_memory_recipes.measurement.results_file import gpu_slug
from fabric_memory_recipes.training import checkpoints, cli, host_cores

Main = Callable[[RunConfig, RunResults], None]


def run_recipe(main: Main, rung: RunConfig, description: str, argv: Sequence[str] | None = None) -> int:
    """Parse the flags into ``rung``, check the outputs, run ``main(cfg, results)``, record the outcome.

    A CUDA out-of-memory error is caught here and written as ``"status": "oom"`` with its config, so a
    ladder run loses nothing; the process then exits 3 (``run_all.sh`` reports it and moves on).
    SIGINT, SIGTERM, SIGUSR1 and SIGHUP stop the run at the next optimizer step (fabric_memory_recipes/faults.py):
    it is recorded as ``"status": "interrupted"``, one line says where it stopped and how to resume, and the
    process exits 130, 143, 138 or 129. A bad input file (data, checkpoint) is one line and exit code 2.
    """
    with faults.handling_signals():  # from here on, a signal stops the run at an optimizer-step boundary
        # Whole-device memory is sampled from here, before anything (a flag check, the budget, the
        # model) may start CUDA in this process: the baseline is the device without it.
        sampler = device_memory.start_for_run()
        try:
            cfg = resolve_checkpoints(cli.parse(rung, argv, description))
            if cfg.accelerator == "cpu" and sampler is not None:
                sampler.stop(reason="not a CUDA run")
                sampler = None
            lock = _prepare_outputs(cfg)
            try:
                return _run_main(main, cfg, description, sampler)
            finally:
                lock.release()
        finally:
            if sampler is not None:
                sampler.stop()


def resolve_checkpoints(cfg: RunConfig) -> RunConfig:
    """Fill in the default checkpoint folder, decide ``--checkpoint-on-stop``, and turn ``--resume
    auto`` into the newest intact checkpoint (or None). A checkpoint that cannot be used, or a new run
    that would write its checkpoints among an earlier run's, is refused here, before anything is built."""
    cfg = dataclasses.replace(cfg)
    if cfg.checkpoint_dir is None:
        cfg.checkpoint_dir = os.path.join(paths.RUNS, "checkpoints", cfg.run_name)
    if cfg.checkpoint_on_stop is None:
        cfg.checkpoint_on_stop = cfg.checkpoint_every is not None or cfg.resume is not None
    asked_auto = cfg.resume == "auto"
    if asked_auto:
        cfg.resume = checkpoints.latest_intact(cfg.checkpoint_dir, say=notice)
        if cfg.resume is None:
            found = checkpoints.contents(cfg.checkpoint_dir)
            notice(
                f"[resume] --resume auto: no usable checkpoint of {cfg.run_name} in {cfg.checkpoint_dir}"
                f" (found: {found}): starting from the beginning"
            )
    elif cfg.resume is not None:
        reason = checkpoints.problem(cfg.resume)
        if reason is not None:
            fail(f"--resume {cfg.resume}: {reason}")
    newest = checkpoints.latest(cfg.checkpoint_dir)
    writes = cfg.checkpoint_every is not None or cfg.checkpoint_on_stop
    # --resume auto that found nothing usable starts over, as it said (the unusable files stay)
    if writes and cfg.resume is None and newest is not None and not asked_auto:
        fail(
            f"--checkpoint-dir {cfg.checkpoint_dir} holds an earlier run's checkpoints (newest {os.path.basename(newest)}):"
            " continue it with --resume auto, or start over in another --checkpoint-dir"
        )
    return cfg


def _prepare_outputs(cfg: RunConfig) -> faults.RunLock:
    """Before anything is built: the results (and, when used, checkpoint and log) folders exist and
    take a file, and no other run of this rung writes to the same results folder. Exits 2 otherwise.
    Returns the held lock (a lock that holds nothing in the processes Fabric or a launcher started)."""
    lock = faults.RunLock(cfg.results_dir, cfg.run_name)
    try:
        faults.check_writable(cfg.results_dir, "--results-dir")
        if cfg.checkpoint_every is not None or cfg.checkpoint_on_stop:
            faults.check_writable(cfg.checkpoint_dir, "--checkpoint-dir")
        faults.check_writable(results_module.LOG_DIR, "the log folder (FMR_LOG_DIR)")
        if faults.first_process():  # the process that writes the results JSON
            lock.acquire()
    except faults.BadInput as e:
        fail(str(e))
    return lock


def apply_memory_budget(cfg: RunConfig) -> dict | None:
    """``--memory-budget-gb X``: make the run behave as on a card of X GB (``devtools.planner_proof``
    emulates 1-8 GB cards this way). A card holds the process's CUDA context, library handles and
    kernels besides PyTorch's caching allocator, so the allocator is capped
    (``torch.cuda.set_per_process_memory_fraction``) at X less the card overhead measured for this GPU
    kind and mode (``fabric_memory_recipes.measurement.card_overhead``; where none is measured, at X, and the
    record says so). With several processes (FSDP) each caps its own GPU (its local rank's, which the
    launcher sets before it runs this) at X less the overhead measured per GPU of that many processes
    (NCCL's buffers included). Returns what the results JSON records (``extra.memory_budget``)."""
    if cfg.memory_budget_gb is None:
        return None
    device = int(os.environ.get("LOCAL_RANK", "0")) if cfg.world_size > 1 else 0
    processes = cfg.devices if cfg.world_size > 1 and isinstance(cfg.devices, int) else 1
    total = torch.cuda.get_device_properties(device).total_memory
    budget = cfg.memory_budget_gb * 1e9
    if budget > total:
        raise UsageError(f"--memory-budget-gb {cfg.memory_budget_gb:g}: this GPU has {total / 1e9:.1f} GB")
    over = card_overhead.overhead_per_gpu(
        gpu_slug(torch.cuda.get_device_name(device)), card_overhead.overhead_mode(cfg.flags()), processes
    )
    allocator = budget - (over.gb or 0.0) * 1e9
    if allocator <= 0:
        raise UsageError(
            f"--memory-budget-gb {cfg.memory_budget_gb:g}: a card this small cannot even hold the"
            f" {over.gb:.2f} GB a CUDA process needs outside the allocator ({over.source})"
        )
    torch.cuda.set_per_process_memory_fraction(allocator / total, device)
    return {
        "budget_gb": cfg.memory_budget_gb,
        "device_index": device,
        "processes_per_machine": processes,
        "allocator_gb": allocator / 1e9,
        "overhead_gb": over.gb,
        "overhead_source": over.source,
        "device_total_gb": total / 1e9,
        "fraction": allocator / total,
        "how": "torch.cuda.set_per_process_memory_fraction(budget - card overhead), before the model is built"
        + (", in every process on its own GPU" if processes > 1 else ""),
    }


def compiling_as_asked(cfg: RunConfig) -> contextlib.AbstractContextManager:
    """An eager run on the CPU (the CPU's default mode) compiles nothing: what a library compiles on its
    own runs eagerly too (torchao's Adam compiles its step, which on a CPU cost ~20 s of a 10 s run, and
    a Ctrl-C waited for it). On CUDA the rungs keep what they measured with; ``--compile`` compiles."""
    if cfg.accelerator == "cpu" and not cfg.compile:
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def caused_by_oom(error: BaseException) -> bool:
    """A CUDA out-of-memory error, or one raised while handling it (torch.compile and CUDA graph
    capture wrap the allocator's error in their own)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, torch.cuda.OutOfMemoryError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _run_main(
    main: Main, cfg: RunConfig, description: str, sampler: device_memory.DeviceSampler | None = None
) -> int:
    first_line = description.strip().splitlines()[0] if description.strip() else ""
    results = RunResults(cfg, description=first_line, device=sampler)
    try:
        budget = apply_memory_budget(cfg)
        if budget is not None:
            results.extra["memory_budget"] = budget
        if cfg.devices > 1:  # this host's processes share its cores (not one thread per core each)
            results.extra["host_threads"] = host_cores.share_threads(cfg.devices)
        with compiling_as_asked(cfg):
            main(cfg, results)
    except faults.Interrupted as stop:
        # Every process stopped after the same step (the loop agrees on it): gathering is safe.
        results.extra["stopped"] = stop.record()
        results.finish(status="interrupted", error=str(stop), gather=True)
        if results.fabric is None or results.fabric.global_rank == 0:
            with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP): the results are written
                print(faults.interrupted_line(stop), file=sys.stderr, flush=True)
        outlive_launcher(results.fabric)
        return stop.exit_code
    except (UsageError, faults.BadInput) as e:
        fail(str(e))
    except Exception as e:
        first_line = str(e).splitlines()[0] if str(e) else ""
        if caused_by_oom(e):  # the allocator's error, or torch.compile's / a graph capture's around it
            oom = isinstance(e, torch.cuda.OutOfMemoryError)
            results.finish(status="oom", error=first_line if oom else f"{type(e).__name__}: {first_line}")
            return 3
        # Record what ran and how it ended, then let the traceback through (exit code 1).
        if results.fabric is not None:
            results.finish(status="error", error=f"{type(e).__name__}: {first_line}")
        raise
    results.finish(status="ok")
    return 0


def outlive_launcher(fabric, timeout: float = 60.0) -> None:
    """In a process that Fabric's own launcher started (``--devices N`` without torchrun/SLURM): wait
    for rank 0 to exit first. That launcher watches its processes and, as soon as one exits with a
    non-zero code, kills the others, rank 0 included, which may still be writing the results JSON."""
    if fabric is None or fabric.local_rank == 0:
        return
    if not isinstance(getattr(fabric.strategy, "cluster_environment", None), LightningEnvironment):
        return
    parent, deadline = os.getppid(), time.monotonic() + timeout
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)

"""What the step-time model predicts for a your-model run, term by term, beside its measured step.

The speed model (planning/your_model/step_time.py) sums, per micro-batch, each op's time on the host and on
the GPU in a queue; this tool prints for each results JSON given (a run's ``your_model.json``, or a
``.tgz`` holding some) the simulated kernels, the host's and the GPU's sums per micro-batch, the queue,
the optimizer step and the predicted step, on the stored ceilings of the run's GPU kind:

    python -m devtools.speed.host_components results/published/h200/encdec-step-profile/encdec_profile.tgz

A host-bound step (the GPU idle most of it: measurement/profiling.py's tables) is predicted from the
host's sum; that is the term to compare with a profile's host time per step. A sharded run (``--devices N``,
one GPU's shard simulated) adds what ``--fit`` adds to its step: FSDP's exposed collectives and, with
``--cpu-offload``, the offload's copies and CPU step (planning/your_model/set_speed.py).
"""

from __future__ import annotations

import sys

import numpy as np

from devtools.your_model.repredict import results_files
from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.measurement.results_file import gpu_slug
from fabric_memory_recipes.planning.your_model import set_speed, step_time
from fabric_memory_recipes.planning.your_model.estimate import meta_user_model
from fabric_memory_recipes.planning.your_model.step_calibration import Run, run_costs, run_mode
from fabric_memory_recipes.training.your_model.sharding import fully_sharded


def components(run: Run, gpu: str, parameters: int = 0, trainable: int = 0) -> dict[str, float]:
    """The predicted terms of ``run``'s step on ``gpu``'s stored ceilings (ms, and counts); a sharded run's
    collectives and CPU offload from its ``parameters`` (``trainable`` of them)."""
    costs = run_costs(run)
    c, _ = step_time.ceilings(gpu)
    mode = "eager" if run.mode == "eager" else "fast"
    graphs = run.mode == "graphs"
    total, detail = step_time.step_seconds(costs, c, mode, graphs)
    out: dict[str, float] = {"predicted_ms": 1e3 * total, "measured_ms": 1e3 * run.measured_s}
    for i, m in enumerate(costs.micro):
        host = m.host_times(
            c, mode if costs.compiled else "eager"
        )  # each op's host time (the queue's host side)
        out[f"mb{i}_kernels"] = float(m.kernels.sum())
        out[f"mb{i}_host_ms"] = 1e3 * float(np.sum(host))
        out[f"mb{i}_queue_ms"] = 1e3 * detail["per_micro_batch_s"][i]
    out["micro_batches"] = costs.accumulation_steps
    out["optimizer_ms"] = 1e3 * detail["optimizer_s"]
    cfg, devices = run.config, int(run.config.get("devices") or 1)
    if devices > 1:
        comms = set_speed.collective_seconds(
            parameters, trainable, devices, cfg["precision"], costs.accumulation_steps
        )
        offload = (
            set_speed.offload_seconds(
                parameters,
                devices,
                cfg.get("optimizer") or "adamw",
                fully_sharded(bool(cfg.get("compile")), cfg["precision"]),  # FSDP2 in fast mode, else FSDP1
            )
            if cfg.get("cpu_offload")
            else 0.0
        )
        out["collectives_ms"], out["cpu_offload_ms"] = 1e3 * comms, 1e3 * offload
        out["predicted_ms"] += out["collectives_ms"] + out["cpu_offload_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="results JSONs, folders or .tgz archives")
    args = parser.parse_args(argv)
    for name, d in results_files(args.paths):
        if not isinstance(d, dict) or d.get("recipe") != "your_model" or d.get("status") != "ok":
            continue
        timing, config = d.get("timing") or {}, d["config"]
        gpu = gpu_slug((d.get("provenance") or {}).get("gpu_name")) or "h100"
        run = Run(name, "your_model", config["model"], run_mode(config), config, timing["median_step_s"], 1)
        total = trainable = 0
        if int(config.get("devices") or 1) > 1:  # the whole model's count (a sharded run records its shard's)
            _, model, _, _ = meta_user_model(config["model"])
            total = sum(p.numel() for p in model.parameters())
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        terms = components(run, gpu, total, trainable)
        print(f"{name} ({gpu}, {run.mode})")
        print("  " + ", ".join(f"{k} {v:.1f}" for k, v in terms.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

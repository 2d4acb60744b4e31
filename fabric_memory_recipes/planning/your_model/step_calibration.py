"""Where the step-time model's ceilings come from (planning/your_model/step_time.py): the committed runs it is fitted
on, the fit, and the stored table an installed wheel plans with (``fabric_memory_recipes/data/step_time.json``).

    python -m fabric_memory_recipes.planning.your_model.step_calibration                  # the table, printed
    python -m fabric_memory_recipes.planning.your_model.step_calibration --write          # ... and stored
    python -m fabric_memory_recipes.planning.your_model.step_calibration --leave-one-out  # + each model held out

Each run's configuration (its results JSON's ``config``) is planned as the run planned it (your model:
planning/your_model/estimate.py ``plan_of``, the fused loss as ``estimate`` applies it; a ladder rung:
its declared rung, planning/plan.py ``plan_for``) and simulated on the meta model with the op-cost
collector. Repeats of one configuration are one point, at their median. The fit: least squares on log time
(``scipy.optimize.least_squares`` over the ceilings' logs, the best of four starts; log, so that the error is the
ratio the planner's samples/s are off by), every ceiling but B_host on the runs without activation offload, then
B_host alone on the offload runs. 8-bit AdamW runs are reported, not fitted (:data:`NOT_FITTED`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from fabric_memory_recipes import techniques
from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.console import Parser, fail
from fabric_memory_recipes.declarations import declared_rung
from fabric_memory_recipes.measurement import gemm_rates, results_file
from fabric_memory_recipes.measurement.results_file import gpu_slug, results_of, write_json_atomic
from fabric_memory_recipes.planning.plan import plan_for
from fabric_memory_recipes.planning.planner.calibration import REPO
from fabric_memory_recipes.planning.simulation.costs import OpCosts
from fabric_memory_recipes.planning.simulation.simulate import simulate
from fabric_memory_recipes.planning.your_model import step_time
from fabric_memory_recipes.planning.your_model.estimate import meta_user_model, plan_of
from fabric_memory_recipes.training.models import blocks as ladder_blocks
from fabric_memory_recipes.training.models import meta_ladder_model
from fabric_memory_recipes.training.your_model import runner

# The committed runs per GPU kind (ARCHIVE:MEMBER inside a .tgz), each alone on the GPU. h100: your model's
# (eager; the causal LMs also fast), the ladder's beside the article's scripts (h100/compare/NOTES.md).
RUN_GLOBS = {
    "h100": (
        "results/published/h100/your-model/runs/*/your_model.json",
        "results/published/h100/your-model-speed/lm/*.json",
        "results/published/h100/your-model-speed/lm-probe/*.json",
        "results/published/h100/compare/runs/*.json",
    ),
    "h200": (
        "results/published/h200/ranking-check/*.tgz:*/runs/*/your_model.json",
        "results/published/h200/encdec-step-profile/encdec_profile.tgz:*/runs/*-timed/your_model.json",
        "results/published/h200/encdec-step-profile/*/encdec_profile.tgz:*/runs/*-timed/your_model.json",
        # the causal LMs' fused-loss sets as the loss now runs (graphs/NOTES.md); of the calls before, the eager set
        "results/published/h200/your-model-speed/graphs/chunked-loss/*.tgz:*/runs/*.json",
        "results/published/h200/your-model-speed/graphs/call3/*.tgz:*/runs/*-eager-*.json",
        "results/published/h200/ab/quick-ladder/*/after.tgz:after/*.json",
        "results/published/h200/swin-fast-probe/swin_fast_probe.tgz:*/runs/*/your_model.json",
    ),
}
NOT_FITTED = {
    "adamw8bit": "8-bit AdamW: the model counts its state's bytes only, not its per-tensor (de)quantisation"
}
# The ceilings' starting point (H100-like orders of magnitude; the fit moves every one).
START = step_time.Ceilings(
    matmul_flops=500e12, bandwidth=2e12, kernel_s=3e-6, python_op_s=40e-6, module_s=10e-6, autograd_op_s=20e-6,
    recompute_block_s=1e-3, compiled_call_s=1e-3, fusion=0.5, hook_s=0.3e-3, host_bandwidth=10e9,
    graph_kernel_s=2e-6, statistics_bandwidth=0.6e12, strided_bandwidth=1e12, unaligned_flops=100e12,
)  # fmt: skip
FIELDS = [f.name for f in dataclasses.fields(step_time.Ceilings) if f.type in (float, "float")]  # the fitted
OFFLOAD_FIELDS = ["host_bandwidth"]
OFFLOAD_RUNGS = ("11_activation_offload", "14_memory_floor")  # the ladder's rungs that offload activations
# Bounds the fit keeps: fusion a share (free, an H200 fit made it 9.2 at 39 TB/s), at least the smallest share a
# profile measured (the LM graph steps' blocks, h200/your-model-speed/graphs/NOTES.md; free, the fit made it 0)
UPPER = {"fusion": 1.0}
LOWER = {"fusion": 0.09}
# And a kind's datasheet HBM bandwidth and dense bf16 peak (H100 SXM, H200) over each rate of its kind (free, an h100
# fit put B at 5.7 TB/s, trading it against fusion and g_graph; bounded, its errors the same within a point)
PEAK = results_file.PEAK_BF16_FLOPS
DATASHEET = {"h100": (3.35e12, PEAK["H100"]), "h200": (4.8e12, PEAK["H200"])}


def start_of(gpu: str | None) -> step_time.Ceilings:
    """:data:`START`, with ``gpu``'s measured matrix products where the package holds them (gemm_rates.py)."""
    return dataclasses.replace(START, gemm_table=gpu if gpu in gemm_rates.kinds() else "")


def upper_of(gpu: str | None) -> dict[str, float]:
    """:data:`UPPER`, and the rates of ``gpu``'s kind at most its datasheet's (:data:`DATASHEET`)."""
    b, f = DATASHEET.get(gpu or "", (math.inf, math.inf))
    rates = {"bandwidth": b, "statistics_bandwidth": b, "strided_bandwidth": b, "matmul_flops": f}
    return {**UPPER, **rates, "unaligned_flops": f}


@dataclasses.dataclass(frozen=True)
class Run:
    """One committed run as the fit reads it."""

    path: str  # relative to the checkout
    recipe: str
    model: str
    mode: str  # eager | fast (compiled blocks) | graphs (compiled blocks + CUDA graphs)
    config: dict[str, Any]
    measured_s: float  # the run's median step time
    intervals: int  # timed step intervals the median is over

    @property
    def group(self) -> str:
        """The configuration: runs that repeat it are one point of the fit."""
        c = self.config
        keys = ("precision", "batch_size", "accumulation_steps", "seq_len", "optimizer")
        keys += tuple(k for t in techniques.flagged() for k in (t.field, *(o.field for o in t.options)))
        text = self.model.startswith("hf:")  # a vision model's config has the runner's default seq_len too
        flags = " ".join(
            f"{k}={c.get(k)}" for k in keys if c.get(k) not in (None, False) and (text or k != "seq_len")
        )
        return f"{self.model} {self.mode} {self.recipe} {flags}"

    @property
    def offload(self) -> bool:
        return bool(self.config.get("activation_offload")) or self.recipe in OFFLOAD_RUNGS

    @property
    def not_fitted(self) -> str | None:
        optimizer = self.config.get("optimizer") or (
            declared_rung(self.recipe)[0].optimizer if self.recipe != "your_model" else None
        )
        return NOT_FITTED.get(optimizer)


def run_mode(config: dict[str, Any]) -> str:
    return "graphs" if config.get("cuda_graphs") else ("fast" if config.get("compile") else "eager")


def read_runs(gpu: str = "h100", repo: Path = REPO) -> list[Run]:
    """The successful single-GPU runs of ``gpu`` that :data:`RUN_GLOBS` names."""
    runs = []
    for pattern in RUN_GLOBS.get(gpu, ()):
        for path, d in results_of(pattern, repo):
            timing, prov = d.get("timing") or {}, d.get("provenance") or {}
            if d.get("status") != "ok" or not timing.get("median_step_s") or prov.get("world_size", 1) != 1:
                continue
            if gpu_slug(prov.get("gpu_name")) != gpu or d["recipe"] == "16_weights_on_cpu":
                continue
            config, seconds = d["config"], timing["median_step_s"]
            if ((d.get("extra") or {}).get("cuda_graphs") or {}).get("not_captured"):  # ran without its graph
                config = {**config, "cuda_graphs": False}
            intervals = timing.get("timed_intervals") or 1
            runs.append(Run(path, d["recipe"], config["model"], run_mode(config), config, seconds, intervals))
    return runs


def run_costs(run: Run) -> step_time.StepCosts:
    """Simulate ``run``'s configuration and return its costs."""
    config = run.config
    if run.recipe == "your_model":
        rung = runner.default_config()
        flags = {f.name for f in type(rung).flag_fields()}
        cfg = rung.with_flags(**{**{k: v for k, v in config.items() if k in flags}, "accelerator": "cuda"})
        um, model, blocks, _ = meta_user_model(cfg.model)
        seq_len, plan = cfg.seq_len if um.is_text else 0, plan_of(cfg, blocks, um=um)
        return step_time.simulated_costs(model, um, plan, seq_len, getattr(cfg, "target_len", None), blocks)
    rung, _ = declared_rung(run.recipe)
    flags = {f.name for f in RunConfig.flag_fields()}
    cfg = rung.with_flags(**{**{k: v for k, v in config.items() if k in flags}, "accelerator": "cuda"})
    name, size = config.get("model", "vit_l_16"), config.get("image_size")
    model = meta_ladder_model(name, fused_attention=cfg.fused_attention, image_size=size)
    plan, collector = plan_for(cfg), OpCosts({type(b).__name__ for b in ladder_blocks(model)})
    est = simulate(model, plan, op_costs=collector)
    offloaded = (est.activations_host_gb or 0.0) * 1e9 if plan.activation_offload else 0.0
    return step_time.costs_of(collector, plan, offloaded)


def predicted_s(run: Run, costs: step_time.StepCosts, c: step_time.Ceilings) -> float:
    mode = "eager" if run.mode == "eager" else "fast"
    return step_time.step_seconds(costs, c, mode, graphs=run.mode == "graphs")[0]  # fused: costs.compiled


@dataclasses.dataclass
class Point:
    """One configuration: its runs, their median step time, its simulated costs."""

    runs: list[Run]
    costs: step_time.StepCosts

    @property
    def first(self) -> Run:
        return self.runs[0]

    @property
    def measured_s(self) -> float:
        return statistics.median(r.measured_s for r in self.runs)


def points(runs: list[Run], log=print) -> list[Point]:
    """The runs grouped by configuration, each group simulated once."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    out = []
    for name, group in groups.items():
        log(f"simulating {name} ({len(group)} run(s))")
        out.append(Point(group, run_costs(group[0])))
    return out


def fit(
    pts: list[Point], fields: list[str], start: step_time.Ceilings, upper: dict[str, float] = UPPER
) -> step_time.Ceilings:
    """The ceilings named in ``fields`` that minimise the squared log errors of ``pts`` (the others kept
    from ``start``; ``upper`` (:func:`upper_of`) and :data:`LOWER` bound some): the best of four fixed starts."""

    def ceilings_of(x: np.ndarray) -> step_time.Ceilings:
        return dataclasses.replace(start, **{f: math.exp(v) for f, v in zip(fields, x, strict=True)})

    def residuals(x: np.ndarray) -> np.ndarray:
        c = ceilings_of(x)
        return np.array([math.log(predicted_s(p.first, p.costs, c) / p.measured_s) for p in pts])

    upper = np.array([math.log(upper[f]) if f in upper else np.inf for f in fields])
    lower = np.array([math.log(LOWER[f]) if f in LOWER else -np.inf for f in fields])
    x0 = np.clip(np.log([getattr(start, f) for f in fields]), lower + 1e-9, upper - 1e-9)
    best = None
    for seed in range(4):
        jitter = np.random.RandomState(seed).randn(len(fields)) * 0.7 if seed else 0.0
        x = np.clip(x0 + jitter, lower + 1e-9, upper - 1e-9)
        result = least_squares(residuals, x, bounds=(lower, upper), method="trf")
        if best is None or result.cost < best.cost:
            best = result
    return ceilings_of(best.x)


def calibrate(
    pts: list[Point], leave_one_out: bool = False, log=print, gpu: str | None = None
) -> dict[str, Any]:
    """Fit the ceilings on ``pts`` (``gpu``'s kind: :func:`upper_of`); the stored table's entry of one GPU kind."""
    upper = upper_of(gpu)
    core = [p for p in pts if not p.first.offload and not p.first.not_fitted]
    offload = [p for p in pts if p.first.offload and not p.first.not_fitted]
    fields = [f for f in FIELDS if f not in OFFLOAD_FIELDS]
    c = fit(core, fields, start_of(gpu), upper)
    if offload:
        c = fit(offload, OFFLOAD_FIELDS, c)
    held_out: dict[str, float] = {}
    if leave_one_out:
        for model in sorted({p.first.model for p in core}):
            log(f"leaving {model} out")
            rest = fit([p for p in core if p.first.model != model], fields, start_of(gpu), upper)
            rest = dataclasses.replace(rest, host_bandwidth=c.host_bandwidth)
            held_out |= {p.first.group: _error(p, rest) for p in core if p.first.model == model}
    rows = []
    for p in sorted(pts, key=lambda p: p.first.group):
        r = p.first
        why = r.not_fitted or None
        rows.append(
            {
                "configuration": r.group,
                "model": r.model,
                "mode": r.mode,
                "recipe": r.recipe,
                "paths": [x.path for x in p.runs],
                "timed_intervals": [x.intervals for x in p.runs],
                "measured_s": p.measured_s,
                "predicted_s": round(predicted_s(r, p.costs, c), 6),
                "error": round(_error(p, c), 4),
                "fitted": why is None,
                "fitted_for": None if why else ("host_bandwidth" if r.offload else "all but host_bandwidth"),
                "not_fitted_because": why,
                "leave_one_model_out_error": held_out.get(r.group),
            }
        )
    return {"ceilings": c.to_dict(), "runs": rows, "summary": summary(rows)}


def _error(p: Point, c: step_time.Ceilings) -> float:
    """Predicted samples/s over measured, less 1 (+: predicted faster than measured)."""
    return p.measured_s / predicted_s(p.first, p.costs, c) - 1.0


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Max and median |error| and how many within 25 %: of the configurations every ceiling but B_host is
    fitted on, of those held out one model at a time (when computed), and of the offload runs."""
    out: dict[str, Any] = {}
    core = [r for r in rows if r["fitted"] and r["fitted_for"] != "host_bandwidth"]
    for key, sel in (
        ("fitted", [r["error"] for r in core]),
        (
            "leave_one_model_out",
            [r["leave_one_model_out_error"] for r in core if r["leave_one_model_out_error"] is not None],
        ),
        ("activation_offload", [r["error"] for r in rows if r["fitted_for"] == "host_bandwidth"]),
    ):
        if sel:
            errors = [abs(e) for e in sel]
            out[key] = {
                "configurations": len(errors),
                "max_abs_error": round(max(errors), 4),
                "median_abs_error": round(statistics.median(errors), 4),
                "within_25_percent": sum(e <= 0.25 for e in errors),
            }
    return out


def table_lines(entry: dict[str, Any]) -> list[str]:
    lines = [f"{'configuration':<100} {'measured s':>10} {'predicted s':>11} {'error':>7} {'held out':>8}"]
    for r in entry["runs"]:
        lines.append(
            f"{r['configuration'][:100]:<100} {r['measured_s']:>10.4f} {r['predicted_s']:>11.4f}"
            f" {r['error']:>+7.0%} {_held_out(r):>8}" + (f"  {_why(r, '()')}" if _why(r, "()") else "")
        )
    for key, s in entry["summary"].items():
        lines.append(
            f"{key}: {s['configurations']} configurations, max |error| {s['max_abs_error']:.0%},"
            f" median {s['median_abs_error']:.0%}, within 25 %: {s['within_25_percent']}"
        )
    return lines


# How a configuration is shortened; a flagged technique not named here, to its flag (fused_loss=True: fused-loss).
SHORT = (
    ("hf:examples/configs/", ""), ("your_model ", ""), ("precision=", ""), ("batch_size=", "b"),
    (" accumulation_steps=", "/k"), ("seq_len=", "s"), ("optimizer=", ""), ("checkpoint_blocks=True", "ckpt"),
    (" checkpoint_mode=full", ""), ("checkpoint_mode=", "ckpt-"), ("activation_offload=True", "offload"),
    ("optimizer_in_backward=True", "step-in-backward"),
)  # fmt: skip


def notes_lines(entry: dict[str, Any]) -> list[str]:
    """The stored table as step_time.py's docstring shows it: one short line per configuration."""
    lines = ["measured predicted  error held out  configuration (step s; error: samples/s)"]
    for r in entry["runs"]:
        name = r["configuration"]
        for old, new in (*SHORT, *((f"{t.field}=True", t.flag[2:]) for t in techniques.flagged())):
            name = name.replace(old, new)
        tag = _why(r, "[]")
        lines.append(
            f"{r['measured_s']:8.4f} {r['predicted_s']:9.4f} {r['error']:+6.0%}  {_held_out(r):>8}  {name}"
            + (f" {tag}" if tag else "")
        )
    return lines


def _held_out(row: dict[str, Any]) -> str:
    return (
        "" if row["leave_one_model_out_error"] is None else format(row["leave_one_model_out_error"], "+.0%")
    )


def _why(row: dict[str, Any], brackets: str) -> str:
    """Why a row was not fitted as the others, in ``brackets`` ("" if it was)."""
    why = "not fitted" if not row["fitted"] else ("B_host" if row["fitted_for"] == "host_bandwidth" else "")
    return f"{brackets[0]}{why}{brackets[1]}" if why else ""


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100", choices=sorted(RUN_GLOBS), help="the kind whose runs to fit")
    parser.add_argument(
        "--write", action="store_true", help=f"store the table in {step_time.CALIBRATION_FILE}"
    )
    parser.add_argument(
        "--leave-one-out", action="store_true", help="also fit without each model, and predict it"
    )
    args = parser.parse_args(argv)
    runs = read_runs(args.gpu)
    if not runs:
        fail(f"no committed {args.gpu} runs under {REPO / 'results'}: the calibration runs from a checkout")
    pts = points(runs)
    entry = calibrate(pts, args.leave_one_out, gpu=args.gpu)
    print("\n".join(table_lines(entry)))
    print(
        "ceilings: "
        + ", ".join(f"{k}={v}" for k, v in step_time.Ceilings(**entry["ceilings"]).shown().items())
    )
    if args.write:
        table = step_time.load_calibration()
        table = {
            "what": "the step-time model's ceilings per GPU kind (planning/your_model/step_time.py), fitted on"
            " the committed runs listed with each kind, with their errors (error: predicted samples/s over"
            " measured, less 1)",
            "how": "python -m fabric_memory_recipes.planning.your_model.step_calibration"
            " --write --leave-one-out",
            "kinds": {**table.get("kinds", {}), args.gpu: entry},
        }
        write_json_atomic(str(step_time.CALIBRATION_FILE), table)
        print(f"wrote {step_time.CALIBRATION_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How fast a technique set for your own model is predicted to train, which ``--fit``'s search ranks the
sets by (planning/your_model/sets.py): its simulated step's op costs on the GPU kind's fitted ceilings
(planning/your_model/step_time.py), plus what FSDP's CPU offload adds, and before a set is simulated the
bound its search starts from.

FSDP's CPU offload (``--fsdp --cpu-offload``, a ``--fit --devices N`` set) adds to a step's time what the
simulated step's op costs cannot show: each GPU's fp32 shard of the parameters lives in host memory with its
gradient, and the optimizer steps there. Per optimizer step each shard crosses PCIe three times (copied in
for the forward's and the backward's all-gather, the gradient copied out) and the CPU optimizer reads
parameter, gradient and state and writes parameter and state. The processes of one host share its memory
and its cores, so the step's time follows the bytes of all the shards together (the whole model), not one
GPU's: rung 09_cpu_offload (FSDP2) added the same time to rung 08_fsdp2's step on 2 GPUs as on 4 (the pairs
below). The host's rate is what those pairs measured; FSDP1 (eager mode's sharding) offloads slower, at the
rate that your model's FSDP1 runs with and without ``--cpu-offload`` measured in one call.

FSDP's collectives (every ``--devices N`` set) are priced by what they leave exposed, the time a step waits
for them with no compute running: each micro-batch gathers the parameters twice in the compute dtype (its
forward, and its backward after the forward resharded them; a checkpointed block recomputes inside the
backward's gather: FSDP1 and FSDP2 skip their forward hooks in a recompute), and each optimizer step
reduce-scatters the gradients once, in the compute dtype (the runner accumulates without syncing but the last
micro-batch: training/step.py's ``fabric.no_backward_sync``, FSDP2's ``set_requires_gradient_sync(False)``
and FSDP1's ``no_sync()`` under Lightning). The bandwidth and the exposed share are those of the 4 x H200
profile of rung 08_fsdp2 (``results/published/h200x4/sharded-spread/call3/profile_summary.md``: ViT-L/16 in
fp32, 303.3 M parameters, one micro-batch; 49.0 ms of all-gather kernels for the 2 x 0.910 GB a rank
received, 37 GB/s, 25.3 ms of them with no compute kernel running; 7.9 ms of reduce-scatter for 0.910 GB,
1.2 ms exposed), one configuration: the share a step hides depends on its compute, which these constants do
not follow.

Each function takes the :class:`~.sets.UserPlanner` whose sets it predicts.
"""

from __future__ import annotations

from typing import Any

from fabric_memory_recipes.planning.plan import OPTIMIZER_STATE_FACTOR, Plan
from fabric_memory_recipes.planning.simulation.costs import OpCosts
from fabric_memory_recipes.planning.simulation.modelled import Precision
from fabric_memory_recipes.planning.your_model import step_time
from fabric_memory_recipes.planning.your_model.choice import Choice
from fabric_memory_recipes.techniques import ACTIVATION_CHECKPOINTING, ACTIVATION_OFFLOAD, FUSED_LOSS
from fabric_memory_recipes.training.techniques import fused_loss
from fabric_memory_recipes.training.your_model.sharding import fully_sharded

# rung 09_cpu_offload's step less rung 08_fsdp2's, the same call and repeat, after the host's cores were shared
# out (host_threads recorded): results/published/h200x2/sharded-spread/call1/x2/r{1,2,3}/ (111.8, 113.0,
# 93.6 ms) and results/published/h200x4/sharded-spread/call{5,6}/x4/r{1,2}/ (126.4, 104.5, 95.4, 291.5 ms)
RUNG09_OFFLOAD_S = 111.8e-3  # the median of those 7 pairs (ViT-L/16, fp32 AdamW, 2 and 4 GPUs)
_VIT_L16 = 303_311_882  # its parameters (the runs' provenance)
# per fp32 parameter of the whole model, the host moves: 3 PCIe copies; AdamW reads p, g, m, v, writes p, m, v
ADAMW_HOST_PASSES = 3 + 3 + 2 * 2
FSDP2_HOST_GBPS = (
    ADAMW_HOST_PASSES * 4 * _VIT_L16 / 1e9 / RUNG09_OFFLOAD_S
)  # 108.5 GB/s for the host's processes
# FSDP1: your model (GPT-NeoX 1.4 B, bf16-mixed AdamW, 2 x H200, eager, 8 x 1): --cpu-offload's steps 1060.2
# and 1128.2 ms against 270.8 ms without, one call (results/published/h200x2/your-model-sharded-traces/)
FSDP1_OFFLOAD_S = (1060.2e-3 + 1128.2e-3) / 2 - 270.8e-3
FSDP1_HOST_GBPS = (
    ADAMW_HOST_PASSES * 4 * 1_414_647_808 / 1e9 / FSDP1_OFFLOAD_S
)  # 68.7 GB/s: set on those two runs
HOST_OFFLOAD_SOURCE = (
    f"FSDP's CPU offload at {FSDP2_HOST_GBPS:.0f} GB/s of host traffic (FSDP2: rung 09_cpu_offload against"
    f" 08_fsdp2 on 2 and 4 H200s), {FSDP1_HOST_GBPS:.0f} GB/s (FSDP1: your model's runs on 2 H200s) per host"
    " (planning/your_model/set_speed.py)"
)

# rung 08_fsdp2's profile (module docstring): the GB a rank receives per gather, kernel bandwidths, exposed shares
_RUNG08_RECEIVED_GB = 303.3e6 * 4 * 3 / 4 / 1e9  # one gather of 4 ranks' fp32 shards: 0.910 GB
GATHER_GBPS = 2 * _RUNG08_RECEIVED_GB / 49.0e-3  # 37.1 GB/s: two gathers in its one micro-batch
GATHER_EXPOSED = 25.3 / 49.0  # the share of the gathers' kernel time with no compute running
REDUCE_GBPS = _RUNG08_RECEIVED_GB / 7.9e-3  # 115 GB/s
REDUCE_EXPOSED = 1.2 / 7.9
GATHER_EXPOSED_S_PER_GB = GATHER_EXPOSED / GATHER_GBPS
REDUCE_EXPOSED_S_PER_GB = REDUCE_EXPOSED / REDUCE_GBPS
COLLECTIVES_SOURCE = (
    f"FSDP's gathers and reduce-scatters at {GATHER_GBPS:.0f} and {REDUCE_GBPS:.0f} GB/s,"
    f" {100 * GATHER_EXPOSED:.0f} % and {100 * REDUCE_EXPOSED:.0f} % of them exposed, as rung 08_fsdp2's"
    " 4 x H200 profile measured (planning/your_model/set_speed.py)"
)


def collective_seconds(
    parameters: int,
    trainable: int,
    devices: int,
    precision: str,
    micro_batches: int,
    gather_gbps: float = GATHER_GBPS,
    reduce_gbps: float = REDUCE_GBPS,
) -> float:
    """Seconds per optimizer step that FSDP's collectives leave exposed on ``devices`` GPUs: two gathers of
    the parameters in the compute dtype per micro-batch, one reduce-scatter of the trainable ones' gradients
    per step (the bytes each rank receives, (N - 1) / N of the whole, at the kernels' bandwidths, of which
    rung 08_fsdp2's exposed shares)."""
    if devices <= 1:
        return 0.0
    width = Precision(precision, False, "fsdp").param_dtype.itemsize  # what FSDP gathers and reduces in
    share = width * (devices - 1) / devices / 1e9  # GB a rank receives per parameter
    gathers = micro_batches * 2 * parameters * share * GATHER_EXPOSED / gather_gbps
    return gathers + trainable * share * REDUCE_EXPOSED / reduce_gbps


def offload_seconds(trainable: int, devices: int, optimizer: str, fsdp2: bool = True) -> float:
    """Seconds one optimizer step of FSDP's CPU offload adds: the copies of every process's fp32 shard (in
    twice, the gradient out once) and its CPU optimizer step (parameter, gradient and state read, parameter
    and state written), all ``devices`` processes on one host at the host's measured rate (FSDP2's, or
    FSDP1's with ``fsdp2=False``)."""
    shard = 4.0 * trainable / devices  # fp32 bytes of one process's shard
    state = OPTIMIZER_STATE_FACTOR.get(optimizer, 2)
    host = devices * (3 + 3 + 2 * state) * shard  # bytes the host moves for all its processes
    return host / ((FSDP2_HOST_GBPS if fsdp2 else FSDP1_HOST_GBPS) * 1e9)


def _compiled_calls(planner: Any, c: Choice) -> float:
    """The compiled-region calls a micro-batch of set ``c`` makes in fast mode (step_time.fast_calls)."""
    return step_time.fast_calls(planner.model, planner.blocks, c.techniques.uses(ACTIVATION_CHECKPOINTING))


def step_speed(planner: Any, c: Choice, collector: OpCosts) -> float:
    """samples/s from the simulated step's op costs on the GPU kind's fitted ceilings
    (planning/your_model/step_time.py); the set's own accumulation (the simulation ran two of its
    micro-batches: later ones repeat the second)."""
    r = c.rung
    plan = Plan(
        accumulation_steps=r.accumulation_steps, activation_offload=c.techniques.uses(ACTIVATION_OFFLOAD)
    )
    costs = step_time.costs_of(collector, plan, (c.offloaded_gb or 0.0) * 1e9, _compiled_calls(planner, c))
    graphs = step_time.uses_graphs(c, planner.um)  # the runner's fast mode
    seconds, detail = step_time.step_seconds(costs, planner.ceilings, c.mode, graphs, planner.compiled)
    c.model_flops = detail["model_flops_per_step"] / r.batch_size
    c.speed_source = f"model: the simulated step's op costs ({planner.ceilings_source})"
    c.speed_source += f"; {COLLECTIVES_SOURCE}" if c.devices > 1 else ""
    c.speed_source += f"; {HOST_OFFLOAD_SOURCE}" if c.cpu_offload else ""
    offload_s = (
        offload_seconds(
            planner.parameters,
            c.devices,
            c.techniques.optimizer,
            fully_sharded(c.mode == "fast", r.precision),
        )
        if c.cpu_offload
        else 0.0
    )
    comms_s = collective_seconds(
        planner.parameters, planner.trainable, c.devices, r.precision, r.accumulation_steps
    )
    return c.devices * r.batch_size / (seconds + offload_s + comms_s)  # every GPU its own batch


def optimistic(planner: Any, p: Choice) -> float:
    """samples/s no prediction of plain set ``p`` (nor of a set it bounds) is above: its prediction once it
    is simulated, and before, the floor of its step (step_time.floor_step_seconds) scaled from the same
    set's at the whole batch (one micro-batch)."""
    if p.predicted_gb is not None:
        return p.images_per_s
    r = p.rung
    whole = planner.plains[
        (r.precision, p.techniques.optimizer, p.mode, p.devices, p.switched, r.batch_size, 1)
    ]
    planner.predict(whole)
    simulated = planner.simulation_of(whole)  # in fast mode, its compiled blocks' where eager fell back
    if whole is p or simulated is None:  # nothing to scale: predict it
        return planner.predict(p).images_per_s
    costs = step_time.costs_of(simulated[3], Plan(), compiled_calls=_compiled_calls(planner, p))
    graphs = step_time.uses_graphs(p, planner.um)  # as step_speed
    seconds = step_time.floor_step_seconds(
        costs,
        planner.ceilings,
        p.mode,
        graphs,
        planner.compiled,
        r.micro_batch_size / r.batch_size,
        r.accumulation_steps,
        *ops_kept(planner, p),
    )
    return p.devices * r.batch_size / seconds


def ops_kept(planner: Any, p: Choice) -> tuple[float, float]:
    """How often plain set ``p``'s micro-batch runs each op of the whole batch's step at least, as the floor
    of its step counts them (step_time.floor_step_seconds): every op, and besides an op without FLOPs. Most
    ops run once a micro-batch whatever its size, but the fused loss walks the tokens in chunks whose number
    follows the tokens where they are few (fused_loss.chunk_count; never fewer than micro-batch / batch of the
    whole batch's), and at micro-batch 1 an op without FLOPs may not run at all (a copy of a tensor that a
    batch of one leaves contiguous, a sum of a gradient over a batch of one): those count micro-batch / batch."""
    r = p.rung
    scale = r.micro_batch_size / r.batch_size
    kept = 1.0
    if FUSED_LOSS.name in p.switched:
        head = planner.model.get_output_embeddings()
        target = (planner.target_len or planner.seq_len) if planner.um.task == "seq2seq_lm" else None
        per_sample = target or (planner.seq_len or 0) - 1  # a causal LM's loss: every token but the first
        vocab, hidden = head.weight.shape
        whole = fused_loss.chunk_count(r.batch_size * per_sample, vocab, hidden)
        kept = min(1.0, fused_loss.chunk_count(r.micro_batch_size * per_sample, vocab, hidden) / whole)
    return kept, scale if r.micro_batch_size == 1 else 1.0


def lines(planner: Any, verbose: bool = False) -> list[str]:
    """How samples/s were predicted: two lines, or with ``verbose`` every constant and its source."""
    summary = step_time.load_calibration()["kinds"].get(planner.gpu, {}).get("summary", {})
    held = summary.get("leave_one_model_out") or {}
    out = [
        "samples/s: predicted, not measured (--measure runs them): each set's simulated step, op by op (FLOPs and"
        " bytes against the GPU kind's fitted ceilings, and the host's time: in eager mode to launch them, in"
        " fast mode without CUDA graphs to call its compiled blocks;"
        f" planning/your_model/step_time.py), {planner.ceilings_source}"
        + (
            f"; each model left out of the fit, the error was {100 * held['median_abs_error']:.0f} % (median),"
            f" {100 * held['max_abs_error']:.0f} % at most"
            if held
            else ""
        )
        + ("." if verbose else " (--verbose: the ceilings)."),
    ]
    if planner.devices > 1:
        out.append(
            f"  FSDP over {planner.devices} GPUs: {planner.devices} x one GPU's samples/s (each its own batch),"
            " each step longer by its gathers (two per micro-batch) and its reduce-scatter (one per step),"
            f" at {GATHER_GBPS:.0f} and {REDUCE_GBPS:.0f} GB/s with the share one profiled rung left exposed"
            " (what your model's compute hides: that rung's share, an assumption), and with --cpu-offload"
            " by its copies and CPU optimizer at the host's measured rate. Outside the"
            " allocator each GPU holds NCCL's buffers besides its context: for a small model the card"
            " per GPU can be above what one GPU alone needs (leave out --devices to compare)."
        )
    if verbose:
        out += [f"  {name}: {value}" for name, value in planner.ceilings.shown().items()]
    return out

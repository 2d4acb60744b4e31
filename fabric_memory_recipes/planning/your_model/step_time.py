"""The time of one training step, predicted from the simulated step itself: :func:`predict_step_s`, and
the model FLOPs utilisation it means (:func:`mfu`).

The simulation (planning/simulation/simulate.py) runs the step on fake tensors; its op-cost collector
(planning/simulation/costs.py) records each op of the forward and backward passes, checkpointing's
recompute included: its FLOPs, the bytes it reads and writes, whether it is tensor-core work (matmul,
convolution, fused attention), whether it launches a kernel, and which pass issued it; and the module
calls. On a GPU kind's calibrated ceilings (:class:`Ceilings`, in micro_batch_time.py) each op takes

    on the GPU   d = max(FLOPs / F, bytes / B) + g        a matmul-like op (fp32: F x TF32_RATIO; F_odd for
                                                          a matrix product on unaligned operands; a half-
                                                          precision one on a kind with measured products:
                                                          F x its shape's share of their best, gemm_rates.py)
                 d = bytes / B + g                        any other op with a kernel (B_str for one on
                                                          strided tensors; BatchNorm in training adds its
                                                          statistics pass: its reads / B_stat + g)
                 fast mode: the second kind x phi         inside the compiled blocks (they fuse the pointwise
                                                          ops; the loss, the embedding run as in eager mode)
                 CUDA graphs: g_graph for g               (the GPU starts a graph's kernels back to back)
    on the host  h = L_py (+ L_mod x module calls / Python ops)   eager, an op Python issues (forward, recompute)
                 h = L_ag                                 eager, an op autograd or autocast issues
                 h = L_call x calls / kernels             fast mode: the micro-batch's compiled-region calls
                                                          (fast_calls) over its ops, by their kernels
                 h = 0                                    fast mode with CUDA graphs (vision models, causal LMs)

and a recomputed block costs the host C more in eager mode (checkpoint's saved-tensor hooks in Python).
The host issues ops one after another and the GPU runs them in order, each when issued and when the one
before is done, so a micro-batch takes max over ops i of (host time until op i is issued + GPU time of
ops i..n): launch-bound where the host is slower, GPU-bound where it is faster. A step is the first
micro-batch, k - 1 times a later one (the gradients accumulate: the simulation's second micro-batch),
and the optimizer step, which reads the weights, gradients and state and writes the weights and state:
(2 x (weights + state) + gradients) / B. The step in backward (not under CUDA graphs) issues each
parameter's update from the backward pass instead: H per parameter tensor on the host joins that pass's
queue, spread over its ops by their kernels (a GPU-bound pass hides the hooks; the updates' GPU time stays
after the pass, so the step never predicts faster than without it). Activation offload adds 2 x offloaded
bytes / B_host per micro-batch.

The ceilings of a GPU kind are fitted on its committed runs and stored with them and their errors in
``fabric_memory_recipes/data/step_time.json`` (planning/your_model/step_calibration.py, which says how).

Why this form. The plainest one, sum over ops of max(FLOPs / F, bytes / B) plus kernels x one L per mode,
fitted on the same runs, misses 16 of the 45 configurations by more than 25 % (median 19 %, max 118 %,
F above the datasheet peak). Eager host time is most of these runs' step: an op Python issues costs the
host ~60 us here, one autograd's engine or autocast issues ~10 us, each module call ~70 us, and it
overlaps the GPU's work only as far as the queue allows (ViT-L/16 at micro-batch 4 is host-bound, at 64
half hidden); checkpointing costs eager mode more than its recompute's ops. Each term above is one of those.
Three kernel terms came from where an H200 profile's kernels fell short of F and B (results/published/h200/
your-model-speed/vision-graph-profile/NOTES.md): BatchNorm's channels-last statistics kernel read at 0.23-0.72
TB/s (41 % of ResNet-50's graphed step was BatchNorm), elementwise kernels on permuted or sliced tensors compute
each element's offset (a fifth of Swin-V2-T's memory-bound bytes), and GPT-2 small's 50257-token vocabulary ran
its fused loss's products at about 105 TFLOP/s, its other linear layers at 600 and more. With them the h200 kind's
fitted median fell from 15 % to 8 % and g_graph from 6.5 to 3.0 us (the profiled gaps between a graph's kernels:
0.6-0.8 us); held out, it rose from 18 % to 22 % (max 103 %: Swin-V2-T, the one model whose strided bytes set B_str).
On five models no fit had seen (results/published/h200/ranking-check/NOTES.md, "Models no fit has seen") the picks
came out -8 to +22 % for EfficientNet-B0, DenseNet-121 and ConvNeXt-T (their 9 sets: median 9 %, 11 % before the
terms), +66 % for RegNetY-1.6GF (grouped convolutions at F) and -47 % for TinyLlama 1.1 B (big matmuls above F,
and its step in backward's hooks added after the passes: with them in the backward pass's queue and the fit again
without these models, -31 %; devtools/speed/held_out_fit.py). Fitted with these runs too (68 configurations), the
h200 kind's median is 10 % (max 59 %, 55 within 25 %), held out one model at a time 20 % (max 74 %).
With each half-precision matrix product's rate read from its shape (measurement/gemm_rates.py: F times its share of
the best rate an H200 measured; GPT-2 small's [8192, 768] x [768, 768] ran at 578 TFLOP/s, Phi-1.5's MLP products at
803) and the runs since (89 configurations), the h200 kind's fitted median is 14 % (one F: 13 %), held out one model
at a time 20 % (one F: 21 %, max 108 % against 113 %); its gain is out of sample: the unseen families' 18
configurations 19 % (21 %), 13 within 25 % (11), and GPT-NeoX 1.4 B, in no fit, -10, -5 and -21 % on its three sets
(one F: -20, -16, -31 %; docs/your_model.md, "Matrix products by shape").

Accuracy on h100, as stored (tests/planning/your_model/test_step_time.py checks this copy against the table): 45
configurations of 8 models (ResNet-50, ConvNeXt-T, timm ViT-B/16, torchvision ViT-L/16; BERT-base,
Qwen2-0.5B, GPT-NeoX 0.4B, Llama 0.36B; 54 runs) fit every ceiling but B_host, each rate within the H100
SXM's datasheet (3.35 TB/s, 989 TFLOP/s; free, B went to 5.7 TB/s against fusion and g_graph, held-out median
15 %, max 75 %): median |error| 10 %, max 52 %, 44 within 25 %. Refitted without each model in turn and
predicting it: median 19 %, max 69 %, 29 within 25 % (ViT-L/16 held out does worst: the other models hold no
CUDA-graph run). The misses, honestly:
* ResNet-50 bf16-true SGD at batch 64, +52 %: measured 0.058 s over one timed interval (the your-model
  runs at 80 GB time one step each), slower than the same set at batch 128 (0.034 s, four intervals);
  most likely the measurement. Every your-model run at 80 GB is one interval: their noise is in the fit.
* CUDA-graph fast mode (a vision model in fast mode) is measured on ViT-L/16 only: held out, its runs are
  predicted 69 % too slow to 42 % too fast (no other run is a graph's: g_graph stays at its start). ViT-L/16
  fp32 +14 % (TF32 slower than half the bf16 rate there).
* Fast mode without graphs (causal LMs) rests on two models of one set (fused loss + checkpointing):
  held out, Llama -8 %, GPT-NeoX +6 %. Its host term is L_call per compiled-region call (fast_calls), not
  per op: T5-small's fast step on an H200 makes 60 calls and 1472 launches against Llama's 96 and 2832,
  and takes as long (results/published/h200/encdec-step-profile/lm-sweep/NOTES.md); per op, the
  encoder-decoders' fast steps were predicted 1.6-3.1x too fast, per call 1.2-1.9x (those H200 rows,
  h100's ceilings: the host there is another).
* Activation offload: one B_host cannot fit both the runner's eager offload (ViT-B/16, +178 %: it waits
  for its copies) and the ladder's side-stream copies under CUDA graphs (-61 %); 3 of 5 within 25 %.
* 8-bit AdamW is not fitted: ViT-L/16 rung 13 eager takes 2.1x the prediction (its per-tensor
  quantisation on the host), graphs +17 %.
* Not measured, so not modelled: selective checkpointing's dispatch mode in eager mode (every op of a
  checkpointed block through Python), FSDP's communication. A GPU kind without runs takes h100's; h200 has
  its own (docs/your_model.md, "An h200 kind").

    measured predicted  error held out  configuration (step s; error: samples/s)
      0.1579    0.1412   +12%      +13%  bert-base-uncased eager 32-true b16/k4 s512 adamw
      0.0780    0.0772    +1%       +1%  bert-base-uncased eager bf16-mixed b16/k1 s512 adamw ckpt
      0.0379    0.0383    -1%       -0%  bert-base-uncased eager bf16-true b16/k1 s512 adamw
      0.1933    0.1732   +12%      +15%  gpt-neox-0.4b eager bf16-mixed b8/k1 s1024 adamw ckpt fused-loss
      0.6723    0.5694   +18%      +22%  gpt-neox-0.4b eager bf16-mixed b8/k4 s1024 adamw ckpt
      0.1025    0.0996    +3%       +6%  gpt-neox-0.4b fast bf16-mixed b8/k1 s1024 adamw ckpt fused-loss
      0.1294    0.1336    -3%       -8%  llama-0.36b fast bf16-mixed b8/k1 s1024 adamw ckpt fused-loss
      1.5616    1.7364   -10%      -14%  qwen2-0.5b eager bf16-mixed b8/k8 s512 adamw ckpt
      0.1520    0.1264   +20%      +28%  qwen2-0.5b eager bf16-true b2/k1 s512 sgd step-in-backward
      0.3709    0.4050    -8%      -13%  qwen2-0.5b eager bf16-true b8/k2 s512 adamw ckpt
      0.4172    0.4073    +2%       +3%  qwen2-0.5b eager bf16-true b8/k4 s512 adamw
      0.1235    0.1424   -13%      -11%  timm:convnext_tiny eager 32-true b64/k4 adamw
      0.0552    0.0458   +20%      +23%  timm:convnext_tiny eager bf16-mixed b64/k1 adamw
      0.0644    0.0569   +13%      +17%  timm:convnext_tiny eager bf16-true b64/k1 adamw ckpt
      0.0327    0.0402   -19%      -20%  timm:vit_base_patch16_224 eager bf16-mixed b32/k1 adamw
      0.0702    0.0612   +15%      +15%  timm:vit_base_patch16_224 eager bf16-true b32/k1 adamw ckpt
      0.7167    0.2578  +178%            timm:vit_base_patch16_224 eager bf16-true b32/k2 adamw offload [B_host]
      0.0863    0.0917    -6%      -59%  torchvision:resnet50 eager 32-true b128/k1 sgd ckpt step-in-backward
      0.0582    0.0714   -18%      -49%  torchvision:resnet50 eager 32-true b64/k1 adamw ckpt
      0.1057    0.0915   +16%      -15%  torchvision:resnet50 eager bf16-mixed b128/k1 sgd ckpt step-in-backward
      0.1401    0.1532    -9%      -24%  torchvision:resnet50 eager bf16-mixed b128/k2 adamw ckpt
      0.0432    0.0394   +10%      -27%  torchvision:resnet50 eager bf16-mixed b64/k1 adamw
      0.0338    0.0445   -24%      -60%  torchvision:resnet50 eager bf16-true b128/k1 sgd
      0.1008    0.0856   +18%      -16%  torchvision:resnet50 eager bf16-true b128/k1 sgd ckpt step-in-backward
      0.1069    0.1415   -24%      -38%  torchvision:resnet50 eager bf16-true b128/k2 adamw ckpt
      0.0582    0.0382   +52%       -1%  torchvision:resnet50 eager bf16-true b64/k1 sgd
      0.1959    0.1894    +3%      -17%  vit_l_16 eager 01_baseline 32-true b64/k1
      0.0959    0.1089   -12%      -27%  vit_l_16 eager 02_mixed_precision 16-mixed b64/k1
      0.0789    0.0944   -16%      -20%  vit_l_16 eager 03_true_half_precision bf16-true b64/k1
      0.0701    0.0566   +24%      +19%  vit_l_16 eager 04_lower_batch_size bf16-true b16/k1
      0.1860    0.2005    -7%      -25%  vit_l_16 eager 05_gradient_accumulation bf16-true b16/k4
      0.2122    0.1998    +6%      -14%  vit_l_16 eager 06_sgd_cosine bf16-true b16/k4
      0.1514    0.1998   -24%      -39%  vit_l_16 eager 07_init_module bf16-true b16/k4
      0.4233    0.3860   +10%      +13%  vit_l_16 eager 10_activation_checkpointing bf16-true b16/k4
      0.5358    0.4601   +16%            vit_l_16 eager 11_activation_offload bf16-true b16/k4 [B_host]
      0.0601    0.0750   -20%      -42%  vit_l_16 eager 12_optimizer_in_backward bf16-true b4/k1
      0.4246    0.2002  +112%            vit_l_16 eager 13_lowbit_optimizer bf16-true b16/k4 [not fitted]
      0.1567    0.1261   +24%            vit_l_16 eager 14_memory_floor bf16-true b4/k1 [B_host]
      0.2509    0.2428    +3%      +29%  vit_l_16 eager 15_speed bf16-true b256/k1
      0.1665    0.1456   +14%      +16%  vit_l_16 graphs 01_baseline 32-true b64/k1
      0.0702    0.0772    -9%      -10%  vit_l_16 graphs 02_mixed_precision 16-mixed b64/k1
      0.0630    0.0667    -6%       +2%  vit_l_16 graphs 03_true_half_precision bf16-true b64/k1
      0.0181    0.0177    +2%       -5%  vit_l_16 graphs 04_lower_batch_size bf16-true b16/k1
      0.0333    0.0337    -1%      -68%  vit_l_16 graphs 05_gradient_accumulation bf16-true b16/k4
      0.0320    0.0329    -3%      -69%  vit_l_16 graphs 06_sgd_cosine bf16-true b16/k4
      0.0320    0.0329    -3%      -69%  vit_l_16 graphs 07_init_module bf16-true b16/k4
      0.0402    0.0404    -1%      -69%  vit_l_16 graphs 10_activation_checkpointing bf16-true b16/k4
      0.1113    0.2827   -61%            vit_l_16 graphs 11_activation_offload bf16-true b16/k4 [B_host]
      0.0091    0.0082   +11%      -64%  vit_l_16 graphs 12_optimizer_in_backward bf16-true b4/k1
      0.0389    0.0333   +17%            vit_l_16 graphs 13_lowbit_optimizer bf16-true b16/k4 [not fitted]
      0.0133    0.0140    -5%            vit_l_16 graphs 14_memory_floor bf16-true b4/k1 [B_host]
      0.2123    0.2137    -1%      +42%  vit_l_16 graphs 15_speed bf16-true b256/k1
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fabric_memory_recipes.config import DATA_DIR
from fabric_memory_recipes.measurement.results_file import kinds_table, peak_bf16_flops
from fabric_memory_recipes.planning.plan import Plan
from fabric_memory_recipes.planning.simulation.costs import OpCosts
from fabric_memory_recipes.planning.your_model.estimate import estimate
from fabric_memory_recipes.planning.your_model.micro_batch_time import Ceilings, MicroBatch
from fabric_memory_recipes.techniques import OPTIMIZER_IN_BACKWARD
from fabric_memory_recipes.training.your_model import models
from fabric_memory_recipes.training.your_model.models import UserModel

CALIBRATION_FILE = Path(DATA_DIR) / "step_time.json"
MODES = ("eager", "fast")


@dataclasses.dataclass
class StepCosts:
    """One simulated step's costs, as the time model reads them."""

    micro: list[MicroBatch]  # [the first micro-batch, a later one (with accumulation)]
    accumulation_steps: int
    optimizer: dict[str, Any]  # parameter_bytes, gradient_bytes, state_bytes, tensors, in_backward
    offloaded_bytes: float  # per micro-batch, to host memory and back (activation offload)
    micro_model_flops: list[float]  # as ``micro``: forward and backward, no recompute
    micro_simulated_flops: list[float]  # as ``micro``, recompute included
    compiled: bool = True  # fast mode compiles the blocks (models.compilable, as simulated_costs sets it)

    def per_step(self, values: list[float]) -> float:
        """A per-micro-batch quantity over the step: the first, and k - 1 times a later one."""
        return values[0] + (self.accumulation_steps - 1) * values[-1]

    @property
    def model_flops(self) -> float:
        return self.per_step(self.micro_model_flops)

    @property
    def simulated_flops(self) -> float:
        return self.per_step(self.micro_simulated_flops)

    def with_accumulation(self, k: int) -> StepCosts:
        """The same micro-batches accumulated over ``k`` (a simulation with accumulation has both kinds of
        micro-batch, one without only the first: it serves k = 1 alone)."""
        if k > 1 and len(self.micro) < 2:
            raise ValueError(
                "costs simulated without accumulation have no later micro-batch: simulate k >= 2"
            )
        return dataclasses.replace(self, accumulation_steps=k)


def fast_calls(model: Any, blocks: tuple[str, ...], checkpointed: bool) -> float:
    """The compiled-region calls one micro-batch makes in fast mode without CUDA graphs, as torch.profiler
    counts them: each compiled block's region, its compiled autograd function and its backward (3); an
    encoder-decoder's checkpointed block, compiled inside its wrapper (training/your_model/models.py
    ``compile_repeated``), enters the region again for the recompute (5). Every profiled row agrees
    (results/published/h200/encdec-step-profile/lm-sweep/NOTES.md)."""
    n = sum(type(m).__name__ in blocks for m in model.modules())
    again = checkpointed and getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return float(n * (5 if again else 3))


def costs_of(
    collector: OpCosts, plan: Plan, offloaded_bytes: float = 0.0, compiled_calls: float = 0.0
) -> StepCosts:
    """The costs ``collector`` recorded in a simulation of ``plan`` (``offloaded_bytes``: the estimate's
    ``activations_host_gb`` x 1e9 with activation offload; ``compiled_calls``: :func:`fast_calls`)."""
    sections = [0, 1] if plan.accumulation_steps > 1 else [0]
    micro = [MicroBatch.of(collector.of(s), collector.module_calls(s), compiled_calls) for s in sections]
    model = [collector.model_flops(s) for s in sections]
    simulated = [float(sum(o.flops for o in collector.of(s))) for s in sections]
    return StepCosts(
        micro, plan.accumulation_steps, dict(collector.optimizer), offloaded_bytes, model, simulated
    )


def simulated_costs(
    model: Any,
    um: UserModel,
    plan: Plan,
    seq_len: int,
    target_len: int | None = None,
    blocks: tuple[str, ...] = (),
) -> StepCosts:
    """Simulate one step of ``model`` under ``plan`` (planning/your_model/estimate.py's step: the batch of
    the model's task, an encoder-decoder's ``target_len`` target tokens, the fused loss when the plan has
    it) and return its costs (``blocks``: the repeated blocks fast mode compiles)."""
    collector = OpCosts(blocks)
    est = estimate(model, um, plan, seq_len, op_costs=collector, target_len=target_len)
    if est.error:
        raise RuntimeError(est.error)
    offloaded = (est.activations_host_gb or 0.0) * 1e9 if plan.activation_offload else 0.0
    calls = fast_calls(model, blocks, bool(plan.activation_checkpointing))
    # fast mode fuses nothing where the runner compiles no block (BatchNorm; Swin-V2-T's 12 graphs)
    return dataclasses.replace(
        costs_of(collector, plan, offloaded, calls), compiled=bool(models.compilable(model, blocks))
    )


def step_seconds(
    costs: StepCosts, c: Ceilings, mode: str = "eager", graphs: bool = False, fused: bool | None = None
) -> tuple[float, dict]:
    """(seconds, how they add up) of the step ``costs`` describes, in ``mode`` (eager | fast; ``graphs``:
    fast mode with CUDA graphs, as your model's runner does for a vision model; ``fused``: fast mode compiled
    the blocks, which your model's runner does not for blocks holding BatchNorm: their fast mode is the CUDA
    graphs alone, no op fused; None: ``costs.compiled``)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    fused = costs.compiled if fused is None else fused
    graphs = graphs and mode == "fast"
    per_micro = [m.seconds(c, mode, graphs, fused) for m in costs.micro]
    k = costs.accumulation_steps
    passes = costs.per_step(per_micro)
    opt = costs.optimizer
    optimizer = (2 * (opt["parameter_bytes"] + opt["state_bytes"]) + opt["gradient_bytes"]) / c.bandwidth
    hooks = opt["tensors"] * c.hook_s if opt.get("in_backward") and not graphs else 0.0
    if hooks and k == 1:  # the step in backward: its hooks in the backward pass's queue, what they add
        hooks = costs.micro[0].seconds(c, mode, graphs, fused, hooks) - per_micro[0]
    offload = k * 2 * costs.offloaded_bytes / c.host_bandwidth
    total = passes + optimizer + hooks + offload
    first = costs.micro[0]
    return total, {
        "mode": mode
        + (" (CUDA graphs)" if graphs else "")
        + (" (blocks not compiled)" if mode == "fast" and not fused else ""),
        "step_s": total,
        "forward_backward_s": passes,
        "per_micro_batch_s": per_micro,
        "optimizer_s": optimizer,
        "step_in_backward_s": hooks,
        "offload_s": offload,
        "model_flops_per_step": costs.model_flops,
        "simulated_flops_per_step": costs.simulated_flops,
        "kernels_per_micro_batch": int(first.kernels.sum()),
        "bytes_per_micro_batch": float(first.bytes.sum()),
        "module_calls_per_micro_batch": first.module_calls,
    }


def floor_step_seconds(
    costs: StepCosts,
    c: Ceilings,
    mode: str,
    graphs: bool,
    fused: bool,
    scale: float,
    k: int,
    kept: float = 1.0,
    kept_memory: float = 1.0,
) -> float:
    """No more than :func:`step_seconds` of the step without techniques that ``costs`` (one micro-batch)
    describes, on ``scale`` x its micro-batch accumulated over ``k`` (a later micro-batch runs the first's ops
    and adds the gradients), each op run at least ``kept`` times as often (``kept * kept_memory`` for one
    without FLOPs: :meth:`MicroBatch.floor_seconds`): what bounds a set's speed before its own simulation."""
    per = costs.micro[0].floor_seconds(c, mode, graphs and mode == "fast", fused, scale, kept, kept_memory)
    opt = costs.optimizer
    return k * per + (2 * (opt["parameter_bytes"] + opt["state_bytes"]) + opt["gradient_bytes"]) / c.bandwidth


def load_calibration(path: str = str(CALIBRATION_FILE)) -> dict[str, Any]:
    """The stored calibration ({"kinds": {gpu: {"ceilings": ..., "runs": [...], ...}}}), empty if missing."""
    return kinds_table(path)


def ceilings(gpu: str, table: dict[str, Any] | None = None) -> tuple[Ceilings, str]:
    """The ceilings of ``gpu`` and where they come from; a kind without runs takes h100's (said so)."""
    table = load_calibration() if table is None else table
    kinds = table.get("kinds") or {}
    if not kinds:
        raise RuntimeError(
            f"no step-time calibration in {CALIBRATION_FILE}: run python -m"
            " fabric_memory_recipes.planning.your_model.step_calibration --write"
        )
    kind = gpu if gpu in kinds else ("h100" if "h100" in kinds else sorted(kinds)[0])
    entry = kinds[kind]
    fitted = sum(1 for r in entry["runs"] if r.get("fitted"))
    source = f"{kind}: fitted on {fitted} committed configurations ({CALIBRATION_FILE.name})"
    return Ceilings(**entry["ceilings"]), source if kind == gpu else f"no {gpu} runs: {source}"


def predict_step_s(
    model: Any,
    um: UserModel,
    plan: Plan,
    seq_len: int,
    gpu: str = "h100",
    mode: str = "eager",
    cuda_graphs: bool | None = None,
    blocks: tuple[str, ...] = (),
) -> tuple[float, dict[str, Any]]:
    """The predicted time of one optimizer step of ``model`` (built anywhere; the meta device will do)
    under ``plan`` on a GPU of kind ``gpu`` in ``mode`` (eager | fast): (seconds, detail), the detail
    with the model FLOPs per step, the MFU they mean, the terms of the sum and the ceilings' source.
    ``cuda_graphs`` (fast mode): None does what your model's runner does by default, graphs for a vision
    model and a causal LM, none for a text classifier or an encoder-decoder; ``blocks``: the
    repeated blocks fast mode compiles (their calls are fast mode's host time).

    A planner that simulates the step for its memory anyway can time the same simulation: pass an
    :class:`OpCosts` to ``estimate(..., op_costs=collector)``, then :func:`predict_costs` of
    ``costs_of(collector, plan, offloaded_bytes)``."""
    graphs = (um.captured and not plan.optimizer_in_backward) if cuda_graphs is None else cuda_graphs
    return predict_costs(simulated_costs(model, um, plan, seq_len, blocks=blocks), gpu, mode, graphs)


def predict_costs(
    costs: StepCosts, gpu: str = "h100", mode: str = "eager", graphs: bool = False
) -> tuple[float, dict]:
    """:func:`step_seconds` on the stored ceilings of ``gpu``, with the MFU and the ceilings' source."""
    c, source = ceilings(gpu)
    seconds, detail = step_seconds(costs, c, mode, graphs)
    detail.update(mfu=mfu(detail["model_flops_per_step"], seconds, gpu), gpu=gpu, ceilings_source=source)
    return seconds, detail


def mfu(model_flops_per_step: float, step_s: float, gpu: str = "h100") -> float | None:
    """Model FLOPs utilisation: model FLOPs per step over the step's time, against the GPU's datasheet
    dense bf16 peak (measurement/results_file.py's ``PEAK_BF16_FLOPS``, the one the runs record; None
    for an unknown kind)."""
    peak = peak_bf16_flops(gpu.upper())
    return model_flops_per_step / step_s / peak if peak and step_s > 0 else None


def uses_graphs(choice: Any, um: UserModel) -> bool:
    """Whether the runner's fast mode captures the step in CUDA graphs for a planner set (``choice``:
    its mode, devices and techniques): an image model's or a causal LM's (``um.captured``) on one GPU,
    without the step in backward (training/your_model/runner.py's ``checked``)."""
    return (
        choice.mode == "fast"
        and um.captured
        and choice.devices == 1
        and not choice.techniques.uses(OPTIMIZER_IN_BACKWARD)
    )

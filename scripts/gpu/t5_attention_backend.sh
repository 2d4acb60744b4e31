#!/usr/bin/env bash
# Which attention kernel T5-small's training step runs on one GPU, eager and with compiled blocks (fast
# mode), and what its forward saves for backward, against the simulation's count of the same step. The
# estimator models CUDA as running T5's self-attention on the math kernel (its position-bias mask is laid
# out heads-last; CUDA's fused kernels want the mask's last dimension contiguous), compiled blocks as
# inductor partitions them (planning/simulation/compiled/partition.py), and dropout as CUDA's fused one (a
# bool mask).
# From the repository root; about 3 minutes (compiling the blocks: about 1); results under $OUT:
#
#   bash scripts/gpu/t5_attention_backend.sh
#
# $OUT/t5_attention_backend.json: per mode (eager, compiled) the SDPA calls (mask shape, strides, dtype,
# torch._fused_sdp_choice's backend for them as autocast hands them over, and for the eager mode the reason
# the efficient kernel refuses them), the attention-looking CUDA kernels the profiler saw in one step, the
# bytes the forward saves (the project's SavedTensorCounter) and the step's peak allocated; the simulation's
# saved bytes and peak for the same plan. $OUT/log.txt: the same, as it goes.
# CPU dry run of the Python (tiny sizes, no profiler kernels): DEVICE=cpu BATCH=2 SEQ=32 TGT=8 bash ...
set -u
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 FMR_OFFLINE=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
timeout 480 python3 - "$OUT" <<'EOF' 2>&1 | tee "$OUT/log.txt"
import json, os, sys, time
import torch
import torch.nn.functional as F
from fabric_memory_recipes.planning.plan import Plan
from fabric_memory_recipes.planning.simulation.tracking import SavedTensorCounter
from fabric_memory_recipes.planning.your_model.estimate import estimate, meta_user_model
from fabric_memory_recipes.training.your_model import models

out_dir, t0 = sys.argv[1], time.time()
device = os.environ.get("DEVICE", "cuda")
B, L, T = (int(os.environ.get(k, d)) for k, d in (("BATCH", 32), ("SEQ", 256), ("TGT", 64)))
REF = "hf:examples/configs/t5-small"
result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
          "batch": B, "seq_len": L, "target_len": T, "modes": {}}


def log(*a):
    print(f"[t5_attention_backend {time.time() - t0:.0f} s]", *a, flush=True)


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[B // 2:, L // 2:] = 0  # padded sources, as the runner's synthetic pairs are
    labels = torch.randint(3, 300, (B, T), generator=g)
    return [t.to(device) for t in (ids, mask, labels)]


def run(mode):
    torch.manual_seed(0)
    um = models.resolve(REF)
    with torch.device(device):
        model = models.build(um)
    model.train()
    if mode == "compiled":
        blocks, _ = models.repeated_blocks(model)
        log("compiled blocks:", models.compile_repeated(model, blocks))
    calls, real = [], F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if not torch.compiler.is_compiling() and len(calls) < 64:
            m = attn_mask
            lp = m.to(torch.bfloat16) if m is not None and m.is_floating_point() else m  # as autocast does
            row = {"q": list(q.shape), "mask": None if m is None else [list(m.shape), list(m.stride()), str(m.dtype), m.requires_grad],
                   "dropout": dropout_p}
            try:
                qq, kk, vv = (t.to(torch.bfloat16) for t in (q, k, v))
                row["fused_sdp_choice"] = int(torch._fused_sdp_choice(qq, kk, vv, lp, dropout_p, is_causal, scale=scale))
                if device == "cuda" and mode == "eager" and len(calls) < 3:
                    import warnings
                    with warnings.catch_warnings(record=True) as w:
                        warnings.simplefilter("always")
                        params = torch.backends.cuda.SDPAParams(qq, kk, vv, lp, dropout_p, is_causal, False)
                        row["efficient_ok"] = torch.backends.cuda.can_use_efficient_attention(params, True)
                    row["efficient_refusal"] = [str(x.message)[:300] for x in w]
            except Exception as e:  # a torch without these helpers: the rest still runs
                row["choice_error"] = f"{type(e).__name__}: {e}"[:300]
            calls.append(row)
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)

    F.scaled_dot_product_attention = sdpa
    ids, mask, labels = batch()
    try:
        for step in range(3):  # the first compiles; the third is measured
            if step == 2 and device == "cuda":
                torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if step == 2 and device == "cuda" else None
            if prof: prof.__enter__()
            with torch.autocast(device, dtype=torch.bfloat16), SavedTensorCounter(model.parameters()) as saved:
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                nbytes = saved.nbytes
            loss.backward()
            if prof: prof.__exit__(None, None, None)
            model.zero_grad(set_to_none=True)
            log(mode, "step", step, "saved", nbytes)
        row = {"sdpa_calls": calls, "saved_bytes": nbytes}
        if device == "cuda":
            row["step_peak_allocated_above_start"] = torch.cuda.max_memory_allocated() - base
            names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
            row["attention_kernels"] = sorted(n[:160] for n in names if any(
                s in n.lower() for s in ("fmha", "attention", "efficient", "flash", "softmax", "dropout", "cudnn")))
        return row
    finally:
        F.scaled_dot_product_attention = real


for mode in ("eager", "compiled"):
    try:
        result["modes"][mode] = run(mode)
    except Exception as e:
        result["modes"][mode] = {"error": f"{type(e).__name__}: {e}"[:500]}
    log(mode, json.dumps({k: v for k, v in result["modes"][mode].items() if k != "sdpa_calls"})[:1500])
    json.dump(result, open(f"{out_dir}/t5_attention_backend.json", "w"), indent=1)

um, model, blocks, _ = meta_user_model(REF)
for compiled in (False, True):
    plan = Plan(precision="bf16-mixed", micro_batch_size=B, compile=compiled, compiled_blocks=blocks if compiled else ())
    est = estimate(model, um, plan, L, target_len=T)
    result[f"simulated_{'compiled' if compiled else 'eager'}"] = {
        "saved_bytes": est.activations_saved_bytes, "peak_allocated_gb": est.peak_gb, "kernels": est.kernels}
    log("simulated", "compiled" if compiled else "eager", est.activations_saved_bytes, est.kernels)
json.dump(result, open(f"{out_dir}/t5_attention_backend.json", "w"), indent=1)
log("done")
EOF

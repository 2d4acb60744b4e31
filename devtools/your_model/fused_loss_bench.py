"""Which fused linear cross-entropy? The loss of a causal LM's output projection, measured on one GPU
for each implementation against the plain one (``F.linear`` then ``F.cross_entropy`` in fp32, what a
Hugging Face causal LM computes): peak memory of forward + backward above what the inputs hold, time
(median of ``--repeats``), and the loss and gradients' difference from the plain ones.

    python -m devtools.your_model.fused_loss_bench --out runs/fused-loss        # on a CUDA GPU

Implementations: ``plain``; ``liger`` (liger-kernel's LigerFusedLinearCrossEntropyLoss), ``cce``
(cut-cross-entropy's linear_cross_entropy), ``torch`` (this project's chunked path,
training/techniques/fused_loss.py, which CUDA runs where its chunks are 4 x Liger's); each skipped with a
reason when its package is missing.
Shapes: ``--tokens`` rows of ``--hidden`` features onto ``--vocab`` classes, bf16 (autocast's dtype).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from fabric_memory_recipes.console import Parser
from fabric_memory_recipes.training.techniques import fused_loss


def _plain(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)


def _liger(h, w, t):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=-100)(w, h, t)


def _cce(h, w, t):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, t, ignore_index=-100)


def _torch(h, w, t):
    return fused_loss.ChunkedLinearCrossEntropy.apply(h, w, t)


IMPLS = {"plain": _plain, "liger": _liger, "cce": _cce, "torch": _torch}


def measure(fn, h, w, t, repeats: int) -> dict:
    times = []
    for i in range(repeats + 2):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = fn(h, w, t)
        loss.backward()
        torch.cuda.synchronize()
        if i >= 2:  # the first calls compile and autotune
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() - base
    return {
        "loss": loss.item(),
        "peak_extra_gb": peak / 1e9,
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "max_ms": 1e3 * max(times),
        "grad_h": h.grad.float().clone(),
        "grad_w": w.grad.float().clone(),
    }


def main() -> int:
    p = Parser(prog="python -m devtools.your_model.fused_loss_bench", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8 * 1023)
    p.add_argument("--hidden", type=int, default=960)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="runs/fused-loss")
    a = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    h = (torch.randn(a.tokens, a.hidden, device=dev) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, device=dev) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, a.vocab, (a.tokens,), device=dev)
    t[: a.tokens // 8] = -100  # a prompt's tokens
    rows, ref = [], None
    for name, fn in IMPLS.items():
        try:
            r = measure(fn, h, w, t, a.repeats)
        except Exception as e:
            rows.append({"impl": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
            continue
        gh, gw = r.pop("grad_h"), r.pop("grad_w")
        if ref is None:
            ref = (r["loss"], gh, gw)
        r["loss_diff"] = abs(r["loss"] - ref[0])
        r["grad_h_rel_l2"] = ((gh - ref[1]).norm() / ref[1].norm()).item()
        r["grad_w_rel_l2"] = ((gw - ref[2]).norm() / ref[2].norm()).item()
        rows.append({"impl": name, **r})
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fused_loss_bench.json"), "w") as f:
        json.dump(
            {"shape": vars(a), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

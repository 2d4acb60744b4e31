"""Which fused linear cross-entropy? The loss of a causal LM's output projection, measured on one GPU
for each implementation against the plain one (``F.linear`` then ``F.cross_entropy`` in fp32, what a
Hugging Face causal LM computes): peak memory of forward + backward above what the inputs hold, time
(median of ``--repeats``), and the loss and gradients' difference from the plain ones.

    python -m devtools.your_model.fused_loss_bench --out runs/fused-loss        # on a CUDA GPU

Implementations: ``plain``; ``liger`` (liger-kernel's LigerFusedLinearCrossEntropyLoss), ``cce``
(cut-cross-entropy's linear_cross_entropy), ``torch`` (this project's chunked path,
training/techniques/fused_loss.py, which CUDA runs where its chunks are 4 x Liger's); each skipped with a
reason when its package is missing.
Shapes: ``--tokens`` rows of ``--hidden`` features onto ``--vocab`` classes, bf16 (autocast's dtype);
``--bias``: the projection has a bias (Phi's head), whose gradient is compared too (cut-cross-entropy takes
none: its row says so).
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


def _plain(h, w, t, b):
    return F.cross_entropy(F.linear(h, w, b).float(), t, ignore_index=-100)


def _liger(h, w, t, b):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=-100)(w, h, t, b)


def _cce(h, w, t, b):
    from cut_cross_entropy import linear_cross_entropy

    if b is not None:
        raise ValueError("cut-cross-entropy's linear_cross_entropy takes no bias")
    return linear_cross_entropy(h, w, t, ignore_index=-100)


def _torch(h, w, t, b):
    return fused_loss.ChunkedLinearCrossEntropy.apply(h, w, t, b)


IMPLS = {"plain": _plain, "liger": _liger, "cce": _cce, "torch": _torch}


def measure(fn, h, w, t, b, repeats: int) -> dict:
    times = []
    for i in range(repeats + 2):
        h.grad = w.grad = None
        if b is not None:
            b.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = fn(h, w, t, b)
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
        "grad_b": b.grad.float().clone() if b is not None else None,
    }


def main() -> int:
    p = Parser(prog="python -m devtools.your_model.fused_loss_bench", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8 * 1023)
    p.add_argument("--hidden", type=int, default=960)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--bias", action="store_true", help="the projection has a bias (default: none)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="runs/fused-loss")
    a = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    h = (torch.randn(a.tokens, a.hidden, device=dev) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, device=dev) * 0.02).bfloat16().requires_grad_()
    b = (torch.randn(a.vocab, device=dev) * 0.5).bfloat16().requires_grad_() if a.bias else None
    t = torch.randint(0, a.vocab, (a.tokens,), device=dev)
    t[: a.tokens // 8] = -100  # a prompt's tokens
    rows, ref = [], None
    for name, fn in IMPLS.items():
        try:
            r = measure(fn, h, w, t, b, a.repeats)
        except Exception as e:
            rows.append({"impl": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
            continue
        grads = r.pop("grad_h"), r.pop("grad_w"), r.pop("grad_b")
        if ref is None:
            ref = (r["loss"], *grads)
        r["loss_diff"] = abs(r["loss"] - ref[0])
        for key, g, g_ref in zip(("grad_h", "grad_w", "grad_b"), grads, ref[1:], strict=True):
            if g is not None:
                r[f"{key}_rel_l2"] = ((g - g_ref).norm() / g_ref.norm()).item()
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

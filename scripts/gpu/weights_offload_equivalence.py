"""Rung 16 on CUDA: the streamed model (side streams, events, pinned copies, the CPU thread) against the
ordinary step from the same start. A 6-block ViT (hidden 256), 6 steps, Adam lr 1e-3:

- fp32 transfers vs plain fp32 training on the GPU with Adam (TF32 off): parameter difference;
- bf16 transfers vs bf16 forward/backward on the GPU with fp32 masters + fused CPU Adam: difference,
  with and without checkpointed blocks.

Prints one JSON line (results/published/h100/levers/rung16/equivalence-cuda.txt is its output):

    python3 scripts/gpu/weights_offload_equivalence.py > equivalence-cuda.txt

Without a GPU it runs a smaller model on the CPU: a check of this script only (tests/devtools/).
"""

from __future__ import annotations

import copy
import json
import time

import torch
import torch.nn.functional as F
from torchvision.models.vision_transformer import VisionTransformer

from fabric_memory_recipes.training import models
from fabric_memory_recipes.training.techniques.weights_offload import WeightsOnCPU

LR, STEPS = 1e-3, 6


def model(device: torch.device, checkpointed: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    h = 256 if cuda else 32
    m = VisionTransformer(
        32, 4 if cuda else 16, num_layers=6, num_heads=4, hidden_dim=h, mlp_dim=4 * h, num_classes=10
    )
    if checkpointed:
        for i, b in enumerate(models.blocks(m)):
            m.encoder.layers[i] = models.CheckpointedBlock(b)
    return m


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
        for _ in range(STEPS)
    ]


def streamed(device, batches, dtype, checkpointed) -> dict[str, torch.Tensor]:
    m = model(device, checkpointed)
    s = WeightsOnCPU(
        m, models.blocks(m), device, lambda p: torch.optim.Adam(p, lr=LR, fused=True), dtype=dtype
    )
    for x, y in batches:
        F.cross_entropy(m(x.to(device, dtype)), y.to(device)).backward()
    out = {n: t.clone() for n, t in s.master_parameters().items()}
    s.close()
    return out


def reference_fp32(device, batches) -> dict[str, torch.Tensor]:
    m = model(device, False).to(device)
    opt = torch.optim.Adam(m.parameters(), lr=LR, fused=True)
    for x, y in batches:
        F.cross_entropy(m(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().cpu() for n, p in m.named_parameters()}


def reference_bf16(device, batches, checkpointed) -> dict[str, torch.Tensor]:
    m = model(device, checkpointed)
    master = dict(m.named_parameters())
    opt = torch.optim.Adam(master.values(), lr=LR, fused=True)
    low = copy.deepcopy(m).to(device, torch.bfloat16)
    for x, y in batches:
        with torch.no_grad():
            for n, p in low.named_parameters():
                p.copy_(master[n])
        F.cross_entropy(low(x.to(device, torch.bfloat16)), y.to(device)).backward()
        for n, p in low.named_parameters():
            master[n].grad = p.grad.float().cpu()
            p.grad = None
        opt.step()
    return {n: p.detach().clone() for n, p in master.items()}


def diff(a, b, start) -> dict[str, float]:
    d = max((a[n] - b[n]).abs().max().item() for n in a)
    moved = max((b[n] - start[n]).abs().max().item() for n in b)
    return {"max_abs_diff": d, "max_change": moved}


def compare(device: torch.device) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    batches = make_batches()
    start = {
        c: {n: p.detach().clone() for n, p in model(device, c).named_parameters()} for c in (False, True)
    }
    t = time.perf_counter()
    bf16 = torch.bfloat16
    return {
        "fp32_vs_gpu_adam": diff(
            streamed(device, batches, torch.float32, False), reference_fp32(device, batches), start[False]
        ),
        "bf16_ckpt_vs_bf16_compute_cpu_adam": diff(
            streamed(device, batches, bf16, True), reference_bf16(device, batches, True), start[True]
        ),
        "bf16_vs_bf16_compute_cpu_adam": diff(
            streamed(device, batches, bf16, False), reference_bf16(device, batches, False), start[False]
        ),
        "seconds": round(time.perf_counter() - t, 1),
    }


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(json.dumps(compare(device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

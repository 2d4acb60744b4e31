"""Rung 16 on CUDA: the streamed model (side streams, events, pinned copies, the CPU thread) against the
ordinary step from the same start. A 6-block ViT (hidden 256), 6 steps, Adam lr 1e-3:
- fp32 transfers vs plain fp32 training on the GPU with Adam (TF32 off): parameter difference
- bf16 transfers vs bf16 forward/backward on the GPU with fp32 masters + fused CPU Adam: difference
Prints one JSON line."""
import copy
import json
import time

import torch
import torch.nn.functional as F
from fabric_memory_recipes.training.weights_offload import WeightsOnCPU
from torchvision.models.vision_transformer import VisionTransformer

from fabric_memory_recipes.training import models

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
LR, STEPS = 1e-3, 6
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a check of this script only

def model(ckpt):
    torch.manual_seed(0)
    h = 256 if dev.type == "cuda" else 32
    m = VisionTransformer(32, 4 if dev.type == "cuda" else 16, num_layers=6, num_heads=4, hidden_dim=h, mlp_dim=4 * h, num_classes=10)
    if ckpt:
        for i, b in enumerate(models.blocks(m)):
            m.encoder.layers[i] = models.CheckpointedBlock(b)
    return m

g = torch.Generator().manual_seed(1)
batches = [(torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(STEPS)]

def streamed(dtype, ckpt):
    m = model(ckpt)
    s = WeightsOnCPU(m, models.blocks(m), dev, lambda p: torch.optim.Adam(p, lr=LR, fused=True), dtype=dtype)
    for x, y in batches:
        F.cross_entropy(m(x.to(dev, dtype)), y.to(dev)).backward()
    out = {n: t.clone() for n, t in s.master_parameters().items()}
    s.close()
    return out

def reference_fp32():
    m = model(False).to(dev)
    opt = torch.optim.Adam(m.parameters(), lr=LR, fused=True)
    for x, y in batches:
        F.cross_entropy(m(x.to(dev)), y.to(dev)).backward()
        opt.step(); opt.zero_grad()
    return {n: p.detach().cpu() for n, p in m.named_parameters()}

def reference_bf16(ckpt):
    m = model(ckpt)
    master = dict(m.named_parameters())
    opt = torch.optim.Adam(master.values(), lr=LR, fused=True)
    low = copy.deepcopy(m).to(dev, torch.bfloat16)
    for x, y in batches:
        with torch.no_grad():
            for n, p in low.named_parameters():
                p.copy_(master[n])
        F.cross_entropy(low(x.to(dev, torch.bfloat16)), y.to(dev)).backward()
        for n, p in low.named_parameters():
            master[n].grad = p.grad.float().cpu(); p.grad = None
        opt.step()
    return {n: p.detach().clone() for n, p in master.items()}

def diff(a, b, start):
    d = max((a[n] - b[n]).abs().max().item() for n in a)
    moved = max((b[n] - start[n]).abs().max().item() for n in b)
    return {"max_abs_diff": d, "max_change": moved}

start = {c: {n: p.detach().clone() for n, p in model(c).named_parameters()} for c in (False, True)}
t = time.perf_counter()
out = {
    "fp32_vs_gpu_adam": diff(streamed(torch.float32, False), reference_fp32(), start[False]),
    "bf16_ckpt_vs_bf16_compute_cpu_adam": diff(streamed(torch.bfloat16, True), reference_bf16(True), start[True]),
    "bf16_vs_bf16_compute_cpu_adam": diff(streamed(torch.bfloat16, False), reference_bf16(False), start[False]),
    "seconds": round(time.perf_counter() - t, 1),
}
print(json.dumps(out))

"""Is a small-batch rung limited by the GPU or by the host launching its kernels?

Times eager ViT-L/16 forward+backward (bf16-true, through Fabric and without it) at micro-batches 4 and
16, the patch-embedding convolution alone (with and without cudnn.benchmark), the host time to
*enqueue* one forward+backward, the DataLoader alone, and prints a torch.profiler table of six batch-16
steps. If forward+backward costs about the same at batch 4 and 16, and host self-CPU time exceeds GPU
time in the profile, the step is launch-bound: the GPU waits for Python. Needs a CUDA GPU.

    python -m devtools.launch_bound > launch_bound.log
"""

import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from fabric_memory_recipes.training import data, models
from fabric_memory_recipes.training.step import train_step


def timeit(name: str, fn, n: int = 30, warm: int = 5) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - start) / n
    print(f"{name:55s} {dt * 1000:8.2f} ms/iter", flush=True)
    return dt


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("launch_bound.py: error: needs a CUDA GPU")
    torch.set_float32_matmul_precision("high")
    fabric = L.Fabric(accelerator="cuda", devices=1, precision="bf16-true")
    fabric.launch()
    model = models.build_model("vit_l_16", None)
    opt = torch.optim.Adam(model.parameters(), lr=5e-5, fused=True)
    model, opt = fabric.setup(model, opt)
    raw = model.module

    for bs in (4, 16):
        x8 = torch.randint(0, 255, (bs, 32, 32, 3), dtype=torch.uint8, device="cuda")
        y = torch.randint(0, 10, (bs,), device="cuda")
        xin = data.to_model_input(x8, 224).bfloat16()

        def fwdbwd_raw(xin=xin, y=y):
            F.cross_entropy(raw(xin), y).backward()

        def fwdbwd_fabric(x8=x8, y=y):
            fabric.backward(F.cross_entropy(model(data.to_model_input(x8, 224)), y))

        def fwd_only(xin=xin):
            with torch.no_grad():
                raw(xin)

        def patch_only(xin=xin):
            raw.conv_proj(xin).float().sum().backward()

        timeit(f"bs{bs} raw fwd+bwd (eager)", fwdbwd_raw)
        timeit(f"bs{bs} fabric fwd+bwd + to_model_input", fwdbwd_fabric)
        timeit(f"bs{bs} raw fwd no_grad", fwd_only)
        timeit(f"bs{bs} conv_proj fwd+bwd", patch_only)
        torch.backends.cudnn.benchmark = True
        timeit(f"bs{bs} conv_proj fwd+bwd cudnn.benchmark", patch_only)
        timeit(f"bs{bs} raw fwd+bwd cudnn.benchmark", fwdbwd_raw)
        torch.backends.cudnn.benchmark = False

    x8 = torch.randint(0, 255, (4, 32, 32, 3), dtype=torch.uint8, device="cuda")
    y = torch.randint(0, 10, (4,), device="cuda")
    xin = data.to_model_input(x8, 224).bfloat16()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.cross_entropy(raw(xin), y).backward()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(
        f"bs4 host time to launch fwd+bwd {1000 * (t1 - t0):.1f} ms, until GPU done {1000 * (t2 - t0):.1f} ms"
    )

    splits = data.synthetic()
    for pin in (False, True):
        train, _, _ = data.build_loaders(splits.datasets(), 4, 4, 0, pin)
        it = iter(fabric.setup_dataloaders(train))
        next(it)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            next(it)
        torch.cuda.synchronize()
        print(f"dataloader pin={pin} {1000 * (time.perf_counter() - t0) / 200:.2f} ms/batch")

    x8 = torch.randint(0, 255, (16, 32, 32, 3), dtype=torch.uint8, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")
    batch_fn = data.image_classification(224)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(6):  # the recipes' training step
            train_step(fabric, model, opt, batch_fn, [(x8, y)])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()

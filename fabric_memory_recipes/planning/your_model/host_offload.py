"""FSDP's CPU offload for your model (``--fsdp --cpu-offload``, a ``--fit --devices N`` set): what it adds to
a step's time, which the simulated step's op costs cannot show.

Lightning's FSDPStrategy(cpu_offload=True) is FSDP's ``CPUOffload(offload_params=True)``: each GPU's fp32
shard of the parameters lives in host memory with its gradient, and the optimizer steps there. Per
optimizer step and GPU the shard crosses PCIe three times (copied in for the forward's and the backward's
all-gather, the gradient copied out) and the CPU optimizer reads and writes parameter, gradient and state.
The two bandwidths below are assumptions, not fitted on a run: the prediction says so, and ``--measure``
runs the set.
"""

from __future__ import annotations

from fabric_memory_recipes.planning.plan import OPTIMIZER_STATE_FACTOR

COPY_GBPS = 20.0  # host<->GPU copies of one process (pinned PCIe Gen5 x16 runs ~50, pageable copies ~10-25)
HOST_OPTIMIZER_GBPS = 40.0  # one process's CPU optimizer streaming over host memory (its share of the cores)
SOURCE = (
    f"FSDP's CPU offload: {COPY_GBPS:g} GB/s host copies and a {HOST_OPTIMIZER_GBPS:g} GB/s CPU optimizer per"
    " process, assumed (planning/your_model/host_offload.py), not measured"
)


def offload_seconds(trainable: int, devices: int, optimizer: str) -> float:
    """Seconds one optimizer step of FSDP's CPU offload adds per GPU: the copies of each process's fp32 shard
    (in twice, the gradient out once) and its CPU optimizer step (parameter, gradient and state read,
    parameter and state written)."""
    shard = 4.0 * trainable / devices  # fp32 bytes of one process's shard
    state = OPTIMIZER_STATE_FACTOR.get(optimizer, 2)
    copies = 3 * shard / (COPY_GBPS * 1e9)
    step = (2 + state + 1 + state) * shard / (HOST_OPTIMIZER_GBPS * 1e9)
    return copies + step

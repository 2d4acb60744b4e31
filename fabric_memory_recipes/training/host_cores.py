"""The host's cores shared out among the processes of one machine: their intra-op threads
(:func:`share_threads`, every run of several processes) and, for rung 09, the cores themselves
(:func:`share_out`).

Why the threads. torch starts as many intra-op threads as the machine has cores in every process, so
4 processes on one host run 4 x as many threads as cores. Each parallel region (a host copy, the
loader pinning a batch) then waits for threads the scheduler has parked: on 4 x H200 with 64 cores,
pinning a 196 KB batch of images took 20-33 ms a step and the GPUs stood idle meanwhile
(results/published/h200x4/sharded-spread/). torchrun avoids it by starting one thread a process;
:func:`share_threads` gives each process its share of the cores instead.

With the shards in host memory, Adam steps on the CPU in every process at the same moment. Each process
then gets its own cores: a disjoint slice of the cores this process may run on, taken from the NUMA node
its slice falls in (so the pinned shards it touches first are allocated on that node), and as many
intra-op threads as cores. Without it, every process's threads may run on every core, and the
scheduler moves them between cores and nodes from step to step.
"""

from __future__ import annotations

import glob
import os
import re

import torch

NODES = "/sys/devices/system/node/node[0-9]*/cpulist"


def _cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' as [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus += range(int(first), int(last or first) + 1)
    return cpus


def numa_nodes(allowed: list[int], pattern: str = NODES) -> list[list[int]]:
    """The allowed cores of each NUMA node, in node order (one list of them all where none is listed)."""
    nodes = []
    for path in sorted(glob.glob(pattern), key=lambda p: int(re.findall(r"node(\d+)", p)[-1])):
        with open(path) as f:
            cpus = [c for c in _cpu_list(f.read()) if c in allowed]
        if cpus:
            nodes.append(cpus)
    return nodes or [sorted(allowed)]


def cores_of(local_rank: int, local_ranks: int, nodes: list[list[int]]) -> list[int]:
    """Local rank ``local_rank``'s slice of ``nodes``: the ranks are spread over the nodes in order, and
    each node's cores are split evenly among the ranks on it (a rank gets whole nodes when there are
    more nodes than ranks)."""
    if not 0 <= local_rank < local_ranks:
        raise ValueError(f"local rank {local_rank} of {local_ranks}")
    if local_ranks <= len(nodes):
        first, last = local_rank * len(nodes) // local_ranks, (local_rank + 1) * len(nodes) // local_ranks
        return [c for node in nodes[first:last] for c in node]
    node = local_rank * len(nodes) // local_ranks
    on_node = [r for r in range(local_ranks) if r * len(nodes) // local_ranks == node]
    i, cpus = on_node.index(local_rank), nodes[node]
    if len(on_node) > len(cpus):  # more processes than cores: one core each, shared round the node
        return [cpus[i % len(cpus)]]
    return cpus[i * len(cpus) // len(on_node) : (i + 1) * len(cpus) // len(on_node)]


def share_threads(local_ranks: int) -> int:
    """Give torch ``cores // local_ranks`` intra-op threads (at least one) when ``local_ranks`` processes
    share this host's cores; returns the number set (torch's own when one process runs)."""
    if local_ranks > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_ranks))
    return torch.get_num_threads()


def share_out(local_rank: int, local_ranks: int) -> list[int]:
    """Bind this process (from now on: the threads it starts later, the CPU optimizer's among them) to
    its slice of the cores, with as many intra-op threads as the slice has cores; returns the cores. The
    lifecycle's :func:`share_threads` gave it ``cores // local_ranks`` threads before the launch: that is
    the slice's size where the cores split evenly, and then only the binding is left to do; a slice of
    another size (cores that do not split evenly, NUMA nodes of unequal sizes) sets its own number. Call
    it after ``fabric.launch()``: processes started later inherit the binding."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = cores_of(local_rank, local_ranks, numa_nodes(allowed))
    os.sched_setaffinity(0, cores)
    if torch.get_num_threads() != len(cores):
        torch.set_num_threads(len(cores))
    return cores

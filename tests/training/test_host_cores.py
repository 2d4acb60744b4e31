"""Rung 09's share of the host's cores per process (training/host_cores.py), on made-up NUMA layouts."""

from __future__ import annotations

import os

import pytest
import torch

from fabric_memory_recipes.training import host_cores


def test_four_ranks_on_two_nodes_get_disjoint_halves_of_their_node():
    nodes = [list(range(0, 32)), list(range(32, 64))]
    shares = [host_cores.cores_of(r, 4, nodes) for r in range(4)]
    assert shares == [list(range(0, 16)), list(range(16, 32)), list(range(32, 48)), list(range(48, 64))]


def test_interleaved_nodes_and_fewer_ranks_than_nodes():
    nodes = [list(range(0, 16, 2)), list(range(1, 16, 2))]  # even and odd cores: two nodes
    assert host_cores.cores_of(1, 4, nodes) == [8, 10, 12, 14]
    assert host_cores.cores_of(0, 1, nodes) == list(range(0, 16, 2)) + list(range(1, 16, 2))
    three = [host_cores.cores_of(r, 3, [list(range(10))]) for r in range(3)]
    assert three == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]


def test_more_ranks_than_cores_still_gives_each_one_core():
    assert [host_cores.cores_of(r, 4, [[0, 1]]) for r in range(4)] == [[0], [1], [0], [1]]
    with pytest.raises(ValueError, match="local rank 4 of 4"):
        host_cores.cores_of(4, 4, [[0, 1]])


def test_numa_nodes_reads_cpulist_files_and_keeps_the_allowed_cores(tmp_path):
    for node, text in ((0, "0-3,8\n"), (1, "4-7\n"), (10, "9\n")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(text)
    pattern = str(tmp_path / "node[0-9]*" / "cpulist")
    assert host_cores.numa_nodes([0, 1, 2, 3, 4, 5, 8, 9], pattern) == [[0, 1, 2, 3, 8], [4, 5], [9]]
    assert host_cores.numa_nodes([0, 1], str(tmp_path / "none" / "*")) == [[0, 1]]


def test_share_out_binds_this_process_and_sets_its_threads():
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        cores = host_cores.share_out(0, 1)
        assert set(cores) == before == os.sched_getaffinity(0)
        assert torch.get_num_threads() == len(cores)
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def test_share_threads_gives_each_process_its_share_of_the_cores(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setattr(host_cores.os, "sched_getaffinity", lambda pid: set(range(64)))
    try:
        assert host_cores.share_threads(4) == 16 == torch.get_num_threads()
        assert host_cores.share_threads(128) == 1  # more processes than cores: one thread each
        torch.set_num_threads(3)
        assert host_cores.share_threads(1) == 3  # one process keeps torch's own number
    finally:
        torch.set_num_threads(threads)


def test_rung_09_sets_its_threads_once_where_the_cores_split_evenly_and_to_its_slice_where_not(monkeypatch):
    """The lifecycle's share_threads, then the recipe's share_out, on a made-up host: 64 cores in two NUMA
    nodes and 4 processes (16 threads each, set once: share_out only binds), then 10 cores and 3 processes
    (3 threads each before the launch; the last process's slice has 4 cores, and 4 threads)."""
    threads, calls, bound = torch.get_num_threads(), [], []
    set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), set_threads(n)))
    monkeypatch.setattr(host_cores.os, "sched_setaffinity", lambda pid, cores: bound.append(list(cores)))
    try:
        for cores, nodes, ranks, rank, slice_, counts in (
            (64, [range(32), range(32, 64)], 4, 1, list(range(16, 32)), [16]),
            (10, [range(10)], 3, 2, [6, 7, 8, 9], [3, 4]),
        ):
            calls.clear()
            monkeypatch.setattr(host_cores.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
            monkeypatch.setattr(host_cores, "numa_nodes", lambda allowed, n=nodes: [list(c) for c in n])
            host_cores.share_threads(ranks)
            assert host_cores.share_out(rank, ranks) == slice_ == bound[-1]
            assert calls == counts and torch.get_num_threads() == len(slice_)
    finally:
        set_threads(threads)

"""CUDA-graph buckets and arenas (fusedmoe.modular.graphs) on any device: the bucket of a token
count, and arenas that grow without moving what a graph already holds."""

from __future__ import annotations

import pytest
import torch

from fusedmoe.modular import graphs


@pytest.mark.parametrize(
    ("num_tokens", "bucket"),
    [(1, 1), (2, 2), (3, 4), (255, 256), (256, 256), (257, 512), (512, 512), (513, 768),
     (2048, 2048), (4095, 4096), (4097, 4352)],
)  # fmt: skip
def test_bucket_of(num_tokens, bucket):
    assert graphs.bucket_of(num_tokens) == bucket


def test_arenas_grow_geometrically_and_keep_what_graphs_hold(monkeypatch):
    monkeypatch.setattr(graphs, "_ARENAS", {})
    cpu = torch.device("cpu")
    small = graphs._arena("in0", (4, 3), torch.float32, cpu)
    assert small.shape == (4, 3)
    again = graphs._arena("in0", (2, 3), torch.float32, cpu)
    assert again.data_ptr() == small.data_ptr()  # a smaller bucket reads the same rows
    grown = graphs._arena("in0", (5, 3), torch.float32, cpu)
    assert grown.shape == (5, 3) and grown.data_ptr() != small.data_ptr()
    assert graphs._ARENAS[("in0", cpu, torch.float32, (3,))].shape[0] == 8  # doubled
    small.fill_(1.0)  # a graph captured with the old buffer still owns it
    assert grown.abs().sum() == 0
    other = graphs._arena("in1", (5, 3), torch.float32, cpu)  # another position: its own
    assert other.data_ptr() != grown.data_ptr()
    assert graphs._arena("in0", (5, 3), torch.bfloat16, cpu).dtype == torch.bfloat16


def test_empty_cache_frees_graphs_arenas_and_workspaces():
    """fusedmoe.empty_cache drops every graph (the next call captures again) before the
    buffers graphs write, then the shared workspaces."""
    import fusedmoe
    from fusedmoe.modular.kernel import shared_workspaces

    cache = graphs.GraphCache()
    cache._graphs[(1, "key")] = None  # a key marked not capturable: an entry all the same
    cpu = torch.device("cpu")
    graphs._arena("in0", (4, 3), torch.float32, cpu)
    shared_workspaces().get("workspace13", (4, 4), torch.float32, cpu)
    retained = shared_workspaces(retain=True)
    retained.get("workspace13", (2, 4), torch.float32, cpu)
    retained.get("workspace13", (8, 4), torch.float32, cpu)  # retires the first
    assert retained.retired
    fusedmoe.empty_cache()
    assert not cache._graphs and not graphs._ARENAS
    assert not shared_workspaces().buffers
    assert not retained.buffers and not retained.retired

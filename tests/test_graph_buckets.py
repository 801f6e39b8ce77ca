"""CUDA-graph buckets, arenas and lanes (fusedmoe.modular.graphs) on any device: the bucket of a
token count, arenas that grow without moving what a graph already holds, and the locking of
GraphCache.run across threads and streams, with a stream handle each thread sets and a Python
stand-in for capture and replay (the real ones: tests/test_graph_threads_gpu.py)."""

from __future__ import annotations

import random
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

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


def test_arenas_grow_geometrically_and_keep_what_graphs_hold():
    lane = graphs._Lane((0, 0))
    cpu = torch.device("cpu")
    small = lane.arena("in0", (4, 3), torch.float32, cpu)
    assert small.shape == (4, 3)
    again = lane.arena("in0", (2, 3), torch.float32, cpu)
    assert again.data_ptr() == small.data_ptr()  # a smaller bucket reads the same rows
    grown = lane.arena("in0", (5, 3), torch.float32, cpu)
    assert grown.shape == (5, 3) and grown.data_ptr() != small.data_ptr()
    assert lane.arenas[("in0", torch.float32, (3,))].shape[0] == 8  # doubled
    small.fill_(1.0)  # a graph captured with the old buffer still owns it
    assert grown.abs().sum() == 0
    other = lane.arena("in1", (5, 3), torch.float32, cpu)  # another position: its own
    assert other.data_ptr() != grown.data_ptr()
    assert lane.arena("in0", (5, 3), torch.bfloat16, cpu).dtype == torch.bfloat16
    # another stream's lane: arenas of its own
    assert graphs._Lane((0, 1)).arena("in0", (4, 3), torch.float32, cpu).data_ptr() != (
        small.data_ptr()
    )


def test_empty_cache_frees_graphs_arenas_and_workspaces(monkeypatch):
    """fusedmoe.empty_cache drops every graph (the next call captures again) before the
    buffers graphs write (every lane's pool, capture stream and arenas), then the shared
    workspaces."""
    import fusedmoe
    from fusedmoe.modular.kernel import shared_workspaces

    lane = graphs._Lane((0, 7), pool=(0, 1), side=types.SimpleNamespace(cuda_stream=8))
    monkeypatch.setattr(graphs, "_LANES", {lane.key: lane})
    cache = graphs.GraphCache()
    cache._graphs[(lane.key, 1, "key")] = None  # a key marked not capturable: an entry all the same
    cpu = torch.device("cpu")
    lane.arena("in0", (4, 3), torch.float32, cpu)
    shared_workspaces().get("workspace13", (4, 4), torch.float32, cpu)
    retained = shared_workspaces(retain=True)
    retained.get("workspace13", (2, 4), torch.float32, cpu)
    retained.get("workspace13", (8, 4), torch.float32, cpu)  # retires the first
    assert retained.retired
    fusedmoe.empty_cache()
    assert not cache._graphs and not lane.arenas and lane.pool is None and lane.side is None
    assert list(graphs._LANES.values()) == [lane]  # kept (a thread may hold it), emptied
    assert not shared_workspaces().buffers
    assert not retained.buffers and not retained.retired


# ---- lanes: GraphCache.run from several threads, on fake streams --------------------------------
class _Streams:
    """The current stream of each thread, as a handle the test sets (0 until it does)."""

    def __init__(self) -> None:
        self.local = threading.local()

    def set(self, handle: int) -> None:
        self.local.handle = handle

    def lane_key(self, device: torch.device) -> tuple[int, int]:
        return (0, getattr(self.local, "handle", 0))


def _record(fn, statics, lane):
    """graphs._record without CUDA: the warm-up, then a 'graph' whose replay runs fn on the
    static inputs and copies its outputs into the lane's arenas, as a CUDA graph does."""
    outputs = fn(*statics)
    arenas = tuple(
        lane.arena(f"out{j}", out.shape, out.dtype, out.device) for j, out in enumerate(outputs)
    )

    def replay():
        for arena, out in zip(arenas, fn(*statics), strict=True):
            arena.copy_(out)

    return types.SimpleNamespace(replay=replay), arenas


@pytest.fixture
def streams(monkeypatch) -> _Streams:
    """GraphCache.run on the CPU: lanes named by each thread's fake stream, captures by
    _record above; no lane of the process is touched."""
    fake = _Streams()
    monkeypatch.setattr(graphs, "_LANES", {})
    monkeypatch.setattr(graphs, "_lane_key", fake.lane_key)
    monkeypatch.setattr(graphs, "_record", _record)
    return fake


def _slow_affine(x: torch.Tensor) -> tuple[torch.Tensor]:
    """2x + 1, after a pause (another thread runs meanwhile): a replay reads its inputs from
    the arenas late, so a call that copied its inputs in between would be read instead."""
    time.sleep(0.001)
    return (2 * x + 1,)


def _calls(cache, streams, handle, sizes, fn=_slow_affine, seed=0) -> list[tuple]:
    """cache.run of fn on a fresh input of each size, on stream `handle`: (input, output)."""
    streams.set(handle)
    gen = torch.Generator().manual_seed(seed)
    calls = []
    for num_tokens in sizes:
        x = torch.randn(num_tokens, 3, generator=gen)
        (out,) = cache.run(fn, (x,), ("key",))
        calls.append((x, out))
    return calls


def _in_threads(*works) -> list:
    with ThreadPoolExecutor(len(works)) as pool:
        futures = [pool.submit(work) for work in works]
        return [future.result() for future in futures]


SIZES = [1, 3, 2, 7, 4, 1, 8, 5, 3, 6] * 3  # buckets 1, 2, 4, 8


def test_calls_on_one_stream_take_turns(streams):
    """Two threads on one stream share its lane: its graphs (captured once) and arenas. Each
    call holds the lane from copy in to copy out, so no call reads another's inputs."""
    cache = graphs.GraphCache()
    results = _in_threads(
        lambda: _calls(cache, streams, 5, SIZES, seed=1),
        lambda: _calls(cache, streams, 5, SIZES[::-1], seed=2),
    )
    for calls in results:
        for x, out in calls:
            assert torch.equal(out, 2 * x + 1)
    assert cache.captures == 4 and cache.replays == 2 * len(SIZES)
    assert list(graphs._LANES) == [(0, 5)]


def test_each_stream_replays_graphs_of_its_own(streams):
    """Two streams: two lanes, each with its graphs (the lane is part of the key) and arenas,
    replaying side by side: both threads are inside a replay at once (a lock shared by the two
    lanes would hold one back, and the barrier would break)."""
    cache = graphs.GraphCache()
    meet = threading.Barrier(2, timeout=10)
    inside = threading.local()

    def meeting(x):
        if getattr(inside, "meet", False):
            meet.wait()
        return _slow_affine(x)

    def work(handle):
        calls = _calls(cache, streams, handle, [3], meeting)  # the capture, then a replay
        inside.meet = True
        calls += _calls(cache, streams, handle, [4], meeting)  # a replay, while the other's
        inside.meet = False
        return calls + _calls(cache, streams, handle, SIZES, seed=handle)

    for calls in _in_threads(lambda: work(1), lambda: work(2)):
        for x, out in calls:
            assert torch.equal(out, 2 * x + 1)
    assert cache.captures == 2 * 4
    assert {key[0] for key in cache._graphs} == {(0, 1), (0, 2)}
    one, two = graphs._LANES[(0, 1)], graphs._LANES[(0, 2)]
    assert all(one.arenas[k].data_ptr() != two.arenas[k].data_ptr() for k in one.arenas)


def test_graphs_evicted_by_other_threads(streams, monkeypatch):
    """Four threads on two streams over a cache of two graphs: every call evicts or finds one
    another thread is evicting; each still gets its own result."""
    monkeypatch.setattr(graphs, "_MAX_GRAPHS", 2)
    cache = graphs.GraphCache()
    quick = lambda x: (2 * x + 1,)
    rng = random.Random(0)
    sizes = [rng.choice([1, 2, 3, 4, 5, 8]) for _ in range(200)]
    results = _in_threads(
        *(lambda i=i: _calls(cache, streams, i % 2, sizes, quick, seed=i) for i in range(4))
    )
    for calls in results:
        for x, out in calls:
            assert torch.equal(out, 2 * x + 1)
    assert len(cache) <= 2


def test_a_stream_callers_use_is_taken_back_from_the_lane_capturing_on_it(streams):
    """A lane captures on a stream no caller uses: when one starts calling from it, the lane
    that captured there draws another at its next capture (a capture records whatever any
    thread queues on its stream)."""
    capturing = graphs._Lane((0, 1), side=types.SimpleNamespace(cuda_stream=7))
    elsewhere = graphs._Lane((1, 2), side=types.SimpleNamespace(cuda_stream=7))  # another GPU
    graphs._LANES.update({capturing.key: capturing, elsewhere.key: elsewhere})
    streams.set(7)
    assert graphs._lane(torch.device("cpu")).key == (0, 7)
    assert capturing.side is None and elsewhere.side is not None


def test_capture_streams_are_drawn_free(streams, monkeypatch):
    """Capture streams come from torch's pool, round-robin: a stream a lane calls from or
    captures on is passed over; with none left, the capture fails (the call runs eagerly)."""
    pool = iter([1, 3, 4, 1, 9] + [3] * 100)
    monkeypatch.setattr(
        torch.cuda, "Stream", lambda device: types.SimpleNamespace(cuda_stream=next(pool))
    )
    graphs._LANES.update({(0, 1): graphs._Lane((0, 1)), (0, 4): graphs._Lane((0, 4))})
    graphs._LANES[(0, 4)].side = types.SimpleNamespace(cuda_stream=3)
    assert graphs._capture_stream(0).cuda_stream == 9  # 1, 3, 4 and 1 are taken
    with pytest.raises(RuntimeError, match="free to capture on"):
        graphs._capture_stream(0)

"""Two threads calling graph-replayed layers at once (fusedmoe.modular.graphs, lanes): each on a
stream of its own (overlapped micro-batches, a serving engine's threads) and both on the
default stream; over one layer, over two layers that share the process's graph state (one each,
and taking turns), and through fused_experts. Every output is compared with eager launches of
the same call (graphs off), computed once the threads are done.

Without lanes (one graph pool, one set of arenas and one capture stream for the process) these
fail: two streams' replays overwrite each other's inputs, outputs and scratch (wrong outputs),
two threads capturing at once record into one stream (a thread's launches land in the other's
graph: an illegal memory access at replay), and two threads on one stream interleave their copy
in, replay and copy out (a call reads the other's inputs).
"""

from __future__ import annotations

import contextlib
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fusedmoe import FusedMoE, functional, fused_experts
from fusedmoe.modular.graphs import DEFAULT_MAX_TOKENS, GRAPHS_ENV
from tests.helpers import assert_close

pytestmark = pytest.mark.gpu

E, K, H, I = 32, 4, 1024, 512  # a qwen3-30b-a3b-like layer, smaller
CALLS = 60  # per thread
#: the first calls of both threads, in this order: both capture the same buckets at once
SIZES = (1, 2, 3, 5, 8, 13, 16, 31, 64, 100, 128, 129, 200, 256, 257, 300)


def _layer(seed: int) -> FusedMoE:
    torch.manual_seed(seed)
    return FusedMoE(E, K, H, I, params_dtype=torch.bfloat16, device="cuda")


def _sizes(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [*SIZES, *(rng.randint(1, 300) for _ in range(CALLS - len(SIZES)))]


def _threads(work, streams: str) -> list:
    """work(thread index) in two threads started together, each on a stream of its own
    (streams="two-streams") or both on the default stream ("one-stream"); their results, in
    order. An exception of a thread (a CUDA error included) is raised here."""
    side = [torch.cuda.Stream(), torch.cuda.Stream()] if streams == "two-streams" else [None] * 2
    start = threading.Barrier(2, timeout=60)
    torch.cuda.synchronize()  # the weights, made on the default stream, are there for both

    def run(index):
        stream = side[index]
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), context:
            start.wait()
            result = work(index)
            torch.cuda.current_stream().synchronize()
        return result

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run, index) for index in range(2)]
        results = [future.result() for future in futures]
    torch.cuda.synchronize()
    return results


def _lanes_of(graphs) -> set:
    return {key[0] for key in graphs._graphs}


@pytest.mark.parametrize("layers", ["one-layer", "layer-per-thread", "alternating-layers"])
@pytest.mark.parametrize("streams", ["two-streams", "one-stream"])
def test_two_threads_over_graphed_layers(streams, layers):
    models = [_layer(0)] if layers == "one-layer" else [_layer(0), _layer(1)]

    def work(index):
        gen = torch.Generator(device="cuda").manual_seed(100 + index)
        calls = []
        for step, num_tokens in enumerate(_sizes(index)):
            if layers == "one-layer":
                layer = models[0]
            elif layers == "layer-per-thread":
                layer = models[index]
            else:  # both threads call both layers, taking turns
                layer = models[(index + step) % 2]
            x = torch.randn(num_tokens, H, generator=gen, device="cuda", dtype=torch.bfloat16)
            logits = torch.randn(num_tokens, E, generator=gen, device="cuda")
            calls.append((layer, x, logits, layer(x, logits)))
        return calls

    results = _threads(work, streams)
    with torch.inference_mode():
        for thread, calls in enumerate(results):
            for step, (layer, x, logits, out) in enumerate(calls):
                layer.cuda_graph_max_tokens = 0
                expected = layer(x, logits)
                layer.cuda_graph_max_tokens = DEFAULT_MAX_TOKENS
                what = f"thread {thread}, call {step} ({x.shape[0]} tokens)"
                assert_close(out.float(), expected.float(), torch.bfloat16, what=what)
    caches = [layer._graph_state[1] for layer in models]
    assert all(graphs.replays > 0 for graphs in caches)
    # each stream replays graphs of its own (the default stream: one lane for both threads)
    assert len(set().union(*map(_lanes_of, caches))) == (2 if streams == "two-streams" else 1)


def test_two_threads_through_fused_experts(monkeypatch):
    """fused_experts keeps a graph cache per call signature: two streams share it."""
    torch.manual_seed(2)
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device="cuda") / 32
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16, device="cuda") / 16

    def work(index):
        gen = torch.Generator(device="cuda").manual_seed(200 + index)
        calls = []
        for num_tokens in _sizes(10 + index):
            x = torch.randn(num_tokens, H, generator=gen, device="cuda", dtype=torch.bfloat16)
            scores = torch.randn(num_tokens, E, generator=gen, device="cuda").softmax(dim=-1)
            weights, ids = scores.topk(K, dim=-1)
            ids = ids.to(torch.int32)
            calls.append((x, weights, ids, fused_experts(x, w13, w2, weights, ids)))
        return calls

    results = _threads(work, "two-streams")
    caches = [entry[2][1] for entry in functional._KERNELS.values() if entry[2] is not None]
    assert any(graphs.replays > 0 and len(_lanes_of(graphs)) >= 2 for graphs in caches)
    monkeypatch.setenv(GRAPHS_ENV, "0")
    with torch.inference_mode():
        for thread, calls in enumerate(results):
            for step, (x, weights, ids, out) in enumerate(calls):
                expected = fused_experts(x, w13, w2, weights, ids)
                what = f"thread {thread}, call {step} ({x.shape[0]} tokens)"
                assert_close(out.float(), expected.float(), torch.bfloat16, what=what)

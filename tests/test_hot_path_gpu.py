"""The eager hot path on a GPU: no host synchronisation through any entry point or backend, and
out-of-range ids never read or write out of bounds (issue: the fast kernels reach every caller).

Each call runs under torch.cuda.set_sync_debug_mode("error"), which raises on any operation
that waits for the device (a .item(), a .tolist(), a nonzero, a copy to the host).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import fusedmoe
from fusedmoe import FusedMoE, fused_experts, fused_moe
from fusedmoe.quant.config import quantize_experts
from tests.helpers import assert_close, random_routing
from tests.reference import experts_ref

pytestmark = pytest.mark.gpu

E, K, H, I = 16, 4, 256, 128


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _layer(**kwargs) -> FusedMoE:
    torch.manual_seed(0)
    return FusedMoE(E, K, H, I, params_dtype=torch.bfloat16, device="cuda", **kwargs)


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"backend": "monolithic"},
        {"scoring_func": "sigmoid", "e_score_correction_bias": torch.randn(E) * 0.1},
        {
            "scoring_func": "sigmoid",
            "use_grouped_topk": True,
            "num_expert_group": 4,
            "topk_group": 2,
            "e_score_correction_bias": torch.randn(E) * 0.1,
            "routed_scaling_factor": 2.5,
        },
        {"quant_config": "fp8_block"},
        {"quant_config": "fp8_block", "backend": "hpc"},
    ],
    ids=["softmax", "monolithic", "biased", "grouped", "fp8_block", "hpc"],
)
def test_layer_makes_no_host_sync(kwargs, num_tokens):
    layer = _layer(**kwargs)
    x = torch.randn(num_tokens, H, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(num_tokens, E, device="cuda")
    with torch.inference_mode():
        expected = layer(x, logits)  # first call: compiles, builds the caches
        with no_sync():
            out = layer(x, logits)
            out = layer(x, logits)
    if kwargs.get("backend") == "hpc":  # float32 atomics: the order of the k adds varies
        assert_close(out.float(), expected.float(), torch.bfloat16)
    else:
        assert torch.equal(out, expected)


def test_deep_gemm_layer_makes_no_host_sync():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("deep_gemm needs sm90+")
    layer = FusedMoE(16, 4, 512, 512, params_dtype=torch.bfloat16, device="cuda")  # N = 2I > 512
    layer.quantize_("fp8_block")
    layer.set_backend("deep_gemm")
    x = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(256, 16, device="cuda")
    with torch.inference_mode():
        expected = layer(x, logits)
        with no_sync():
            out = layer(x, logits)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("num_tokens", [1, 64])
def test_functional_entry_points_make_no_host_sync(num_tokens):
    torch.manual_seed(1)
    x = torch.randn(num_tokens, H, dtype=torch.bfloat16, device="cuda")
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device="cuda") / 16
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16, device="cuda") / 16
    logits = torch.randn(num_tokens, E, device="cuda")
    weights, ids = random_routing(num_tokens, E, K, device="cuda")
    emap = torch.full((2 * E,), -1, dtype=torch.int32, device="cuda")
    emap[::2] = torch.arange(E, dtype=torch.int32, device="cuda")
    w13_q, w2_q, qc = quantize_experts(w13.float(), w2.float(), "fp8_block")
    calls = {
        "fused_experts": lambda: fused_experts(x, w13, w2, weights, ids),
        "fused_experts map": lambda: fused_experts(x, w13, w2, weights, 2 * ids, expert_map=emap),
        "fused_experts fp8": lambda: fused_experts(x, w13_q, w2_q, weights, ids, quant_config=qc),
        "fused_moe": lambda: fused_moe(x, w13, w2, logits, K),
    }
    with torch.inference_mode():
        for name, call in calls.items():
            expected = call()
            with no_sync():
                out = call()
            assert torch.equal(out, expected), name


def test_debug_checks_raise_on_gpu_and_kernels_mask_out_of_range_ids():
    """Without debug mode an id past E (or below -1) adds nothing and reads nothing out of
    bounds; with it the same call raises before any kernel runs."""
    torch.manual_seed(2)
    num_tokens = 40
    x = torch.randn(num_tokens, H, dtype=torch.bfloat16, device="cuda")
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device="cuda") / 16
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16, device="cuda") / 16
    weights, ids = random_routing(num_tokens, E, K, device="cuda")
    bad = ids.clone()
    bad[::3, 0] = E + 1000  # past the experts
    bad[1::5, 1] = -7  # below the empty-slot marker
    masked = torch.where((bad >= 0) & (bad < E), bad, -1)
    for m in (1, num_tokens):  # M = 1 runs the direct (unaligned) GEMM path
        out = fused_experts(x[:m], w13, w2, weights[:m], bad[:m])
        expected = fused_experts(x[:m], w13, w2, weights[:m], masked[:m])
        torch.cuda.synchronize()  # an out-of-bounds access would surface here
        assert torch.equal(out, expected)
        expected_ref = experts_ref(
            x[:m].cpu().double(), w13.cpu().double(), w2.cpu().double(), weights[:m].cpu(),
            masked[:m].cpu(),
        )  # fmt: skip
        assert_close(out.cpu(), expected_ref, torch.bfloat16)
    with fusedmoe.debug_checks(), pytest.raises(ValueError, match="topk_ids"):
        fused_experts(x, w13, w2, weights, bad)
    emap = torch.arange(E, dtype=torch.int32, device="cuda")
    emap[3] = 10 * E  # a map entry past the local experts: that expert is skipped
    out = fused_experts(x, w13, w2, weights, ids, expert_map=emap)
    torch.cuda.synchronize()
    assert out.isfinite().all()
    with fusedmoe.debug_checks(), pytest.raises(ValueError, match="expert_map"):
        fused_experts(x, w13, w2, weights, ids, expert_map=emap)


def test_transformers_paths_make_no_host_sync():
    transformers = pytest.importorskip("transformers")
    import fusedmoe.integrations.transformers as hf

    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=H, intermediate_size=512, moe_intermediate_size=I,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(3)
    base = transformers.Qwen3MoeForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 128, (1, 9), device="cuda")
    for impl in ("registered", "patched"):
        model = base
        if impl == "patched":
            hf.patch(model)
        else:
            model.set_experts_implementation("fusedmoe")
        names = ("MoeSparseMoeBlock", "FusedMoEBlock")
        block = next(m for m in model.modules() if type(m).__name__.endswith(names))
        h = torch.randn(1, 5, H, dtype=torch.bfloat16, device="cuda")
        with torch.inference_mode():
            expected = block(h)
            with no_sync():
                out = block(h)
        first = out[0] if isinstance(out, tuple) else out
        first_expected = expected[0] if isinstance(expected, tuple) else expected
        assert torch.equal(first, first_expected), impl
        with torch.inference_mode():
            model(ids)  # the whole model runs too


def _tiny_hf_model(transformers, name: str):
    torch.manual_seed(5)
    if name == "qwen3":
        config = transformers.Qwen3MoeConfig(
            vocab_size=128, hidden_size=H, intermediate_size=512, moe_intermediate_size=I,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
        )  # fmt: skip
        cls = transformers.Qwen3MoeForCausalLM
    else:  # grouped top-k, correction bias, shared expert
        config = transformers.DeepseekV3Config(
            vocab_size=128, hidden_size=H, intermediate_size=512, moe_intermediate_size=I,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
            n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
            n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=0,
            norm_topk_prob=True,
        )  # fmt: skip
        cls = transformers.DeepseekV3ForCausalLM
    model = cls(config).to("cuda", torch.bfloat16).eval()
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            module.e_score_correction_bias = 0.1 * torch.randn_like(bias, dtype=torch.float32)
    return model


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
@pytest.mark.parametrize("impl", ["registered", "patched"])
def test_transformers_generate_compiles_into_cuda_graphs(name, impl):
    """generate() with a static cache compiles the decode step (fullgraph, reduce-overhead):
    the experts compile into that one graph (a graph break raises under fullgraph), CUDA graph
    trees take it (no skip), and the replayed steps give eager's tokens and logits."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    import fusedmoe.integrations.transformers as hf

    model = _tiny_hf_model(transformers, name)
    if impl == "patched":
        report = hf.patch(model)
        assert report.replaced and not report.skipped, report
    else:
        model.set_experts_implementation("fusedmoe")
    ids = torch.randint(0, 128, (1, 7), device="cuda")
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)  # fmt: skip
    with torch.inference_mode():
        eager = model.generate(ids, **kwargs)
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = transformers.CompileConfig(
        fullgraph=True, mode="reduce-overhead"
    )
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch.inference_mode():
            for _ in range(3):  # compile, record, replay
                compiled = model.generate(ids, **kwargs)
    finally:
        torch._dynamo.reset()
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert torch.equal(compiled.sequences, eager.sequences)
    for step_compiled, step_eager in zip(compiled.logits, eager.logits, strict=True):
        assert_close(step_compiled.float(), step_eager.float(), torch.bfloat16)


def test_patched_block_replays_router_and_shared_expert_in_one_graph():
    """A patched DeepSeek-V3 block (grouped top-k, correction bias, a shared expert) replays one
    graph for its router's linear, the routed experts and the shared expert: eager's result and
    no host sync; in-place writes to the router and the shared expert show through; a new
    router Parameter is a new graph; a hook on the shared expert keeps it out of the graph (the
    hook runs on every call)."""
    transformers = pytest.importorskip("transformers")
    import fusedmoe.integrations.transformers as hf

    model = _tiny_hf_model(transformers, "deepseek")
    hf.patch(model)
    block = next(m for m in model.modules() if isinstance(m, hf.FusedMoEBlock))
    moe, router = block.moe, getattr(block, block.router_attr)

    def eager(h):
        moe.cuda_graph_max_tokens = 0
        try:
            return block(h)
        finally:
            moe.cuda_graph_max_tokens = 4096

    with torch.inference_mode():
        for num_tokens in (1, 5):
            h = torch.randn(1, num_tokens, H, dtype=torch.bfloat16, device="cuda")
            block(h)  # captured
            with no_sync():
                out = block(h)
            assert_close(out.float(), eager(h).float(), torch.bfloat16)
        graphs = moe._graph_state[1]
        assert graphs.captures == 2 and all("shared" in key for key in graphs._graphs)
        h = torch.randn(1, 1, H, dtype=torch.bfloat16, device="cuda")
        before = block(h)
        moe.shared_experts.down_proj.weight.mul_(-1)
        router.weight.mul_(1.5)
        after = block(h)
        assert_close(after.float(), eager(h).float(), torch.bfloat16)
        assert (after - before).abs().max() > 0.1 * before.abs().max()
        router.weight = torch.nn.Parameter(router.weight.detach().clone())
        assert torch.equal(block(h), after) and graphs.captures == 3
        seen = []
        moe.shared_experts.register_forward_hook(lambda *args: seen.append(1))
        hooked = block(h)
        assert len(seen) == 1 and graphs.captures == 4  # a graph without the shared expert
        assert torch.equal(block(h), hooked) and len(seen) == 2
        assert_close(hooked.float(), after.float(), torch.bfloat16)


def test_captures_take_their_blas_workspace_from_the_graph_pool(monkeypatch):
    """torch caches one cuBLAS workspace per stream and frees it when its cache is cleared
    (torch.compile's CUDA graph trees clear it around every recording): a graph that captured a
    GEMM with a workspace cached before the capture would write to freed memory. Each capture
    clears the cache first (the capture then allocates in the graphs' pool) and after. Whether
    freed memory gets overwritten is not observable here: the test checks the clears."""
    from fusedmoe.modular import graphs

    events = []
    clear = torch._C._cuda_clearCublasWorkspaces
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces",
        lambda: events.append(torch.cuda.is_current_stream_capturing()) or clear(),
    )  # fmt: skip
    x = torch.randn(3, H, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(H, H, dtype=torch.bfloat16, device="cuda")
    cache = graphs.GraphCache()
    with torch.inference_mode():
        (out,) = cache.run(lambda x: (x @ w,), (x,), ("a GEMM",))
        assert events == [False, False]  # before and after the capture, outside it
        torch._C._cuda_clearCublasWorkspaces()  # what a graph tree recording does
        (again,) = cache.run(lambda x: (x @ w,), (x,), ("a GEMM",))
    assert cache.captures == 1
    assert_close(out.float(), (x.float() @ w.float()), torch.bfloat16)
    assert torch.equal(again, out)


def test_graph_replay_matches_eager_and_follows_the_weights():
    """Decode calls replay CUDA graphs (fusedmoe.modular.graphs): the same result as eager
    launches for every token count of a bucket, in-place weight writes show through, a new
    tensor (a new address) is a new graph, and calls above the bucket limit stay eager."""
    layer = _layer(zero_expert_num=2, zero_expert_type="identity")
    graphs_used = 0
    with torch.inference_mode():
        for num_tokens in (1, 3, 4, 5, 17, 64, 257, 300, 4097):
            x = torch.randn(num_tokens, H, dtype=torch.bfloat16, device="cuda")
            logits = torch.randn(num_tokens, E + 2, device="cuda")
            out = layer(x, logits)
            layer.cuda_graph_max_tokens = 0
            eager = layer(x, logits)
            layer.cuda_graph_max_tokens = 4096
            assert_close(out.float(), eager.float(), torch.bfloat16)
        graphs = layer._graph_state[1]
        assert graphs.captures == 6  # buckets 1, 4, 8, 32, 64, 512; 4097 tokens ran eagerly
        graphs_used = graphs.replays
        x = torch.randn(3, H, dtype=torch.bfloat16, device="cuda")
        logits = torch.randn(3, E + 2, device="cuda")
        before = layer(x, logits)
        layer.w2_weight.mul_(-1)  # in place: the graph reads the new values
        after = layer(x, logits)
        assert graphs.replays == graphs_used + 2
        layer.cuda_graph_max_tokens = 0
        assert torch.equal(after, layer(x, logits))
        layer.cuda_graph_max_tokens = 4096
        assert not torch.equal(before, after)
        layer.w2_weight = torch.nn.Parameter(layer.w2_weight.detach().clone())  # a new address
        assert torch.equal(layer(x, logits), after)
        assert graphs.captures == 7


def test_fused_experts_graphs_follow_the_weight_addresses():
    torch.manual_seed(4)
    x = torch.randn(5, H, dtype=torch.bfloat16, device="cuda")
    weights, ids = random_routing(5, E, K, device="cuda")
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device="cuda") / 16
    w2a = torch.randn(E, H, I, dtype=torch.bfloat16, device="cuda") / 16
    w2b = torch.randn(E, H, I, dtype=torch.bfloat16, device="cuda") / 16
    with torch.inference_mode():
        a1, b1 = fused_experts(x, w13, w2a, weights, ids), fused_experts(x, w13, w2b, weights, ids)
        a2, b2 = fused_experts(x, w13, w2a, weights, ids), fused_experts(x, w13, w2b, weights, ids)
    assert torch.equal(a1, a2) and torch.equal(b1, b2) and not torch.equal(a1, b1)
    expected = experts_ref(
        x.cpu().double(), w13.cpu().double(), w2b.cpu().double(), weights.cpu(), ids.cpu()
    )
    assert_close(b2.cpu(), expected, torch.bfloat16)


def test_batch_wide_scales_stay_off_graphs():
    """Dynamic per-tensor FP8 takes its scale over the whole batch: the padding rows of a graph
    bucket would change it, so such a layer runs eagerly (and equals itself call after call)."""
    layer = _layer(quant_config="fp8_tensor")
    x = torch.randn(3, H, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(3, E, device="cuda")
    with torch.inference_mode():
        first = layer(x, logits)
        assert torch.equal(layer(x, logits), first)
    assert layer._graph_state is None


def test_each_stream_gets_workspaces_of_its_own():
    """Workspaces are shared by every layer of a process, per stream: a call on another stream
    writes buffers of its own and computes the same result."""
    from fusedmoe.modular.kernel import shared_workspaces

    layer = _layer()
    layer.cuda_graph_max_tokens = 0  # eager launches: the workspaces of the calling stream
    x = torch.randn(300, H, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(300, E, device="cuda")
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with torch.inference_mode():
        expected = layer(x, logits)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = layer(x, logits)
        main.wait_stream(side)
    assert torch.equal(out, expected)
    streams = {key[3] for key in shared_workspaces().buffers if key[1].type == "cuda"}
    assert {main.cuda_stream, side.cuda_stream} <= streams


def test_layers_take_turns_on_the_shared_graph_arenas():
    """Prefill-sized calls replay graphs too; every graph of the process reads its inputs from
    and writes its outputs to shared arenas: layers and sizes taking turns still each get
    their own result, equal to eager launches."""
    layers = [_layer() for _ in range(2)]
    for i, layer in enumerate(layers):
        with torch.no_grad():
            layer.w2_weight.mul_(1 + i)  # two different functions
    torch.manual_seed(8)
    calls = [(layer, n) for n in (700, 3, 1500, 700) for layer in layers]
    inputs = [
        (torch.randn(n, H, dtype=torch.bfloat16, device="cuda"), torch.randn(n, E, device="cuda"))
        for _, n in calls
    ]
    with torch.inference_mode():
        replayed = [layer(x, logits) for (layer, _), (x, logits) in zip(calls, inputs, strict=True)]
        for layer in layers:
            layer.cuda_graph_max_tokens = 0
        eager = [layer(x, logits) for (layer, _), (x, logits) in zip(calls, inputs, strict=True)]
    assert all(layer._graph_state[1].captures == 3 for layer in layers)  # 768, 4, 1536
    for got, expected in zip(replayed, eager, strict=True):  # a bucket's tiles may differ
        assert_close(got.float(), expected.float(), torch.bfloat16)

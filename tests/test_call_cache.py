"""What the per-call path resolves once and looks up after (issue: the fast kernels reach every
caller): fused_experts' resolved calls, the transformers experts layout, and the layer's gated
forward whose router and shared experts may join its CUDA graph. Every cached answer must be the
one the full path would give: a changed weight, a bad value or a hook shows through.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import fusedmoe.functional as functional
from fusedmoe import FusedMoE, RouterGate, fused_experts
from fusedmoe.modular.graphs import graph_reads as _graph_reads
from fusedmoe.modular.graphs import plain_call
from tests.helpers import assert_close
from tests.reference import experts_ref, random_experts

H, I, E, K = 32, 16, 8, 2


def _capturable(*modules) -> bool:
    """Whether a CUDA graph may stand in for calls of these modules."""
    return _graph_reads(*modules) is not None


def _call_inputs(num_tokens: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    experts = random_experts(E, H, I)
    x = torch.randn(num_tokens, H)
    ids = torch.rand(num_tokens, E).argsort(dim=1)[:, :K].to(torch.int32)
    weights = torch.rand(num_tokens, K) + 0.1
    return x, experts["w13"], experts["w2"], weights, ids


def _counting(monkeypatch) -> list[int]:
    """Counts the calls of fused_experts' full checks (check_expert_weights), from an empty
    cache (a freed tensor's address may come back in a later test's tensors)."""
    monkeypatch.setattr(functional, "_CALLS", OrderedDict())
    calls = []
    check = functional.check_expert_weights
    monkeypatch.setattr(
        functional, "check_expert_weights", lambda *a, **k: calls.append(1) or check(*a, **k)
    )
    return calls


@torch.inference_mode()
def test_fused_experts_checks_a_signature_once(monkeypatch):
    x, w13, w2, weights, ids = _call_inputs()
    calls = _counting(monkeypatch)
    first = fused_experts(x, w13, w2, weights, ids)
    second = fused_experts(x, w13, w2, weights, ids)
    assert torch.equal(first, second) and len(calls) == 1
    fused_experts(x[:3], w13, w2, weights[:3], ids[:3])  # another token count: the same entry
    assert len(calls) == 1
    # another activation or weight address is another signature
    fused_experts(x, w13, w2, weights, ids, activation="gelu")
    fused_experts(x, w13, w2.clone(), weights, ids)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="topk_ids has 3 tokens, hidden_states 5"):
        fused_experts(x, w13, w2, weights[:3], ids[:3])


@torch.inference_mode()
def test_a_cached_signature_computes_with_the_tensors_it_is_given(monkeypatch):
    _counting(monkeypatch)
    x, w13, w2, weights, ids = _call_inputs()
    fused_experts(x, w13, w2, weights, ids)
    w2.mul_(-2.0)  # in place: same address, same signature
    x2, weights2 = torch.randn_like(x), torch.rand_like(weights) + 0.1
    out = fused_experts(x2, w13, w2, weights2, ids)
    expected = experts_ref(x2.double(), w13.double(), w2.double(), weights2, ids)
    assert_close(out, expected, torch.float32)


@torch.inference_mode()
def test_a_cached_signature_still_checks_values_and_new_metadata(monkeypatch):
    _counting(monkeypatch)
    x, w13, w2, weights, ids = _call_inputs()
    fused_experts(x, w13, w2, weights, ids)
    bad = ids.clone()
    bad[2, 1] = E  # out of range: read on the CPU on every call
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        fused_experts(x, w13, w2, weights, bad)
    with pytest.raises(TypeError, match="topk_ids must have dtype"):
        fused_experts(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="same shape"):
        fused_experts(x, w13, w2, weights[:, :1], ids)
    emap = torch.arange(E, dtype=torch.int32)
    fused_experts(x, w13, w2, weights, ids, expert_map=emap)
    emap[3] = E  # past the local experts
    with pytest.raises(ValueError, match="expert_map must lie in"):
        fused_experts(x, w13, w2, weights, ids, expert_map=emap)


def test_autograd_calls_are_not_cached(monkeypatch):
    x, w13, w2, weights, ids = _call_inputs()
    w13.requires_grad_(True)
    calls = _counting(monkeypatch)
    for _ in range(2):
        fused_experts(x, w13, w2, weights, ids).sum().backward()
    assert len(calls) == 2 and w13.grad is not None


def test_fused_experts_exports():
    """torch.export traces the call with fake tensors: nothing may ask one for its address."""

    class Experts(nn.Module):
        def __init__(self, w13, w2):
            super().__init__()
            self.w13, self.w2 = nn.Parameter(w13), nn.Parameter(w2)

        def forward(self, x, weights, ids):
            return fused_experts(x, self.w13, self.w2, weights, ids, backend="triton")

    x, w13, w2, weights, ids = _call_inputs()
    module = Experts(w13, w2)
    with torch.no_grad():
        program = torch.export.export(module, (x, weights, ids), strict=False)
        expected = module(x, weights, ids)
        assert_close(program.module()(x, weights, ids), expected, torch.float32)


# ---- transformers' experts modules: their settings read once ---------------------------------
def _qwen3_experts():
    transformers = pytest.importorskip("transformers")
    import fusedmoe.integrations.transformers as hf

    config = transformers.Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K
    )
    config._experts_implementation = "fusedmoe"
    torch.manual_seed(2)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    experts = block.experts
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn_like(param))
    return hf, experts


@torch.inference_mode()
def test_registered_experts_follow_a_replaced_or_rewritten_parameter():
    hf, experts = _qwen3_experts()
    x, _, _, weights, ids = _call_inputs(seed=3)
    first = hf.fusedmoe_experts_forward(experts, x, ids, weights)
    experts.down_proj = nn.Parameter(-experts.down_proj)  # a new Parameter
    assert_close(hf.fusedmoe_experts_forward(experts, x, ids, weights), -first, torch.float32)
    experts.down_proj.mul_(-0.5)  # in place
    assert_close(hf.fusedmoe_experts_forward(experts, x, ids, weights), 0.5 * first, torch.float32)
    experts.to(torch.float64)  # cast: new storage behind the same Parameter objects
    out = hf.fusedmoe_experts_forward(experts, x.double(), ids, weights.double())
    assert out.dtype == torch.float64
    assert_close(out, 0.5 * first.double(), torch.float32)


def test_registered_transposed_experts_train_after_an_inference_call():
    """gpt-oss stores its experts transposed: the views taken in a no_grad call (an eval, a
    generate) must not stand in for those of a later training call."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss import modeling_gpt_oss

    import fusedmoe.integrations.transformers as hf

    config = transformers.GptOssConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K
    )
    config._experts_implementation = "fusedmoe"
    torch.manual_seed(6)
    experts = modeling_gpt_oss.GptOssExperts(config)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    x, _, _, weights, ids = _call_inputs(seed=7)
    with torch.no_grad():
        hf.fusedmoe_experts_forward(experts, x, ids, weights)
    hf.fusedmoe_experts_forward(experts, x, ids, weights).square().sum().backward()
    for name, param in experts.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


# ---- the gated forward: the router and shared experts a graph may capture ----------------------
class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(H, 2 * I, bias=False)
        self.down = nn.Linear(I, H, bias=False)

    def forward(self, x):
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


def _linear_logits(router: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x, router.weight)


def _gated_layer():
    torch.manual_seed(4)
    shared, shared_gate = _MLP(), nn.Linear(H, 1, bias=False)
    layer = FusedMoE(
        E, K, H, I, params_dtype=torch.float32, shared_experts=shared,
        shared_expert_gate=shared_gate,
    )  # fmt: skip
    return layer, RouterGate(nn.Linear(H, E, bias=False), _linear_logits)


@torch.inference_mode()
@pytest.mark.parametrize("lead", [(5,), (2, 3), (0,)])
def test_forward_gated_is_forward_with_the_gates_logits(lead):
    layer, gate = _gated_layer()
    x = torch.randn(*lead, H)
    expected = layer(x, _linear_logits(gate.module, x))
    assert torch.equal(layer.forward_gated(x, gate), expected)


def test_forward_gated_checks_its_arguments():
    layer, gate = _gated_layer()
    x = torch.randn(3, H)
    with pytest.raises(TypeError, match="gate must be a RouterGate"):
        layer.forward_gated(x, gate.module)
    with pytest.raises(ValueError, match="one row per token"):
        layer.forward_gated(x, RouterGate(gate.module, lambda m, x: _linear_logits(m, x)[:1]))
    with pytest.raises(TypeError, match=r"hidden_states must be a torch\.Tensor"):
        layer.forward_gated(x.tolist(), gate)


def test_forward_gated_trains_the_router_and_the_shared_experts():
    layer, gate = _gated_layer()
    x = torch.randn(4, H)
    layer.forward_gated(x, gate).square().sum().backward()
    for module in (gate.module, layer.shared_experts, layer.shared_expert_gate):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())


def _transformers_mlp():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    config = transformers.Qwen2MoeConfig(hidden_size=H, intermediate_size=2 * I)
    return modeling_qwen2_moe.Qwen2MoeMLP(config).eval()


def test_only_plain_modules_may_be_captured():
    """A graph stands in for transformers' and torch's own modules in eval mode, called plainly;
    never for a module of another package (its forward may read Python state: a LoRA adapter
    merged or disabled), a module in training mode, or one with a hook or a forward of its own."""
    mlp = _transformers_mlp()
    assert _capturable(mlp, None) and _capturable(nn.Linear(H, E).eval())
    assert not _capturable(_MLP().eval())  # not transformers', torch's or fusedmoe's
    assert not _capturable(mlp.train())
    mlp.eval()
    handle = mlp.down_proj.register_forward_hook(lambda *args: None)  # on a submodule
    assert not _capturable(mlp)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)  # global
    try:
        assert not _capturable(mlp) and not plain_call(nn.Linear(2, 2))
    finally:
        handle.remove()
    mlp.up_proj.forward = lambda x: x  # an instance forward (accelerate's offloading sets one)
    assert not _capturable(mlp)
    del mlp.up_proj.forward
    assert _capturable(mlp)
    compiled = nn.Linear(2, 2)
    compiled.compile()
    assert not plain_call(compiled)


def test_graph_reads_every_tensor_of_the_trees_once():
    """_graph_reads gives the address of every parameter and buffer of the trees, nested ones
    included, a module shared by two trees once; a tensor replaced (or its storage swapped)
    changes them, so a graph keyed by them is not replayed over stale weights."""
    mlp = _transformers_mlp()
    gate = nn.Linear(H, 1).eval()
    gate.register_buffer("scale", torch.ones(1))
    expected = {t.data_ptr() for t in (*mlp.parameters(), *gate.parameters(), *gate.buffers())}
    reads = _graph_reads(mlp, None, gate, mlp.down_proj)  # down_proj twice: read once
    assert len(reads) == len(expected) and set(reads) == expected
    for replace in ("parameter", "storage"):
        old = mlp.up_proj.weight.data_ptr()
        if replace == "parameter":
            mlp.up_proj.weight = nn.Parameter(torch.randn_like(mlp.up_proj.weight))
        else:
            mlp.up_proj.weight.data = torch.randn_like(mlp.up_proj.weight)
        reads = _graph_reads(mlp, None, gate)
        assert mlp.up_proj.weight.data_ptr() in reads and old not in reads
    assert _graph_reads() == () and _graph_reads(None) == ()


@pytest.mark.parametrize("wrap", ["global hook", "instance forward"])
def test_a_patched_block_calls_its_layer_through_its_wrappers(wrap):
    """The block hands its layer the router (forward_gated) only when calling the layer would
    run its forward and nothing else; otherwise it calls the layer, whose wrappers run."""
    transformers = pytest.importorskip("transformers")
    import fusedmoe.integrations.transformers as hf

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=H, intermediate_size=2 * I, moe_intermediate_size=I,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(8)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    hf.patch(model)
    block = next(m for m in model.modules() if isinstance(m, hf.FusedMoEBlock))
    h = torch.randn(1, 3, H)
    with torch.inference_mode():
        expected = block(h)
        seen = []
        if wrap == "global hook":
            handle = nn.modules.module.register_module_forward_hook(
                lambda module, args, out: seen.append(type(module).__name__)
            )
            try:
                out = block(h)
            finally:
                handle.remove()
        else:
            forward = block.moe.forward
            block.moe.forward = lambda *args: seen.append("FusedMoE") or forward(*args)
            out = block(h)
    assert "FusedMoE" in seen
    assert torch.equal(out, expected)


def test_compiled_layer_reads_router_tensors_as_buffers():
    """Under torch.compile the correction bias (held by the router too) is a graph input of the
    layer's buffer, static for CUDA graph trees, not a copy-per-replay input of the router's
    attribute: every input of the traced graph is x, the logits or a parameter or buffer."""
    layer = FusedMoE(
        E, 2, H, I, use_grouped_topk=True, num_expert_group=2, topk_group=1,
        scoring_func="sigmoid", e_score_correction_bias=torch.randn(E),
        params_dtype=torch.float32, backend="triton",
    ).eval()  # fmt: skip
    x, logits = torch.randn(3, H), torch.randn(3, E)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            expected = layer(x, logits)
            assert_close(torch.compile(layer, backend=backend)(x, logits), expected, torch.float32)
    finally:
        torch._dynamo.reset()
    inputs = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "placeholder"]
    assert any("e_score_correction_bias" in name for name in inputs), inputs
    assert all(
        name.startswith(("L_hidden_states_", "L_router_logits_"))
        or "_parameters_" in name
        or "_buffers_" in name
        for name in inputs
    ), inputs


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_a_patched_block_compiles_whole(name):
    """Under torch.compile the gated forward computes the logits in the traced graph (no CUDA
    graph of fusedmoe's own): fullgraph, eager's result."""
    pytest.importorskip("transformers")
    import fusedmoe.integrations.transformers as hf
    from tests.test_bench_eager import _benchmark

    bench = _benchmark("bench_hf_model")
    model = bench.build_model(name, 2, "cpu", dtype=torch.float32, **bench.TINY_SIZES[name])
    hf.patch(model, backend="triton")
    block = next(m for m in model.modules() if isinstance(m, hf.FusedMoEBlock))
    h = torch.randn(1, 3, model.config.hidden_size)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            expected = block(h)
            compiled = torch.compile(block, fullgraph=True, backend="eager")(h)
    finally:
        torch._dynamo.reset()
    assert_close(compiled, expected, torch.float32)

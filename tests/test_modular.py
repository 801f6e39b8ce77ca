"""The modular kernel: chunking over M, workspace reuse, the top-k reduce, hidden-size padding.

Legend: M tokens, H hidden, I intermediate, E experts, k top-k.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

from fusedmoe import FusedMoE, fused_experts
from fusedmoe.experts.torch_ref import TorchExperts
from fusedmoe.modular import (
    ActivationSpec,
    ExpertWeights,
    FusedMoEModularKernel,
    NoEPPrepareFinalize,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
    WorkspaceShapes,
)
from fusedmoe.modular.kernel import CHUNK_SIZE_ENV, WorkspaceCache, shared_workspaces
from tests.helpers import assert_close, assert_equal, poison_
from tests.reference import experts_ref, random_experts, reference, softmax_topk_ref

H, I, E = 32, 16, 8


def random_routing(num_tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(num_tokens, E).argsort(dim=1)[:, :top_k].to(torch.int32)
    return torch.rand(num_tokens, top_k) + 0.1, ids


def as_weights(experts: dict) -> ExpertWeights:
    return ExpertWeights(experts["w13"], experts["w2"], experts["w13_bias"], experts["w2_bias"])


class RecordingExperts(TorchExperts):
    """The torch backend, remembering the token count and hidden size of every apply call."""

    name = "torch_recording"
    calls: ClassVar[list[tuple[int, ...]]] = []

    def apply(self, call):
        type(self).calls.append(tuple(call.hidden_states.shape))
        super().apply(call)


@pytest.fixture
def recording():
    RecordingExperts.calls = []
    yield RecordingExperts
    RecordingExperts.calls = []


# ---- chunking ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_tokens", "chunk_size"), [(37, 5), (37, 37), (37, 1), (16, 8)])
def test_chunking_gives_identical_results(num_tokens, chunk_size, recording):
    experts = random_experts(E, H, I, bias=True)
    x = torch.randn(num_tokens, H)
    weights, ids = random_routing(num_tokens, 3)
    spec = ActivationSpec.make("silu")
    whole = FusedMoEModularKernel(NoEPPrepareFinalize(), TorchExperts(), chunk_size=1 << 20)
    chunked = FusedMoEModularKernel(NoEPPrepareFinalize(), recording(), chunk_size=chunk_size)
    expected = whole.forward(
        x, as_weights(experts), weights, ids, activation=spec, global_num_experts=E
    )
    out = chunked.forward(
        x, as_weights(experts), weights, ids, activation=spec, global_num_experts=E
    )
    sizes = [m for m, _ in recording.calls]
    assert sizes == [min(chunk_size, num_tokens - s) for s in range(0, num_tokens, chunk_size)]
    # bit-identical: every token's result depends on that token alone
    assert_equal(out, expected, what="chunked output")
    assert_close(out, reference(x, experts, weights, ids))


def test_chunk_size_from_environment(monkeypatch, recording):
    monkeypatch.setenv(CHUNK_SIZE_ENV, "8")
    chunked = FusedMoE(E, 2, H, I, params_dtype=torch.float32, backend=recording)
    monkeypatch.delenv(CHUNK_SIZE_ENV)
    whole = FusedMoE(E, 2, H, I, params_dtype=torch.float32, backend=recording)
    whole.load_state_dict(chunked.state_dict())
    x = torch.randn(37, H)
    logits = torch.randn(37, E)
    out = chunked(x, logits)
    assert [m for m, _ in recording.calls] == [8, 8, 8, 8, 5]
    recording.calls.clear()
    assert_equal(out, whole(x, logits), what="chunked layer output")
    assert [m for m, _ in recording.calls] == [37]
    weights, ids = softmax_topk_ref(logits, 2)
    experts = {"w13": whole.w13_weight.detach(), "w2": whole.w2_weight.detach()}
    assert_close(out, experts_ref(x, experts["w13"], experts["w2"], weights, ids))


@pytest.mark.parametrize("value", ["0", "-4", "many"])
def test_bad_chunk_size_from_environment(monkeypatch, value):
    monkeypatch.setenv(CHUNK_SIZE_ENV, value)
    with pytest.raises(ValueError, match=CHUNK_SIZE_ENV):
        FusedMoEModularKernel(NoEPPrepareFinalize(), TorchExperts())


def test_bad_chunk_size_argument():
    with pytest.raises(ValueError, match="chunk_size"):
        FusedMoEModularKernel(NoEPPrepareFinalize(), TorchExperts(), chunk_size=0)


# ---- workspaces -------------------------------------------------------------------------------


def test_workspaces_reused_between_calls():
    experts = random_experts(E, H, I)
    spec = ActivationSpec.make("silu")
    # a cache of its own: the shared one may have grown in earlier tests
    kernel = FusedMoEModularKernel(
        NoEPPrepareFinalize(), TorchExperts(), workspaces=WorkspaceCache()
    )

    def call(num_tokens):
        x = torch.randn(num_tokens, H)
        weights, ids = random_routing(num_tokens, 2)
        out = kernel.forward(
            x, as_weights(experts), weights, ids, activation=spec, global_num_experts=E
        )
        assert_close(out, reference(x, experts, weights, ids), what=f"M={num_tokens}")

    def pointers():
        return {key: buf.data_ptr() for key, buf in kernel.workspaces.buffers.items()}

    call(16)
    steady = pointers()
    assert len(steady) == 3  # workspace13, workspace2, the per-slot output
    for buf in kernel.workspaces.buffers.values():
        poison_(buf)  # stale contents (of any earlier call) must never leak into a result
    call(16)
    call(5)
    assert pointers() == steady
    call(40)  # larger: the buffers grow once
    grown = pointers()
    assert grown.keys() == steady.keys() and grown != steady  # the per-slot output grew
    call(40)
    call(1)
    assert pointers() == grown


@torch.inference_mode()
def test_layer_reuses_workspaces():
    layer = FusedMoE(E, 2, H, I, params_dtype=torch.float32, backend="torch")  # modular kernel
    x, logits = torch.randn(16, H), torch.randn(16, E)
    layer(x, logits)
    _, kernel = layer._kernel(x.device, x.dtype, requires_grad=False)
    before = {k: b.data_ptr() for k, b in kernel.workspaces.buffers.items()}
    assert before
    layer(torch.randn(16, H), torch.randn(16, E))
    assert {k: b.data_ptr() for k, b in kernel.workspaces.buffers.items()} == before


@pytest.mark.parametrize("backend", ["torch", "triton"])
@torch.inference_mode()
def test_layers_share_one_set_of_workspaces(backend):
    """A model's layers hold one set of workspaces between them, not one each; taking turns on
    it, every layer still computes its own function (each call writes what it reads)."""
    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(11)
    layers = [FusedMoE(E, 2, H, I, params_dtype=torch.float32, backend=backend) for _ in range(3)]
    kernels = [layer._kernel(torch.device("cpu"), torch.float32, False)[1] for layer in layers]
    assert all(k.workspaces is shared_workspaces() for k in kernels)
    x = torch.randn(9, H)
    for num_tokens in (9, 3, 9):  # calls of other sizes in between
        for layer in layers:
            logits = torch.randn(num_tokens, E)
            out = layer(x[:num_tokens], logits)
            weights, ids = layer.router.select_experts(x[:num_tokens], logits)
            expected = experts_ref(
                x[:num_tokens].double(), layer.w13_weight.double(), layer.w2_weight.double(),
                weights, ids,
            )  # fmt: skip
            assert_close(out, expected, what=f"M={num_tokens}")


def test_threads_get_workspaces_of_their_own():
    """Two layers called from two threads at once: each thread writes buffers of its own."""
    import threading

    torch.manual_seed(12)
    layers = [FusedMoE(E, 2, H, I, params_dtype=torch.float32, backend="torch") for _ in range(2)]
    xs = [torch.randn(512, H) for _ in layers]
    logits = [torch.randn(512, E) for _ in layers]
    with torch.inference_mode():
        expected = [layer(x, lg) for layer, x, lg in zip(layers, xs, logits, strict=True)]
    wrong = [0, 0]

    def work(i):
        with torch.inference_mode():
            for _ in range(20):
                wrong[i] += not torch.equal(layers[i](xs[i], logits[i]), expected[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == [0, 0]


def test_copies_of_a_kernel_share_the_process_workspaces():
    import copy
    import pickle

    shared = FusedMoEModularKernel(NoEPPrepareFinalize(), TorchExperts())
    shared.workspaces.get("workspace13", (4, 4), torch.float32, torch.device("cpu"))
    for clone in (copy.deepcopy(shared), pickle.loads(pickle.dumps(shared))):
        assert clone.workspaces is shared_workspaces()
    own = FusedMoEModularKernel(NoEPPrepareFinalize(), TorchExperts(), workspaces=WorkspaceCache())
    own.workspaces.get("workspace13", (4, 4), torch.float32, torch.device("cpu"))
    clone = copy.deepcopy(own)
    assert clone.workspaces is not own.workspaces and not clone.workspaces.buffers
    own.workspaces.clear()
    assert not own.workspaces.buffers
    with pytest.raises(ValueError, match="CUDA graphs"):
        shared_workspaces(retain=True).clear()


def test_a_retained_cache_grows_geometrically():
    cache = WorkspaceCache(retain=True)
    cpu = torch.device("cpu")
    for rows in range(1, 65):
        cache.get("workspace13", (rows, 8), torch.float32, cpu)
    kept = sum(b.numel() for b in cache.retired) + sum(b.numel() for b in cache.buffers.values())
    assert kept < 4 * 64 * 8  # doubling: not the sum of every size asked for


def test_a_kernel_may_keep_workspaces_of_its_own():
    own = WorkspaceCache()
    kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), TorchExperts(), workspaces=own)
    assert kernel.workspaces is own and own is not shared_workspaces()
    assert FusedMoEModularKernel(
        NoEPPrepareFinalize(), TorchExperts(), retain_workspaces=True
    ).workspaces is shared_workspaces(retain=True)
    with pytest.raises(ValueError, match="retain"):
        FusedMoEModularKernel(
            NoEPPrepareFinalize(), TorchExperts(), retain_workspaces=True, workspaces=own
        )


# ---- TopKWeightAndReduce ----------------------------------------------------------------------


def _slots(num_tokens=9, top_k=3):
    y = torch.randn(num_tokens, top_k, H)
    weights = torch.rand(num_tokens, top_k)
    ids = torch.randint(0, E, (num_tokens, top_k), dtype=torch.int32)
    return y, weights, ids


def _weighted_sum(y, weights):
    out = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float64)
    for m in range(y.shape[0]):
        for j in range(y.shape[1]):
            out[m] += float(weights[m, j]) * y[m, j].double()
    return out


def test_reduce_contiguous_is_the_weighted_sum():
    y, weights, ids = _slots()
    output = poison_(torch.empty(9, H))
    result = TopKWeightAndReduceContiguous().apply(output, y, weights, ids, False)
    assert result is output
    assert_close(output, _weighted_sum(y, weights))


def test_reduce_contiguous_weight_on_input_is_a_plain_sum():
    y, weights, ids = _slots(top_k=1)
    output = poison_(torch.empty(9, H))
    TopKWeightAndReduceContiguous().apply(output, y, weights, ids, True)
    assert_close(output, y[:, 0].double())


def test_reduce_contiguous_allocates_when_no_output():
    y, weights, ids = _slots()
    result = TopKWeightAndReduceContiguous().apply(None, y.to(torch.bfloat16), weights, ids, False)
    assert result.dtype == torch.bfloat16 and result.shape == (9, H)
    assert_close(result, _weighted_sum(y.to(torch.bfloat16), weights), torch.bfloat16)


def test_reduce_noop_copies():
    reduced = torch.randn(9, H)
    output = poison_(torch.empty(9, H))
    _, weights, ids = _slots()
    assert TopKWeightAndReduceNoOp().apply(output, reduced, weights, ids, False) is output
    assert_equal(output, reduced)
    assert TopKWeightAndReduceNoOp().apply(None, reduced, weights, ids, False) is reduced
    assert TopKWeightAndReduceNoOp().apply(reduced, reduced, weights, ids, False) is reduced


def test_reduce_delegate_is_resolved_by_prepare_finalize():
    y, weights, ids = _slots()
    with pytest.raises(AssertionError, match="resolved"):
        TopKWeightAndReduceDelegate().apply(None, y, weights, ids, False)
    pf = NoEPPrepareFinalize()
    assert isinstance(
        pf.resolve_reduce(TopKWeightAndReduceDelegate()), TopKWeightAndReduceContiguous
    )
    noop = TopKWeightAndReduceNoOp()
    assert pf.resolve_reduce(noop) is noop
    output = poison_(torch.empty(9, H))
    pf.finalize(output, y, weights, ids, False, TopKWeightAndReduceDelegate())
    assert_close(output, _weighted_sum(y, weights))


class ReducingExperts(TorchExperts):
    """A backend that does the weighted top-k sum itself: finalize must only copy (NoOp)."""

    name = "torch_reducing"

    def workspace_shapes(self, M, N, K, top_k, global_num_experts, local_num_experts, activation):
        shapes = super().workspace_shapes(
            M, N, K, top_k, global_num_experts, local_num_experts, activation
        )
        return WorkspaceShapes(shapes.workspace13, shapes.workspace2, (M, K))

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOp()

    def apply(self, call):
        num_tokens, top_k = call.topk_ids.shape
        output = call.output
        slots = torch.empty(num_tokens, top_k, output.shape[1], dtype=output.dtype)
        super().apply(dataclasses.replace(call, output=slots))
        output.copy_(torch.einsum("mk,mkh->mh", call.topk_weights.float(), slots.float()))


class DelegatingExperts(TorchExperts):
    """A backend that leaves the reduce to the prepare/finalize's default."""

    name = "torch_delegating"

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceDelegate()


@pytest.mark.parametrize("backend", [ReducingExperts, DelegatingExperts])
def test_backends_with_other_reduces_through_the_layer(backend):
    layer = FusedMoE(E, 3, H, I, params_dtype=torch.float32, has_bias=True, backend=backend)
    assert layer.backend_choice().name == backend.name
    x, logits = torch.randn(37, H), torch.randn(37, E)
    weights, ids = softmax_topk_ref(logits, 3)
    experts = {
        "w13": layer.w13_weight.detach(),
        "w2": layer.w2_weight.detach(),
        "w13_bias": layer.w13_bias.detach(),
        "w2_bias": layer.w2_bias.detach(),
    }
    assert_close(layer(x, logits), reference(x, experts, weights, ids))


def test_prepare_weight_on_input_needs_top_1():
    weights, ids = random_routing(4, 2)
    with pytest.raises(ValueError, match="top_k == 1"):
        NoEPPrepareFinalize().prepare(torch.randn(4, H), weights, ids, E, None, True, None)


def test_prepare_weight_on_input_scales_x():
    x = torch.randn(4, H)
    weights, ids = random_routing(4, 1)
    prepared = NoEPPrepareFinalize().prepare(x, weights, ids, E, None, True, None)
    assert_close(prepared.a1q, x.double() * weights.double())
    assert prepared.a1q_scale is None


# ---- hidden-size padding ----------------------------------------------------------------------


class Aligned16Experts(RecordingExperts):
    """The torch backend, declaring that it needs the hidden size to be a multiple of 16."""

    name = "torch_aligned16"
    hidden_size_alignment = 16


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", "relu2_no_mul"])
def test_hidden_size_padding(activation, has_bias):
    Aligned16Experts.calls = []
    hidden = 40
    kwargs = dict(activation=activation, has_bias=has_bias, params_dtype=torch.float32)
    plain = FusedMoE(E, 2, hidden, I, **kwargs)
    padded = FusedMoE(E, 2, hidden, I, backend=Aligned16Experts, **kwargs)
    padded.load_state_dict(plain.state_dict())
    x, logits = torch.randn(37, hidden), torch.randn(37, E)
    out = padded(x, logits)
    assert out.shape == (37, hidden)
    assert Aligned16Experts.calls == [(37, 48)]  # the backend saw H padded to 48
    assert_close(out, plain(x, logits), what="padded vs unpadded")

    # new weights reach the padded copy the backend consumes
    new = FusedMoE(E, 2, hidden, I, **kwargs)
    padded.load_state_dict(new.state_dict())
    weights, ids = softmax_topk_ref(logits, 2)
    experts = {
        "w13": new.w13_weight.detach(),
        "w2": new.w2_weight.detach(),
        "w13_bias": None if new.w13_bias is None else new.w13_bias.detach(),
        "w2_bias": None if new.w2_bias is None else new.w2_bias.detach(),
    }
    assert_close(padded(x, logits), reference(x, experts, weights, ids, activation=activation))


def test_hidden_size_padding_sees_writes_through_data():
    hidden = 40
    layer = FusedMoE(E, 2, hidden, I, params_dtype=torch.float32, backend=Aligned16Experts)
    x, logits = torch.randn(5, hidden), torch.randn(5, E)
    layer(x, logits)  # builds the padded copy
    new_w13, new_w2 = torch.randn(E, 2 * I, hidden) * 0.3, torch.randn(E, hidden, I) * 0.3
    layer.w13_weight.data.copy_(new_w13)
    layer.w2_weight.data.copy_(new_w2)
    weights, ids = softmax_topk_ref(logits, 2)
    experts = {"w13": new_w13, "w2": new_w2, "w13_bias": None, "w2_bias": None}
    assert_close(layer(x, logits), reference(x, experts, weights, ids))


def test_fused_experts_after_inference_mode_then_no_grad():
    """The cached kernel's workspaces are never inference tensors: a call under no_grad after
    one under inference_mode writes them without error."""
    experts = random_experts(4, 16, 8, dtype=torch.float32)
    x = torch.randn(3, 16)
    weights, ids = softmax_topk_ref(torch.randn(3, 4), 2)
    with torch.inference_mode():
        first = fused_experts(x, experts["w13"], experts["w2"], weights, ids.to(torch.int32))
    with torch.no_grad():
        second = fused_experts(x, experts["w13"], experts["w2"], weights, ids.to(torch.int32))
    assert torch.equal(first, second)


def test_rows_independent_says_which_schemes_take_a_batch_wide_scale():
    """CUDA-graph replay pads a call to its bucket with stale rows: only schemes whose
    activation scales are per token (or given) may replay."""
    from fusedmoe.quant.config import quantize_experts

    experts = random_experts(4, 64, 32, dtype=torch.float32)
    expected = {"fp8_tensor": False, "nvfp4": False, "fp8_block": True, "int8": True}
    for scheme, independent in expected.items():
        _, _, qc = quantize_experts(experts["w13"], experts["w2"], scheme)
        assert qc.rows_independent is independent, scheme
    scale = torch.tensor([0.05])
    _, _, static = quantize_experts(
        experts["w13"], experts["w2"], "fp8_tensor", a1_scale=scale, a2_scale=scale
    )
    assert static.rows_independent
    assert static.cache_key() != qc.cache_key() and static.cache_key() == static.cache_key()


def test_extensions_written_before_training_keep_working():
    """A PrepareFinalize whose prepare takes no requires_grad runs inference calls, and an
    Experts whose supports_autograd takes no quant config is asked for unquantized calls."""
    from fusedmoe.modular.experts import _supports_autograd

    class OldPrepare(NoEPPrepareFinalize):
        def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                    apply_router_weight_on_input, quant_config,
                    defer_input_quant=False):  # fmt: skip
            return super().prepare(
                a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config, defer_input_quant,
            )  # fmt: skip

    class OldExperts(TorchExperts):
        @classmethod
        def supports_autograd(cls):
            return True

    experts = random_experts(E, H, I)
    x = torch.randn(7, H)
    weights, ids = random_routing(7, 3)
    spec = ActivationSpec.make("silu")
    kernel = FusedMoEModularKernel(OldPrepare(), TorchExperts())
    out = kernel.forward(
        x, as_weights(experts), weights, ids, activation=spec, global_num_experts=E
    )
    expected = FusedMoEModularKernel(NoEPPrepareFinalize(), TorchExperts()).forward(
        x, as_weights(experts), weights, ids, activation=spec, global_num_experts=E
    )
    assert_equal(out, expected, what="old-style prepare")
    assert _supports_autograd(OldExperts, None)
    assert not _supports_autograd(OldExperts, object())

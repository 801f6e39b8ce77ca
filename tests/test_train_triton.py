"""Training on the triton backend's kernels (fusedmoe.kernels.moe_train): the forward that
autograd records and its backward, against autograd of an independent float64 reference.

Without a GPU the kernels run on Triton's CPU interpreter (small shapes, float32); the `gpu`
tests at the end run the compiled kernels in bf16 at larger sizes, under torch.compile too.
Legend: M tokens, k top-k, E experts (E_l local), H hidden, I intermediate, N = 2I or I.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fusedmoe import FusedMoE, fused_experts, select_backend
from fusedmoe.modular.types import MoEProblem
from tests.helpers import assert_close
from tests.reference import ALL_ACTIVATIONS, NON_GATED, activation_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, E = 32, 24, 6  # I = 24: the act kernel's and the GEMMs' column tiles have masked tails


def dense_ref(x, w13, w2, weights, ids, *, activation, params=None, w13_bias=None,
              w2_bias=None, expert_map=None, weight_on_input=False):  # fmt: skip
    """float64, differentiable in every input: out[m] = sum_j w[m, j] (act(x[m] @ w13[e].T +
    b13[e]) @ w2[e].T + b2[e]) over the slots routed here (weight on x instead, on input)."""
    ids = ids.long()
    local = ids if expert_map is None else expert_map.long()[ids.clamp(min=0)]
    routed = ((ids >= 0) & (local >= 0)).double()  # [M, k]
    e = local.clamp(min=0)
    w = weights.double()
    xin = x.double()[:, None, :] * (w[..., None] if weight_on_input else 1.0)  # [M, k, H]
    h = torch.einsum("mkh,mknh->mkn", xin, w13.double()[e])
    if w13_bias is not None:
        h = h + w13_bias.double()[e]
    a = activation_ref(activation, h, **(params or {}))
    y = torch.einsum("mki,mkhi->mkh", a, w2.double()[e])
    if w2_bias is not None:
        y = y + w2_bias.double()[e]
    y = y * routed[..., None]
    return y.sum(1) if weight_on_input else (y * w[..., None]).sum(1)


def _leaves(num_tokens, top_k, activation, *, bias, dtype=torch.float32, num_experts=E):
    n = I if activation in NON_GATED else 2 * I
    leaves = {
        "x": torch.randn(num_tokens, H),
        "w13": torch.randn(num_experts, n, H) / H**0.5,
        "w2": torch.randn(num_experts, H, I) / I**0.5,
        "weights": torch.rand(num_tokens, top_k) + 0.1,
    }
    if bias:
        leaves |= {"w13_bias": torch.randn(num_experts, n) * 0.3,
                   "w2_bias": torch.randn(num_experts, H) * 0.3}  # fmt: skip
    return {k: v.to(DEVICE, dtype) if k != "weights" else v.to(DEVICE) for k, v in leaves.items()}


def _check_grads(leaves, ids, activation, *, dtype=torch.float32, params=None, expert_map=None,
                 weight_on_input=False, backend="triton", frozen=()):  # fmt: skip
    """fused_experts' output and the gradient of every leaf against dense_ref's."""
    ours = {k: v.clone().requires_grad_(k not in frozen) for k, v in leaves.items()}
    kwargs = dict(activation=activation, expert_map=expert_map)
    out = fused_experts(
        ours["x"], ours["w13"], ours["w2"], ours["weights"], ids, backend=backend,
        w13_bias=ours.get("w13_bias"), w2_bias=ours.get("w2_bias"),
        activation_params=params, apply_router_weight_on_input=weight_on_input, **kwargs,
    )  # fmt: skip
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    # in chunks of tokens: dense_ref gathers every slot's float64 weights (77 GB at 2048 tokens,
    # top-8, 512 x 384 experts), and the gradients of the chunks add up in the leaves
    expected = []
    for rows in torch.arange(ids.shape[0], device=ids.device).split(256):
        chunk = dense_ref(
            ref["x"][rows], ref["w13"], ref["w2"], ref["weights"][rows], ids[rows],
            w13_bias=ref.get("w13_bias"), w2_bias=ref.get("w2_bias"),
            params=None if params is None else {
                k: v for k, v in vars(params).items() if v is not None
            },
            weight_on_input=weight_on_input, **kwargs,
        )  # fmt: skip
        chunk.backward(grad_out[rows].double())
        expected.append(chunk.detach())
    expected = torch.cat(expected) if expected else torch.zeros_like(out, dtype=torch.float64)
    assert_close(out, expected, dtype)
    for name in leaves:
        if name in frozen:
            assert ours[name].grad is None
            continue
        assert ours[name].grad is not None, f"no gradient for {name}"
        assert ours[name].grad.abs().sum() > 0 or ref[name].grad.abs().sum() == 0
        assert_close(ours[name].grad, ref[name].grad, dtype, what=f"grad of {name}")


def _ids(num_tokens, top_k, num_experts=E, *, generator_seed=1):
    g = torch.Generator().manual_seed(generator_seed)
    return torch.stack(
        [torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]
    ).to(DEVICE, torch.int32)


@pytest.fixture(params=["grouped_mm", "triton"])
def wgrad(request, monkeypatch):
    """The weight gradients' engine: torch._grouped_mm (the default where it runs: bf16 on
    sm90, every dtype on the CPU from torch 2.9) or the Triton kernel. Checks afterwards that the
    test ran it."""
    from fusedmoe.kernels import moe_train

    grouped = request.param == "grouped_mm"
    probe = torch.empty(1, 16, device=DEVICE)  # these tests run float32
    if grouped and not moe_train._grouped_mm_ok(probe):
        pytest.skip("torch._grouped_mm does not take float32 here (the GPU path is bf16 only)")
    monkeypatch.setattr(moe_train, "_GROUPED_MM_WGRAD", grouped)
    calls = {"grouped_mm": 0, "triton": 0}
    grouped_wgrad, triton_wgrad = moe_train._grouped_wgrad, moe_train._wgrad

    def grouped_spy(*args):
        calls["grouped_mm"] += 1
        return grouped_wgrad(*args)

    def triton_spy(left, l_div, right, r_div, rows, num_slots, out, bounds, **kwargs):
        calls["triton"] += out.shape[2] > 1  # a weight gradient (a bias's is one column)
        return triton_wgrad(left, l_div, right, r_div, rows, num_slots, out, bounds, **kwargs)

    monkeypatch.setattr(moe_train, "_grouped_wgrad", grouped_spy)
    monkeypatch.setattr(moe_train, "_wgrad", triton_spy)
    yield request.param
    other = "triton" if grouped else "grouped_mm"
    assert calls[request.param] > 0 and calls[other] == 0, calls


@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
def test_every_activation_trains(activation):
    leaves = _leaves(13, 2, activation, bias=False)
    if activation.startswith("swiglu"):  # values past the clamp limits: their gradient is 0
        leaves["x"] = leaves["x"] * 6.0
    _check_grads(leaves, _ids(13, 2), activation)


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_biases_and_clamped_silu(activation, wgrad):
    from fusedmoe import ActivationParams

    params = ActivationParams(limit=0.8) if activation == "silu" else None
    leaves = _leaves(9, 3, activation, bias=True)
    _check_grads(leaves, _ids(9, 3), activation, params=params)


def test_expert_map_uneven_and_empty_experts(wgrad):
    """A rank holding 4 of 10 experts: slots of the others get no gradient and cost nothing;
    one local expert takes most slots, one none."""
    num_global, top_k, m = 10, 3, 17
    expert_map = torch.full((num_global,), -1, dtype=torch.int32)
    expert_map[torch.tensor([2, 5, 7, 9])] = torch.arange(4, dtype=torch.int32)
    ids = _ids(m, top_k, num_global)
    ids[:12, 0] = 5  # expert 5 (local 1) takes most; expert 9 (local 3) none
    ids[ids == 9] = 8
    leaves = _leaves(m, top_k, "silu", bias=True, num_experts=4)
    _check_grads(leaves, ids, "silu", expert_map=expert_map.to(DEVICE))


def test_top1_weight_on_input_and_frozen_weights():
    leaves = _leaves(11, 1, "silu", bias=False)
    _check_grads(leaves, _ids(11, 1), "silu", weight_on_input=True)
    leaves = _leaves(11, 2, "gelu_no_mul", bias=True)
    _check_grads(leaves, _ids(11, 2), "gelu_no_mul", frozen=("w13", "w2"))


@pytest.mark.parametrize(
    "frozen",
    [("x", "w13", "weights", "w13_bias", "w2_bias"), ("x", "w13", "w2", "w13_bias", "w2_bias"),
     ("w13", "w2"), ("x", "w2", "weights", "w2_bias")],
    ids=["w2-only", "router-only", "x-weights-biases", "w13-b13"],
)  # fmt: skip
def test_partial_gradients(frozen):
    """Only some inputs require grad: those get theirs, the others none (and their work is
    skipped)."""
    leaves = _leaves(15, 2, "swigluoai_uninterleave", bias=True)
    _check_grads(leaves, _ids(15, 2), "swigluoai_uninterleave", frozen=frozen)


def test_double_backward_is_refused():
    """create_graph=True would need the backward's own backward: an error, never first-order
    gradients that silently drop the rest."""
    leaves = {k: v.clone().requires_grad_() for k, v in _leaves(6, 2, "silu", bias=False).items()}
    out = fused_experts(
        leaves["x"], leaves["w13"], leaves["w2"], leaves["weights"], _ids(6, 2), backend="triton"
    )
    (grad_x,) = torch.autograd.grad(out.square().sum(), leaves["x"], create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|does not require grad"):
        grad_x.square().sum().backward()


class _NoGradient(torch.autograd.Function):
    """The identity, whose backward gives its input no gradient (an undefined one)."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


@pytest.mark.parametrize("compiled", [False, True])
def test_output_without_gradient(compiled):
    """The loss depends on x by another path only: the experts' backward gets no gradient
    (grads are not materialised) and gives none. Compiled, AOTAutograd passes zeros instead
    (a control)."""
    leaves = {k: v.requires_grad_() for k, v in _leaves(5, 2, "silu", bias=False).items()}

    def experts(x, w13, w2, weights):
        return fused_experts(x, w13, w2, weights, _ids(5, 2), backend="triton")

    fn = torch.compile(experts, backend="aot_eager") if compiled else experts
    x = leaves["x"]
    out = fn(x, leaves["w13"], leaves["w2"], leaves["weights"])
    (_NoGradient.apply(out).sum() + (x * 2).sum()).backward()
    assert_close(leaves["x"].grad, torch.full_like(leaves["x"], 2.0), torch.float32)
    for name in ("w13", "w2", "weights"):
        grad = leaves[name].grad
        assert grad is None or not grad.any(), name


@pytest.mark.parametrize("compiled", [False, True])
def test_second_backward_through_the_graph(compiled):
    """The eager backward writes dh over the saved h: the first backward (retain_graph=True)
    is exact, a second one through the same graph is refused by autograd's saved-tensor check
    instead of reading dh as h. Compiled, the registered op writes none of its inputs and a
    second backward accumulates the same gradients again (a control)."""
    leaves = {k: v.requires_grad_() for k, v in _leaves(9, 2, "silu", bias=False).items()}
    ids = _ids(9, 2)

    def experts(x, w13, w2, weights):
        return fused_experts(x, w13, w2, weights, ids, backend="triton")

    fn = torch.compile(experts, backend="aot_eager") if compiled else experts
    out = fn(leaves["x"], leaves["w13"], leaves["w2"], leaves["weights"])
    grad_out = torch.randn_like(out)
    out.backward(grad_out, retain_graph=True)
    first = {k: v.grad.clone() for k, v in leaves.items()}
    ref = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    dense_ref(ref["x"], ref["w13"], ref["w2"], ref["weights"], ids, activation="silu").backward(
        grad_out.double()
    )
    for name, grad in first.items():
        assert_close(grad, ref[name].grad, torch.float32)
    if not compiled:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward(grad_out)
        return
    out.backward(grad_out)
    for name, grad in first.items():
        assert_close(leaves[name].grad, 2 * grad, torch.float32)


def test_backward_op_fake_matches_with_transposed_weights(wgrad):
    """The registered backward op (torch.compile's) with weight views that are not contiguous:
    its fake's gradients have the real ones' shapes and strides (contiguous, as
    torch._grouped_mm returns them)."""
    from fusedmoe.kernels import moe_train as mt

    leaves = _leaves(11, 2, "silu", bias=True)
    w13 = leaves["w13"].transpose(1, 2).contiguous().transpose(1, 2)  # same values, new strides
    w2 = leaves["w2"].transpose(1, 2).contiguous().transpose(1, 2)
    ids = _ids(11, 2)
    fwd_args = (leaves["x"], w13, w2, leaves["weights"], ids, leaves["w13_bias"],
                leaves["w2_bias"], None, "silu", 1.0, 0.0, 0.0, False, True)  # fmt: skip
    out, h, *routing = mt._train_fwd_op(*fwd_args)
    bwd_args = (torch.randn_like(out), *fwd_args[:8], h, *routing, *fwd_args[8:],
                True, True, True, True, True, True)  # fmt: skip
    torch.library.opcheck(mt._train_bwd_op, bwd_args, test_utils=("test_faketensor",))


def test_all_tokens_to_one_expert_and_zero_tokens(wgrad):
    leaves = _leaves(21, 1, "silu", bias=True)
    _check_grads(leaves, torch.full((21, 1), 3, dtype=torch.int32, device=DEVICE), "silu")
    empty = _leaves(0, 2, "silu", bias=True)
    ours = {k: v.clone().requires_grad_() for k, v in empty.items()}
    out = fused_experts(
        ours["x"], ours["w13"], ours["w2"], ours["weights"],
        torch.zeros(0, 2, dtype=torch.int32, device=DEVICE), backend="triton",
        w13_bias=ours["w13_bias"], w2_bias=ours["w2_bias"],
    )  # fmt: skip
    (out.sum() + ours["w13"].sum()).backward()
    assert out.shape == (0, H)
    assert torch.equal(ours["w13"].grad, torch.ones_like(ours["w13"]))
    assert ours["w2"].grad is None or not ours["w2"].grad.any()


def _in_order_case(device, dtype):
    """The backward's buffers in expert order (S rows, no padding) before the grouped weight
    gradients: every row is written, by the gather and by the act kernel, from the slot the
    layout puts there (the act kernel's buffers start as NaN); the grouped GEMM's groups end where
    each expert's slots end. One expert has no slot, one most."""
    from fusedmoe.activation import MoEActivation
    from fusedmoe.kernels import moe_train as mt

    torch.manual_seed(4)
    m, top_k, e, h, i = 37, 2, 5, 48, 40
    ids = _ids(m, top_k, e).to(device)
    ids[ids == 4] = 1  # expert 4: no slot; expert 1: many
    num_slots = m * top_k
    routing = mt.moe_align_block_size(ids, 16, e)
    row_map = mt._in_order(routing, num_slots)
    used = int(routing.num_tokens_post_padded)
    slots = routing.sorted_token_ids.long()[:used]
    valid = slots < num_slots
    order = slots[valid]  # the slot of each row in expert order
    assert torch.equal(row_map[:used][valid].long(), torch.arange(num_slots, device=device))
    x = torch.randn(m, h, device=device, dtype=dtype)
    x_in_order = mt._gather_rows(x, top_k, routing, row_map, num_slots)
    assert torch.equal(x_in_order, x[order // top_k])

    act = mt._Act(MoEActivation.SILU, 1.0, 0.0, 0.0, False)
    hbuf = torch.randn(num_slots, 2 * i, device=device, dtype=dtype)
    ga = torch.randn(num_slots, i, device=device, dtype=dtype)
    dh = torch.full_like(hbuf, torch.nan)
    weights = torch.rand(num_slots, device=device)
    dw = torch.full((num_slots,), torch.nan, device=device)
    g = ga.clone()
    mt._act_rows(hbuf, ga, act, routing, row_map, backward=True, dh=dh, weights=weights, dw=dw)
    gate, up = hbuf.float().split(i, dim=1)  # row r holds slot order[r]
    w = weights[order][:, None]
    sig = torch.sigmoid(gate)
    want_dh = torch.cat([g * w * up * sig * (1 + gate * (1 - sig)), g * w * gate * sig], dim=1)
    a = (gate * sig * up).to(dtype).float()
    assert_close(dh, want_dh.to(dtype), dtype)
    assert_close(ga, (a * w).to(dtype), dtype)
    assert_close(dw[order], (a * g.float()).sum(1), torch.float32)

    bounds = mt.expert_block_bounds(mt._rows(routing, ids, None, e))
    dw13 = mt._grouped_wgrad(dh, x_in_order, row_map, bounds, 16)
    experts = ids.reshape(-1).long()[order]
    ref = torch.zeros(e, 2 * i, h, dtype=torch.float64, device=device)
    ref.index_add_(0, experts, dh.double()[:, :, None] * x_in_order.double()[:, None, :])
    assert not dw13[4].any()
    assert_close(dw13, ref, dtype)


def test_expert_order_buffers():
    _in_order_case(DEVICE, torch.float32)


def _expert_parallel_case(device, dtype, m, hidden, inter):
    """A rank that holds 8 of 16 experts (one of them gets no slot), then a rank that holds
    none of the experts the tokens chose: the local experts' gradients against the
    reference, an empty expert's and the second rank's are zeros."""
    torch.manual_seed(6)
    num_global, top_k = 16, 4
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(num_global, generator=g)[:top_k] for _ in range(m)])
    ids[ids == 3] = 4  # global expert 3 (local 2): no slot
    local = torch.tensor([0, 2, 3, 5, 8, 11, 13, 15])
    leaves = {
        "x": torch.randn(m, hidden),
        "w13": torch.randn(8, 2 * inter, hidden) / hidden**0.5,
        "w2": torch.randn(8, hidden, inter) / inter**0.5,
        "w13_bias": torch.randn(8, 2 * inter) * 0.3,
        "w2_bias": torch.randn(8, hidden) * 0.3,
    }
    leaves = {k: v.to(device, dtype) for k, v in leaves.items()}
    leaves["weights"] = (torch.rand(m, top_k) + 0.1).to(device)
    for held, chosen in ((local, ids), (torch.arange(8, 16), ids % 8)):
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[held] = torch.arange(8, dtype=torch.int32)
        _check_grads(
            leaves, chosen.to(device, torch.int32), "silu", dtype=dtype,
            expert_map=expert_map.to(device),
        )  # fmt: skip


def test_expert_parallel_rank_with_empty_and_absent_experts(wgrad):
    _expert_parallel_case(DEVICE, torch.float32, 23, H, I)


def test_layer_trains_on_triton_with_router_gradient():
    """FusedMoE(backend="triton") under autograd: gradients reach x, the experts and the
    router logits, equal to the torch backend's."""
    grads = {}
    for backend in ("triton", "torch"):
        torch.manual_seed(3)
        layer = FusedMoE(E, 2, H, I, params_dtype=torch.float32, backend=backend).to(DEVICE)
        x = torch.randn(10, H, device=DEVICE, requires_grad=True)
        logits = torch.randn(10, E, device=DEVICE, requires_grad=True)
        layer(x, logits).square().sum().backward()
        choice = layer.backend_choice(torch.device(DEVICE), torch.float32, requires_grad=True)
        assert choice.name == backend
        grads[backend] = (x.grad, logits.grad, layer.w13_weight.grad, layer.w2_weight.grad)
    for ours, ref, name in zip(
        grads["triton"], grads["torch"], ("x", "logits", "w13", "w2"), strict=True
    ):
        assert_close(ours, ref, torch.float32, tol=1e-4, what=f"grad of {name}")


def test_layer_trains_under_torch_compile_tracing():
    """AOTAutograd traces the registered op and its backward with fake tensors (aot_eager: no
    code generation, so it runs on the CPU interpreter): same gradients as eager."""
    layer = FusedMoE(E, 2, H, I, params_dtype=torch.float32, backend="triton").to(DEVICE)
    x, logits = torch.randn(9, H, device=DEVICE), torch.randn(9, E, device=DEVICE)

    def step(x, logits):
        return layer(x, logits).square().sum()

    grads = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        layer.zero_grad()
        xg, lg = x.clone().requires_grad_(), logits.clone().requires_grad_()
        fn(xg, lg).backward()
        grads.append((xg.grad, lg.grad, layer.w13_weight.grad, layer.w2_weight.grad))
    for eager, compiled in zip(*grads, strict=True):
        assert_close(compiled, eager, torch.float32)


def test_oracle_trains_on_triton_on_cuda_only_unquantized():
    problem = MoEProblem(
        device=torch.device("cuda"), dtype=torch.bfloat16, hidden_size=H, intermediate_size=I,
        num_experts=E, top_k=2, requires_grad=True,
    )  # fmt: skip
    choice = select_backend(problem)
    if choice.name == "triton":  # with Triton installed: the GPU kernels train
        assert "monolithic" in choice.refused
    from fusedmoe.quant import make_quant_config

    qc = make_quant_config("fp8_tensor", torch.ones(E), torch.ones(E))
    quantized = MoEProblem(
        device=torch.device("cuda"), dtype=torch.bfloat16, hidden_size=H, intermediate_size=I,
        num_experts=E, top_k=2, requires_grad=True, quant_config=qc,
    )  # fmt: skip
    refused = select_backend(quantized).refused
    assert "inference only" in refused["triton"]


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernels in bf16 at sizes with many blocks per expert
# ---------------------------------------------------------------------------------------------
def _gpu_leaves(m, top_k, num_experts, hidden, inter, *, bias=False, dtype=torch.bfloat16):
    leaves = {
        "x": torch.randn(m, hidden, device="cuda"),
        "w13": torch.randn(num_experts, 2 * inter, hidden, device="cuda") / hidden**0.5,
        "w2": torch.randn(num_experts, hidden, inter, device="cuda") / inter**0.5,
    }
    if bias:
        leaves["w13_bias"] = 0.3 * torch.randn(num_experts, 2 * inter, device="cuda")
        leaves["w2_bias"] = 0.3 * torch.randn(num_experts, hidden, device="cuda")
    leaves = {k: v.to(dtype) for k, v in leaves.items()}
    leaves["weights"] = torch.rand(m, top_k, device="cuda") + 0.1  # float32, as routers give
    return leaves


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "top_k", "num_experts", "activation", "bias", "dtype"),
    [
        (333, 4, 32, "silu", False, torch.bfloat16),
        (1, 2, 8, "swigluoai", True, torch.bfloat16),
        (2048, 8, 64, "silu", True, torch.bfloat16),  # 128-row blocks, 64-row wgrad steps
        (5000, 2, 8, "gelu_tanh", False, torch.float16),
        (600, 3, 16, "swiglustep", True, torch.float32),
    ],
)
def test_gpu_gradients(m, top_k, num_experts, activation, bias, dtype):
    leaves = _gpu_leaves(m, top_k, num_experts, 512, 384, bias=bias, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(m)])
    ids = ids.to("cuda", torch.int32)
    if m > 100:
        ids[: m // 2, 0] = 0  # one expert takes half the tokens
    _check_grads(leaves, ids, activation, dtype=dtype)


@pytest.mark.gpu
def test_gpu_expert_order_buffers():
    """The same on the GPU in bf16, where torch._grouped_mm runs CUTLASS (an empty group gets
    zeros)."""
    _in_order_case("cuda", torch.bfloat16)


@pytest.mark.gpu
def test_gpu_expert_parallel_gradients():
    """The same in bf16 on the GPU (torch._grouped_mm's groups: one empty, then all empty; the
    rows of the slots of other ranks are never written)."""
    _expert_parallel_case("cuda", torch.bfloat16, 700, 512, 384)


@pytest.mark.gpu
def test_gpu_layer_trains_under_torch_compile():
    """One op and its backward under torch.compile (fullgraph): the same gradients as eager."""
    torch.manual_seed(5)
    layer = FusedMoE(16, 2, 256, 128, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(77, 256, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(77, 16, device="cuda", dtype=torch.bfloat16)

    def step(x, logits):
        return layer(x, logits).float().square().sum()

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        layer.zero_grad()
        xg, lg = x.clone().requires_grad_(), logits.clone().requires_grad_()
        fn(xg, lg).backward()
        results.append((xg.grad, lg.grad, layer.w13_weight.grad, layer.w2_weight.grad))
    for eager, compiled in zip(*results, strict=True):
        assert_close(compiled, eager, torch.bfloat16)
    choice = layer.backend_choice(torch.device("cuda"), torch.bfloat16, requires_grad=True)
    assert choice.name == "triton"


def test_weight_gradient_steps_within_taller_blocks(monkeypatch, wgrad):
    """The GEMMs' blocks (64 rows here) hold several weight-gradient steps (16 rows): runs
    whose padding fills whole steps skip them, and the gradients are unchanged."""
    from fusedmoe.kernels import moe_train

    monkeypatch.setattr(moe_train, "_train_block_m", lambda num_slots: 64)
    monkeypatch.setattr(moe_train, "_WGRAD_STEP", 16)
    leaves = _leaves(29, 2, "silu", bias=True)
    ids = _ids(29, 2)
    ids[:20, 0] = 1  # expert 1: > 20 slots (two blocks), the others a few (one block, padding)
    _check_grads(leaves, ids, "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_training_step_makes_no_host_sync(bias):
    """A recorded forward and its backward read no device value on the host."""
    layer = FusedMoE(16, 2, 256, 128, params_dtype=torch.bfloat16, has_bias=bias).cuda()
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(300, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    layer(x, logits).backward(grad_out)  # compiles the kernels, fills the caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, logits).backward(grad_out)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_gpu_backward_allocates_weight_gradients_late():
    """The backward's peak over what the forward left: dw2, then dx and dw13, with x gathered
    into expert order for dw13 where torch._grouped_mm takes it (4 MiB here). dh is written
    over the saved h (a buffer of its own was 32 MiB more); g / w * a is freed before dx and
    dw13 are allocated (they were allocated up front: one [S, I] buffer more at the peak); no
    zeros [S, N_w] gradient of the saved h (autograd materialised one: the peak was 92 MiB,
    against the 58 MiB of dh, dw2, dw13 and dx). Half of g / w * a (8 MiB) is left for the
    gathered operand and the small buffers (ids, weights, the bounds)."""
    torch.manual_seed(0)
    m, k, e, h, i = 2048, 2, 4, 512, 2048
    layer = FusedMoE(e, k, h, i, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(m, e, device="cuda", dtype=torch.bfloat16)
    layer(x, logits).backward(torch.randn(m, h, device="cuda", dtype=torch.bfloat16))  # warm
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = layer(x, logits)
    grad_out = torch.randn_like(out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad_out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    slots, mib = m * k, 2**20  # dw2 + dw13 + dx = 26 MiB, dh 32 MiB, g / w * a 16 MiB
    dh, ga, dx = slots * 2 * i * 2, slots * i * 2, m * h * 2
    dw13, dw2 = layer.w13_weight.numel() * 2, layer.w2_weight.numel() * 2
    assert peak <= dw2 + dw13 + dx + ga // 2 < dh + dw2 + dw13 + dx, peak / mib

"""The one tolerance helper every test uses, and small shared builders.

Indices and counts compare exactly. Floats compare against a float64 (or float32) reference
by normalised max error |a - e|.max() / max(|e|.max(), tiny), with a bound tied to the dtype
the computation ran in; quantized outputs also by normalised RMS error (rms_tol); on failure
the worst coordinates are printed.
"""

from __future__ import annotations

import math

import torch

# Bound on normalised max error for a computation carried out in `dtype`
# (a few roundings of the dtype's epsilon, as an MoE pipeline stores h, act(h) and y).
TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 2e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    tol: float | None = None,
    rms_tol: float | None = None,
    what: str = "output",
) -> None:
    """actual ~= expected within the bound of `dtype` (default: actual's dtype), and with
    rms_tol, a bound on the normalised RMS error sqrt(mean(|a - e|^2)) / max(|e|)."""
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    dtype = dtype or actual.dtype
    bound = TOLERANCE[dtype] if tol is None else tol
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.numel() == 0:
        return
    nan_a, nan_e = a.isnan(), e.isnan()
    assert torch.equal(nan_a, nan_e), (
        f"{what}: NaN at different places ({int(nan_a.sum())} vs {int(nan_e.sum())})"
    )
    a, e = a.nan_to_num(0.0), e.nan_to_num(0.0)
    scale = max(float(e.abs().max()), 1e-30)
    diff = (a - e).abs()
    err = float(diff.max()) / scale
    rms = float(diff.square().mean().sqrt()) / scale
    if err > bound or (rms_tol is not None and rms > rms_tol):
        flat = int(diff.argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
        rms_bound = "" if rms_tol is None else f" (bound {rms_tol:.1e})"
        raise AssertionError(
            f"{what}: normalised max error {err:.3e} (bound {bound:.1e}, {dtype}); "
            f"rms {rms:.3e}{rms_bound}; "
            f"worst at {idx}: got {float(a[idx]):.6g}, expected {float(e[idx]):.6g} "
            f"(scale {scale:.3g})"
        )


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, *, what: str = "tensor") -> None:
    """Exact comparison for indices and counts."""
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    if not torch.equal(actual.cpu(), expected.cpu().to(actual.dtype)):
        bad = (actual.cpu() != expected.cpu().to(actual.dtype)).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: differs first at {bad}")


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN so that any element left unwritten fails the comparison."""
    return t.fill_(float("nan"))


def quantize_in_chunks(experts: dict, scheme: str, **config_kwargs) -> tuple[dict, object]:
    """quantize_experts a few experts at a time (the whole of deepseek-v3 in float32 would
    not fit), the scales concatenated along E."""
    from fusedmoe.quant import make_quant_config, quantize_experts

    parts = [quantize_experts(experts["w13"][i : i + 32], experts["w2"][i : i + 32], scheme)
             for i in range(0, experts["w13"].shape[0], 32)]  # fmt: skip
    w13 = torch.cat([p[0] for p in parts])
    w2 = torch.cat([p[1] for p in parts])
    qc = make_quant_config(scheme, torch.cat([p[2].w1.scale for p in parts]),
                           torch.cat([p[2].w2.scale for p in parts]), **config_kwargs)  # fmt: skip
    return dict(experts, w13=w13, w2=w2), qc


def preset_problem(name: str, num_tokens: int, scheme: str | None, **config_kwargs):
    """A preset's experts at full size, made on the GPU, and a softmax top-k routing."""
    from fusedmoe.activation import MoEActivation
    from fusedmoe.tools.presets import PRESETS

    spec = PRESETS[name]
    num, hidden, inter = spec.num_experts, spec.hidden_size, spec.intermediate_size
    rows = MoEActivation(spec.activation).gemm1_out_size(inter)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda") * scale

    experts = {
        "w13": randn(num, rows, hidden, scale=3 / math.sqrt(hidden)),
        "w2": randn(num, hidden, inter, scale=1 / math.sqrt(inter)),
        "w13_bias": randn(num, rows) if spec.has_bias else None,
        "w2_bias": randn(num, hidden) if spec.has_bias else None,
    }
    qc = None
    if scheme is not None:
        experts, qc = quantize_in_chunks(experts, scheme, **config_kwargs)
    x = randn(num_tokens, hidden)
    logits = torch.randn(num_tokens, num, device="cuda")
    weights, ids = torch.softmax(logits, dim=-1).topk(spec.top_k, dim=-1)
    return spec, x, experts, weights, ids.to(torch.int32), qc


def random_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    empty: float = 0.0,
    hot: int | None = None,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [M, k], ids int32 [M, k]): distinct experts per token, positive weights
    far from 1; a fraction `empty` of slots -1; `hot`: every token to that one expert (k = 1)."""
    ids = torch.rand(num_tokens, num_experts).argsort(dim=1)[:, :top_k].to(torch.int32)
    if hot is not None:
        ids = torch.full((num_tokens, top_k), hot, dtype=torch.int32)
    weights = torch.rand(num_tokens, top_k) * 2 + 0.2
    if empty:
        ids = ids.masked_fill(torch.rand(num_tokens, top_k) < empty, -1)
    return weights.to(device), ids.to(device)


def quant_tol(device: str) -> dict[str, float]:
    """Bounds for quantized expert outputs against the float64 reference: a one-ulp difference of
    h (summation order) can move a2 by one FP8 step, a few percent of the largest output at
    worst. The interpreter dots in fp32; tensor cores sum in another order (seen: up to 3e-2
    on an H200)."""
    return dict(tol=0.04, rms_tol=5e-3) if device == "cpu" else dict(tol=0.08, rms_tol=1.5e-2)


def quant_config_to(quant_config, device):
    """The quant config with every scale tensor moved to `device`."""
    from dataclasses import replace

    def move(op):
        return replace(op, scale=None if op.scale is None else op.scale.to(device))

    qc = quant_config
    return replace(qc, a1=move(qc.a1), a2=move(qc.a2), w1=move(qc.w1), w2=move(qc.w2))


def run_experts(
    experts, x, w13, w2, weights, ids, qc, *, activation=None, w13_bias=None, w2_bias=None,
    **kwargs,
):  # fmt: skip
    """One forward of an Experts backend behind the no-EP prepare/finalize (kwargs: those of
    FusedMoEModularKernel.forward; global_num_experts defaults to w13's experts)."""
    from fusedmoe.modular.kernel import FusedMoEModularKernel
    from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
    from fusedmoe.modular.types import ActivationSpec, ExpertWeights

    kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), experts)
    expert_weights = ExpertWeights(w13, w2, w13_bias=w13_bias, w2_bias=w2_bias)
    return kernel.forward(
        x, expert_weights, weights, ids, activation=activation or ActivationSpec(),
        global_num_experts=kwargs.pop("global_num_experts", w13.shape[0]), quant_config=qc,
        **kwargs,
    )  # fmt: skip


# ---- spawned ranks ----------------------------------------------------------------------------
def free_port() -> int:
    """A free TCP port on localhost, for a process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, args: tuple, nprocs: int, timeout_s: int, what: str) -> None:
    """worker(rank, *args) in nprocs spawned processes, joined; the test fails (the processes
    killed) if they are not done in timeout_s seconds; a worker's exception is raised here."""
    import pytest
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False,
                                 start_method="spawn")  # fmt: skip
    for _ in range(timeout_s):
        if context.join(timeout=1):
            return
    for process in context.processes:
        process.kill()
    pytest.fail(f"{what} did not finish in {timeout_s} s")


def init_gloo(rank: int, world: int, port: int, timeout_s: int = 60) -> None:
    """A gloo process group of `world` ranks on localhost (a spawned test worker)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip


def fused_checkpoint(layer) -> list[tuple[str, torch.Tensor]]:
    """A FusedMoE's expert weights under the fused checkpoint names (every expert at once)."""
    return [
        ("experts.gate_up_proj", layer.w13_weight.detach()),
        ("experts.down_proj", layer.w2_weight.detach()),
    ]

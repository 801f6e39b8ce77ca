"""DeepGemmExperts ("deep_gemm") and DeepGemmFP4Experts ("deep_gemm_fp4"): the DeepGEMM path of
the big engines.

Prepare quantizes x (FP8 1 x 128 groups, or MXFP8); the backend permutes the tokens into an
expert-aligned layout, runs two grouped GEMMs over it with the fused activation + group
quantization between them, and unpermutes with the weighted top-k reduce straight into the
output (finalize: NoOp).

    deep_gemm      FP8 128 x 128 block weights x FP8 1 x 128 activations (float32 or UE8M0
                   scales, row- or column-major); MXFP8 weights x MXFP8 activations
    deep_gemm_fp4  MXFP4 weights (E2M1 packed, 1 x 32 E8M0) x FP8 1 x 128 activations
    activations    SILU, SWIGLUSTEP, SWIGLUOAI and SWIGLUOAI_UNINTERLEAVE (gemm1_alpha / beta /
                   clamp_limit)
    biases         w13_bias / w2_bias (gpt-oss): added by the act + quant pass and by the
                   unpermute-reduce, in fp32, so every GEMM engine takes them

The GEMM engine (`engine`, reported by `fusedmoe backends` and the oracle's explanation):

    library   the DeepGEMM library's own FP8 grouped GEMMs, where one is importable and runs on
              the GPU (fusedmoe.kernels.deep_gemm_lib: sm90, fp8_block, bf16 activations, N, K
              and the intermediate size multiples of 128). The contiguous layout (M_sum rows, runs
              padded to 128), or at small M with many experts the masked one ([E_l, max_m]:
              m_grouped_fp8_gemm_nt_masked) where the contiguous one would be mostly padding.
              Any token count runs.
    wgmma     our own Hopper GEMMs (fusedmoe.kernels.wgmma_gemm: Gluon, warp-specialized, the
              block-scale promotion of one warpgroup overlapping the other's wgmma) over the
              contiguous layout: fp8_block on sm90 where Triton has Gluon's Hopper API, bf16 /
              fp16 activations, K and the intermediate size multiples of 16: where the
              library does not run. On an H200 the layer on them is 0.70x to 0.94x of the
              triton backend's time from 128 slots per expert (WGMMA_MIN_SLOTS_PER_EXPERT).
              Below 64 slots per expert (WGMMA_ROWS64_MAX_SLOTS_PER_EXPERT) the runs are
              padded to 64 rows and the tiles are 64 x 256.
              A quant config with fast_accum=True lets it sum K without promoting each 128
              block, on 256-wide tiles, from FAST_ACCUM_MIN_SLOTS_PER_EXPERT (faster prefill,
              about 3x the error against the exact quantized computation).
    triton    our Triton grouped GEMMs over the contiguous layout (fusedmoe.kernels.
              deep_gemm_moe): everywhere else, and for the MX schemes, which the library's
              Hopper kernels do not take.

`engine="auto"` (the default) takes the library where it runs the call, else wgmma where it
runs, else triton; where both the library and wgmma run a call, the one `fusedmoe tune --dtype
fp8_block` measured faster at the nearest token count of the shape on this GPU (the engine
table beside the kernel configs; the library where none was measured). "library" and "wgmma"
raise where that engine cannot run the call; "triton" uses neither.

Chosen by the oracle (not by name), a call of fewer slots per expert than the engine's minimum
runs on the triton backend, unless its slots sit on few experts (skewed routing) and the wgmma
engine runs it (not the library). From DEVICE_CHOICE_MIN_TOKENS, for experts of
DEVICE_CHOICE_MIN_EXPERT_WEIGHTS or more, a kernel picks one path on the GPU from the ids
(ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT, fusedmoe.kernels.load_choice), with no host sync:
- a call captured into a torch CUDA graph that can hold conditional nodes (torch >= 2.12,
  CUDAGraph.begin_capture_to_if_node; a caller's graph, or the layer's own graphs of its eager
  calls) holds each path in a conditional node (the branch costs ~20 us);
- elsewhere (eager calls, other captures, torches without the nodes) both paths run, each
  gated by its flag: the path not picked finds no rows in use and returns from each of its
  kernels at once, writing nothing (30 to 70 us a call on an H100).
Where a prepare has counted each expert's slots on the host (ExpertTokensMeta.
expert_num_tokens_cpu: none of fusedmoe's prepares does yet) the same rule runs there, at no
cost, so without the gates. FUSEDMOE_LOAD_CHOICE=0 keeps the host's choice from the mean.
FUSEDMOE_DEEP_GEMM=0 hides the library from the process.

MX formats: Blackwell (compute capability 10.x) has MX tensor-core instructions; Hopper has
none, so the Triton kernels dequantize MX operands to bf16 in their load path (exact, see
fusedmoe.kernels.moe_gemm) -- on Blackwell too, for now. deep_gemm_fp4 on Hopper with Triton
3.6's Gluon (engine "auto") does not take the contiguous path at all: it dequantizes the FP8
activations to bf16 (rounded once) and runs fusedmoe.kernels.wo_hopper's MXFP4 x bf16 kernel
through the weight-only op, the intermediate quantized to FP8 1 x 128 and read back between
the GEMMs (DeepGemmFP4Experts._apply_on_wo_hopper); any token count, K and the intermediate
size multiples of 64. That path has no alignment contract, so there a call requested by name
outside valid_call_reason runs instead of raising.

On the triton engine the DeepGEMM contract runs only some calls (valid_call_reason: at least
`alignment` tokens, N and K multiples of it, N > 512, FP8 / FP4 weights, contiguous tensors).
Chosen by the oracle ("auto"), a call outside it runs on the triton backend where that supports
the scheme (the "triton or deep_gemm" behaviour), else on the contiguous path all the same (our
kernels have no such limits; MX schemes have no other fast path); the reason is logged once.
Requested by name, such a call raises a ValueError.
"""

from __future__ import annotations

import logging
import os
from typing import ClassVar

import torch

from fusedmoe._checks import check_ids_distinct
from fusedmoe._triton import INSTALL_HINT, has_triton, interpreting
from fusedmoe.activation import MoEActivation
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.modular.experts import Experts
from fusedmoe.modular.reduce import TopKWeightAndReduceNoOp
from fusedmoe.modular.types import WorkspaceShapes
from fusedmoe.quant import keys
from fusedmoe.quant.formats import FP8_DTYPE

logger = logging.getLogger("fusedmoe")

_ACTIVATIONS = (
    MoEActivation.SILU,
    MoEActivation.SWIGLUSTEP,
    MoEActivation.SWIGLUOAI,
    MoEActivation.SWIGLUOAI_UNINTERLEAVE,
)
_GROUP_ACTS = (keys.FP8_DYNAMIC_GROUP128, keys.FP8_DYNAMIC_GROUP128_UE8M0)
#: engine="auto": the library where it runs the call, else wgmma where it runs, else triton;
#: "library" / "wgmma": that engine or a ValueError; "triton": our Triton grouped GEMMs only
ENGINES = ("auto", "library", "wgmma", "triton")
#: why "auto" leaves the library for the wgmma engine where both run a call: `fusedmoe tune
#: --dtype fp8_block` measured the engine faster at this shape's nearest bucket on this GPU
#: (the engine table beside the configs). On an H100, deepseek-v3 at M = 4096 took 7.56 ms on
#: the library and 5.69 ms on the engine; at M = 16384 the library won (13.99 vs 14.58 ms;
#: benchmarks/results/session42_h100/tune_engines_h100.log)
MEASURED_FASTER = "the wgmma engine measured faster at this shape and token count (fusedmoe tune)"
#: chosen by the oracle (not by name), a call with fewer slots per expert (M * k / E) than this
#: runs on the triton backend: on an H200 (benchmarks/bench_fp8_backends.py, the four fp8_block
#: presets) triton is faster up to 64 slots per expert (1.0x to 1.4x), the library from 128
#: (1.1x to 1.6x at M = 4096 and 16384)
LIBRARY_MIN_SLOTS_PER_EXPERT = 128
#: the same for our wgmma GEMMs: on an H200 (bench_fp8_backends.py, the four fp8_block presets,
#: uniform routing, M = 256 to 16384) the deep_gemm layer on them is 0.70x to 0.94x of triton's
#: time from 128 slots per expert, and 0.99x to 1.13x at 64
WGMMA_MIN_SLOTS_PER_EXPERT = 128
#: with FusedMoEQuantConfig.fast_accum, the wgmma engine takes its 256-wide fast-accumulation
#: tiles from this many slots per expert. On an H100 (fusedmoe bench, five fp8_block presets,
#: benchmarks/results/fast_accum_h100/) the layer on them took 0.93x to 0.98x of the promoting
#: tiles' time at 512 to 4096 slots per expert (M = 16384), 0.96x to 1.0x at 256 (qwen3-235b-a22b
#: and qwen3-30b-a3b at M = 4096), and at 128 (forced) 1.0x for deepseek-v3, 1.03x for gpt-oss-120b
FAST_ACCUM_MIN_SLOTS_PER_EXPERT = 256
#: below this many slots per expert the wgmma engine pads each run to 64 rows, not 128, and
#: runs 64 x 256 tiles (each warpgroup 128 of the columns): half the padding rows, the same
#: output bits. On an H100 (probe_wgmma_rows64.py at ab63d6f, five fp8_block presets, uniform
#: and skewed routing) the layer took 0.84x to 0.98x of the 128-row tiles' time at 2 to 32
#: slots per expert, 0.95x to 1.03x at 64, 0.95x to 1.12x from 128 (long runs: a 128 x 128
#: tile reads less per flop). Chosen by the oracle such calls run on triton (faster under
#: uniform routing); this is what deep_gemm by name runs
WGMMA_ROWS64_MAX_SLOTS_PER_EXPERT = 64
#: below the minimum above, a call with at least this many slots per expert it touches (slots
#: over the experts with any) runs on the wgmma engine all the same: skewed routing
#: puts hundreds of slots on a few experts where the mean over all experts is small. On an H100
#: (probe_engine_by_load.py at ab63d6f: five fp8_block presets, M = 128 to 2048, skew strengths
#: 0 to 4, 100 calls) choosing the engine from this many on took 0.93x of triton's time on the
#: geometric mean, 0.41x at best (gpt-oss-120b M = 512) and 1.03x at worst (qwen3-30b-a3b
#: M = 1024); from 128 on, 1.05x at worst. The ids are on the GPU: the choice is made there,
#: inside a CUDA graph (conditional nodes, `_branch_on_device`), or on the host where EP
#: dispatch has counted each expert's slots there. Measured with the wgmma engine only: the
#: library's calls keep the host's choice from the mean
ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT = 140
#: the choice on the GPU costs ~20 us a call whatever it picks through conditional nodes (its
#: kernel, then two nodes, each after a kernel that sets its condition: H100, through
#: cond_node_shim.py at ab63d6f), and 30 to 70 us with both paths gated (the path not picked
#: launches its alignment and then kernels that return at once: H100, torch 2.11,
#: profile_gated_pair.py at ab63d6f), so it is made only where the engine can win more: from
#: this many tokens, and experts of DEVICE_CHOICE_MIN_EXPERT_WEIGHTS weights or more (the
#: engine wins by reading a hot expert's weights once, where triton's short row blocks read
#: them again). On the H100 that keeps deepseek-v3 (44 M weights an expert) and gpt-oss-120b
#: (25 M): under uniform routing +0.3% to +0.6% and +1.1% to +1.7% at M = 512 to 2048, under
#: skewed routing (strength 2 to 4) 0.78x to 0.95x and 0.45x to 0.80x of the time (gated:
#: uniform +1.3% to +1.4% and +3.1% to +4.2%, skewed at strength 3 0.79x to 0.98x and 0.48x to
#: 0.77x); it leaves out qwen3-235b-a22b (19 M: +1.7% to +13% where the engine is not taken,
#: 0.84x to 0.98x where it is) and qwen3-30b-a3b (5 M: +7% to +30% where not taken, 1.04x to
#: 1.15x where it is), both measured through conditional nodes
DEVICE_CHOICE_MIN_TOKENS = 512
DEVICE_CHOICE_MIN_EXPERT_WEIGHTS = 20_000_000
#: FUSEDMOE_LOAD_CHOICE=0 turns the choice on the GPU off (the host's choice from the mean)
LOAD_CHOICE_ENV = "FUSEDMOE_LOAD_CHOICE"
_STREAM_POOL_SIZE = 32  # streams per device and priority in torch's pool (c10 kStreamsPerPool)


class DeepGemmExperts(Experts):
    name = "deep_gemm"
    #: every path launches the same kernels for a token count and reads nothing on the host
    #: (the library's JIT compilation happens in the graph cache's warm-up call, before capture)
    cuda_graph_safe = True
    #: rows each expert's run is padded to (the M alignment of DeepGEMM's contiguous layout)
    alignment: ClassVar[int] = 128
    #: scheme -> the activation keys it accepts
    schemes: ClassVar[dict[str, tuple[keys.QuantKey, ...]]] = {
        "fp8_block": _GROUP_ACTS,
        "mxfp8": (keys.MXFP8,),
    }
    weight_dtype: ClassVar[torch.dtype] = FP8_DTYPE

    def __init__(self, strict: bool = False, engine: str = "auto") -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        #: requested by name: a call outside the contract raises instead of falling back
        self.strict = strict
        self.engine = engine
        self._logged: set[str] = set()

    @classmethod
    def create(cls, *, requested: bool = False) -> DeepGemmExperts:
        return cls(strict=requested)

    # ---- capabilities ----
    @classmethod
    def is_available(cls):
        return None if has_triton() else f"triton is not installed ({INSTALL_HINT})"

    @classmethod
    def supports_device(cls, device):
        if device.type == "cpu":
            return interpreting()
        if device.type != "cuda":
            return False
        if not torch.cuda.is_available():  # nothing to ask (the capability matrix on a CPU)
            return True
        return torch.cuda.get_device_capability(device)[0] >= 9

    @classmethod
    def preferred_on(cls, device):
        return device.type == "cuda"

    @classmethod
    def supports_dtype(cls, dtype):
        return dtype in (torch.bfloat16, torch.float16)

    @classmethod
    def supports_quant_config(cls, quant_config):
        if quant_config is None or quant_config.scheme not in cls.schemes:
            return False
        accepted = cls.schemes[quant_config.scheme]
        return quant_config.a1.key in accepted and quant_config.a2.key == quant_config.a1.key

    @classmethod
    def supports_activation(cls, activation):
        return activation in _ACTIVATIONS

    @classmethod
    def supports_bias(cls):
        return True

    @classmethod
    def supports_expert_map(cls):
        return True

    @classmethod
    def supports_ep(cls, ep_size):
        return True

    @classmethod
    def engine_description(cls, problem=None) -> str:
        """Which GEMMs run (fusedmoe backends, the oracle's explanation), and for a problem
        that both the library and the wgmma engine run, which one takes which token counts."""
        missing = cls.is_available()
        if missing is not None:  # every engine is a Triton kernel or needs one beside it
            return f"none: {missing}"
        engines = cls._engines()
        if problem is None or not (cls.library_runs(problem) and cls.wgmma_runs(problem)):
            return engines
        from fusedmoe.kernels.fused_moe import device_name
        from fusedmoe.kernels.moe_config import TABLE_ENGINES, engine_table

        device = device_name(problem.device)
        if device is None:  # the interpreter: no tables
            return engines
        shape = (
            problem.num_experts // problem.ep_size,
            problem.activation.kind.gemm1_out_size(problem.intermediate_size),
            problem.hidden_size,
        )
        found = engine_table(*shape, problem.quant_config.scheme, device)
        if found is None:
            return (
                f"{engines}; both run this shape: the library takes every call (no engine "
                f"table for E_l, N, K = {shape} on {device}: `fusedmoe tune --dtype fp8_block` "
                "measures the two)"
            )
        table, path = found
        taken = "; ".join(
            f"{engine} at M = {', '.join(str(m) for m in sorted(table) if table[m] == engine)}"
            for engine in TABLE_ENGINES
            if engine in table.values()
        )
        return (
            f"{engines}; both run this shape: each call takes the engine measured faster at "
            f"the nearest token count ({taken}; {path})"
        )

    @classmethod
    def _engines(cls) -> str:
        from fusedmoe.kernels.deep_gemm_lib import library_status
        from fusedmoe.kernels.wgmma_gemm import wgmma_status

        return f"{library_status()}; engine='wgmma': {wgmma_status()}"

    @classmethod
    def library_runs(cls, problem) -> bool:
        """Whether the DeepGEMM library runs `problem`'s GEMMs here (the oracle then prefers
        this backend to triton: see LIBRARY_MIN_SLOTS_PER_EXPERT)."""
        qc = problem.quant_config
        if not (
            qc is not None
            and qc.scheme == "fp8_block"
            and problem.dtype == torch.bfloat16
            and cls.refusal_reason(problem) is None  # CUDA, triton installed
            and problem.hidden_size % 128 == 0
            and problem.intermediate_size % 128 == 0
        ):
            return False
        from fusedmoe.kernels.deep_gemm_lib import library_unusable_reason

        return library_unusable_reason(problem.device) is None

    @classmethod
    def wgmma_runs(cls, problem) -> bool:
        """Whether our Gluon (wgmma) GEMMs run `problem` here (fp8_block on Hopper): the
        oracle then prefers this backend to triton, as for the library
        (WGMMA_MIN_SLOTS_PER_EXPERT)."""
        qc = problem.quant_config
        if not (
            qc is not None
            and qc.scheme == "fp8_block"
            and problem.dtype in (torch.bfloat16, torch.float16)
            and cls.refusal_reason(problem) is None  # CUDA, triton installed
            and problem.hidden_size % 16 == 0
            and problem.intermediate_size % 16 == 0
        ):
            return False
        from fusedmoe.kernels.wgmma_gemm import gluon_unusable_reason

        return gluon_unusable_reason(problem.device) is None

    # ---- the contract of one call ----
    def library_reason(
        self, num_tokens: int, weights, call_quant, hidden_states, call_output_dtype
    ) -> str | None:
        """None when the DeepGEMM library runs this call, else why not."""
        from fusedmoe.kernels.deep_gemm_lib import library_unusable_reason

        if self.engine not in ("auto", "library"):
            return f"engine={self.engine!r}"
        if call_quant.scheme != "fp8_block":
            return f"the library's sm90 kernels take fp8_block, not {call_quant.scheme}"
        if call_output_dtype != torch.bfloat16:
            return f"the library's GEMMs write bf16, the layer runs in {call_output_dtype}"
        why = library_unusable_reason(hidden_states.device)
        if why is not None:
            return why
        # per call: the messages are formatted only for a refusal
        n, k, inter = weights.gemm1_out_size, weights.hidden_size, weights.w2.shape[2]
        if n % 128 or k % 128 or inter % 128:
            return f"N = {n}, K = {k} and the intermediate size {inter} must be multiples of 128"
        if weights.w13.dtype != FP8_DTYPE:
            return f"weights are {weights.w13.dtype}"
        if call_quant.w1.scale.dtype != torch.float32:
            return "weight scales are not float32"
        if not (hidden_states.is_contiguous() and weights.w13.is_contiguous()
                and weights.w2.is_contiguous()):  # fmt: skip
            return "non-contiguous tensors"
        return None

    def wgmma_reason(self, weights, call_quant, hidden_states, a1q_scale, call_output_dtype):
        """None when our Gluon (wgmma) GEMMs run this call, else why not."""
        from fusedmoe.kernels.wgmma_gemm import gluon_unusable_reason

        if call_quant.scheme != "fp8_block":
            return f"the wgmma engine runs fp8_block, not {call_quant.scheme}"
        if call_output_dtype not in (torch.bfloat16, torch.float16):
            return f"the wgmma engine writes bf16 / fp16, the layer runs in {call_output_dtype}"
        why = gluon_unusable_reason(hidden_states.device)
        if why is not None:
            return why
        k, inter = weights.hidden_size, weights.w2.shape[2]
        if k % 16 or inter % 16:  # TMA: 16-byte row strides of the FP8 operands
            return f"K = {k} and the intermediate size {inter} must be multiples of 16"
        if weights.w13.dtype != FP8_DTYPE or a1q_scale.dtype != torch.float32:
            return f"weights are {weights.w13.dtype}, activation scales {a1q_scale.dtype}"
        if call_quant.w1.scale.dtype != torch.float32:
            return "weight scales are not float32"
        if not (weights.w13.is_contiguous() and weights.w2.is_contiguous()):
            return "non-contiguous weights"
        return None

    def valid_call_reason(self, num_tokens: int, weights, hidden_states) -> str | None:
        """None when the DeepGEMM contract covers this call, else why not."""
        a = self.alignment
        n, k = weights.gemm1_out_size, weights.hidden_size
        tensors = (hidden_states, weights.w13, weights.w2)
        checks = (
            (num_tokens >= a, f"M = {num_tokens} < the alignment {a}"),
            (n % a == 0 and k % a == 0, f"N = {n} and K = {k} must be multiples of {a}"),
            (n > 512, f"N = {n} <= 512"),
            (weights.w13.dtype == self.weight_dtype, f"weights are {weights.w13.dtype}"),
            (all(t.is_contiguous() for t in tensors), "non-contiguous tensors"),
        )
        return next((why for ok, why in checks if not ok), None)

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.info(message)

    def workspace_shapes(self, M, N, K, top_k, global_num_experts, local_num_experts, activation):
        from fusedmoe.kernels.deep_gemm_moe import compute_aligned_M_and_alignment

        # the library's masked layout is only chosen where it has fewer rows (library_layout)
        m_sum, _ = compute_aligned_M_and_alignment(M, top_k, local_num_experts, self.alignment)
        n_act = activation.output_size(N)
        return WorkspaceShapes(
            workspace13=(m_sum, max(n_act, K)), workspace2=(m_sum, max(N, K)), output=(M, K)
        )

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOp()

    def apply(self, call):
        qc, weights = call.quant_config, call.weights
        if not self.supports_quant_config(qc):
            raise ValueError(f"the {self.name} backend does not support {qc!r}")
        if call.a1q_scale is None:
            raise ValueError(f"the {self.name} backend needs a1 quantized by prepare")
        num_tokens, top_k = call.topk_ids.shape
        not_library = self.library_reason(
            num_tokens, weights, qc, call.hidden_states, call.output.dtype
        )
        not_wgmma = "the library runs the call"
        if self.engine in ("auto", "wgmma") and (
            not_library is not None or (self.engine == "auto" and self._measured_faster(call))
        ):
            not_wgmma = self.wgmma_reason(
                weights, qc, call.hidden_states, call.a1q_scale, call.output.dtype
            )
            if not_library is None and not_wgmma is None:  # both run it: the faster one
                not_library = MEASURED_FASTER
        slots_per_expert = num_tokens * top_k / call.global_num_experts
        touched_mean = None  # slots per expert touched, where the host knows the counts
        meta = call.expert_tokens_meta
        if meta is not None and meta.expert_num_tokens_cpu is not None:  # EP dispatch counted
            counts = meta.expert_num_tokens_cpu
            routed = int(counts.sum())
            slots_per_expert = routed / weights.num_local_experts
            if not_library is not None:  # the rule was measured on the wgmma engine only
                touched_mean = routed / max(1, int((counts > 0).sum()))
        # chosen by the oracle, small calls run faster on the triton backend, unless their
        # slots sit on few experts (ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT)
        fewest = LIBRARY_MIN_SLOTS_PER_EXPERT if not_library is None else WGMMA_MIN_SLOTS_PER_EXPERT
        if (
            (not_library is None or not_wgmma is None)
            and self.engine == "auto"
            and not self.strict
            and slots_per_expert < fewest
            and TritonExperts.supports_quant_config(qc)
        ):
            if touched_mean is None:  # the counts are on the GPU: choose there, or triton
                if not self._branch_on_device(call, not_library, not_wgmma, slots_per_expert):
                    TritonExperts().apply(call)
                return
            if touched_mean < ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT:  # counted on the host
                TritonExperts().apply(call)
                return
        self._run_contiguous(call, not_library, not_wgmma, slots_per_expert)

    def _measured_faster(self, call) -> bool:
        """Whether `fusedmoe tune` measured the wgmma engine faster than the library at the
        nearest bucket of this call's shape on this GPU (kernels.moe_config.measured_engine:
        resolved once per signature)."""
        from fusedmoe.kernels.fused_moe import device_name
        from fusedmoe.kernels.moe_config import measured_engine

        weights = call.weights
        engine = measured_engine(
            call.topk_ids.shape[0], weights.num_local_experts, weights.gemm1_out_size,
            weights.hidden_size, call.quant_config.scheme, device_name(call.hidden_states),
        )  # fmt: skip
        return engine == "wgmma"

    def _branch_on_device(self, call, not_library, not_wgmma, slots_per_expert) -> bool:
        """Where the wgmma engine can win more than the choice on the GPU costs
        (DEVICE_CHOICE_MIN_TOKENS and _EXPERT_WEIGHTS): a kernel picks the engine or triton
        from the ids (kernels.load_choice), and only the path picked computes.
        - Captured into a torch CUDA graph that can hold conditional nodes: each path is
          captured in a conditional node behind its flag.
        - Elsewhere (eager calls, other captures, torches without the nodes): both paths run,
          each gated by its flag; the one not picked returns from each of its kernels at once
          and writes nothing.
        False where FUSEDMOE_LOAD_CHOICE=0, below the gates, and where the DeepGEMM library
        runs the call (its kernels captured in a conditional node's body made the capture
        crash, on an H100 with CUDA 13, through cond_node_shim.py at ab63d6f: the stand-in may
        be the cause, but nothing else was tried; its GEMMs read no count of rows to gate):
        the caller runs the host's choice."""
        from fusedmoe.kernels.load_choice import engine_flags

        weights = call.weights
        if (
            not_library is None  # the library's kernels: no branch, no gate (above)
            or not _load_choice_enabled()
            or call.topk_ids.shape[0] < max(DEVICE_CHOICE_MIN_TOKENS, 2)  # gates need 2 tokens
            or weights.w13[0].numel() + weights.w2[0].numel() < DEVICE_CHOICE_MIN_EXPERT_WEIGHTS
        ):
            return False
        graph = _device_choice_graph(call.hidden_states)
        flags = engine_flags(
            call.topk_ids,
            weights.num_local_experts,
            ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT,
            call.expert_map,
        )
        if graph is None:  # both paths, each gated by its flag
            self._run_contiguous(call, not_library, not_wgmma, slots_per_expert, gate=flags[:1])
            TritonExperts().apply(call, gate=flags[1:])
            return True
        flags = flags.view(torch.bool)
        for flag, on_engine in ((flags[0], True), (flags[1], False)):
            _draw_past_capture_stream(call.hidden_states.device)
            graph.begin_capture_to_if_node(flag)
            try:
                if on_engine:
                    self._run_contiguous(call, not_library, not_wgmma, slots_per_expert)
                else:
                    TritonExperts().apply(call)
            finally:
                graph.end_capture_to_conditional_node()
        return True

    def _run_contiguous(self, call, not_library, not_wgmma, slots_per_expert, gate=None) -> None:
        """The call on the contiguous layout: the library's GEMMs where not_library is None,
        else ours (wgmma where not_wgmma is None, else the Triton grouped GEMMs). gate: uint8
        [1] on the device, 0: the call writes nothing (wgmma only: _branch_on_device)."""
        from fusedmoe.kernels.deep_gemm_moe import (
            compute_aligned_M_and_alignment,
            fused_experts_deep_gemm,
            library_layout,
        )

        qc, weights = call.quant_config, call.weights
        num_tokens, top_k = call.topk_ids.shape
        engine = "triton"
        if not_library is None:
            engine, _ = library_layout(num_tokens, top_k, weights.num_local_experts, self.alignment)
            if engine == "masked":  # holds M rows per expert: a token's ids must be distinct
                check_ids_distinct("topk_ids", call.topk_ids)
        elif self.engine == "library":
            raise ValueError(f"engine='library' cannot run this call: {not_library}")
        elif not_wgmma is None:
            engine = "wgmma"
        elif self.engine == "wgmma":
            raise ValueError(f"engine='wgmma' cannot run this call: {not_wgmma}")
        if gate is not None and engine != "wgmma":  # only the wgmma engine's path is gated
            raise ValueError(f"a gated call runs on the wgmma engine, not on {engine!r}")
        if engine == "triton":
            why = self.valid_call_reason(num_tokens, weights, call.hidden_states)
            if why is not None:
                if self.strict:
                    raise ValueError(f"backend {self.name!r} cannot run this call: {why}")
                if TritonExperts.supports_quant_config(qc):
                    self._log_once(f"{self.name}: {why}; this call runs on the triton backend")
                    TritonExperts().apply(call)
                    return
                self._log_once(f"{self.name}: {why}; the contiguous path runs it all the same")
        alignment = self.alignment
        if engine == "wgmma" and slots_per_expert < WGMMA_ROWS64_MAX_SLOTS_PER_EXPERT:
            alignment = 64  # short runs: 64-row tiles, half the padding
        m_sum, alignment = compute_aligned_M_and_alignment(
            num_tokens, top_k, weights.num_local_experts, alignment, call.expert_tokens_meta
        )
        fused_experts_deep_gemm(
            call.output,
            call.hidden_states,
            call.a1q_scale,
            weights.w13,
            weights.w2,
            qc.w1.scale,
            qc.w2.scale,
            call.topk_weights.float(),
            call.topk_ids,
            scheme=qc.scheme,
            activation=call.activation,
            workspace13=call.workspace13,
            workspace2=call.workspace2,
            expert_map=call.expert_map,
            alignment=alignment,
            m_sum=m_sum,
            column_major_scales=qc.a2.column_major_scales,
            use_ue8m0=qc.a2.key == keys.FP8_DYNAMIC_GROUP128_UE8M0,
            mul_routed_weight=not call.apply_router_weight_on_input,
            engine=engine,
            w13_bias=weights.w13_bias,
            w2_bias=weights.w2_bias,
            fast_accum=(
                engine == "wgmma"
                and qc.fast_accum
                and slots_per_expert >= FAST_ACCUM_MIN_SLOTS_PER_EXPERT
            ),
            gate=gate,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strict={self.strict}, engine={self.engine!r})"


def _alloc_conf() -> str:
    """The CUDA allocator settings, lower case, without spaces."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    return conf.replace(" ", "").lower()


def _load_choice_enabled() -> bool:
    """False where FUSEDMOE_LOAD_CHOICE turns the choice on the GPU off."""
    return os.environ.get(LOAD_CHOICE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _device_choice_graph(x: torch.Tensor):
    """The torch.cuda.CUDAGraph being captured on x's device's current stream, where it can
    hold conditional nodes (CUDA >= 12.4, a torch with CUDAGraph.begin_capture_to_if_node);
    None where it cannot, where no capture runs (eager calls), or where the capture is not a
    torch.cuda.CUDAGraph's."""
    if not x.is_cuda:
        return None
    with torch.cuda.device(x.device):
        if not torch.cuda.is_current_stream_capturing():
            return None
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return None
    if "graph_capture_record_stream_reuse:true" in _alloc_conf():
        return None  # torch refuses conditional nodes under this allocator setting
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 4):
        return None
    with torch.cuda.device(x.device):
        try:
            return torch.cuda.CUDAGraph.get_currently_capturing_graph()
        except RuntimeError:  # a capture begun outside torch.cuda.CUDAGraph
            return None


def _draw_past_capture_stream(device: torch.device) -> None:
    """torch captures a conditional node's body on the next stream of its pool (32 streams
    per device and priority, handed out in turn, as torch.cuda.Stream() hands them), and the
    stream being captured may be one of them (torch.cuda.graph's and the graph cache's come
    from there): the body's capture would then begin on a stream already capturing, which CUDA
    refuses (one graph of ~16 layers' calls is enough to hit it). Draw from the pool until the
    capture's own stream comes out, so that the next one is another; a capture stream from
    outside the pool never comes out, and every draw (twice the pool, at capture time only)
    is then a harmless one."""
    if device.type != "cuda":
        return
    current = torch.cuda.current_stream(device)
    for _ in range(2 * _STREAM_POOL_SIZE):
        if torch.cuda.Stream(device=current.device) == current:
            return


class DeepGemmFP4Experts(DeepGemmExperts):
    """MXFP4 weights x FP8 1 x 128 activations (the mxfp4_w4a8 scheme)."""

    name = "deep_gemm_fp4"
    schemes: ClassVar[dict[str, tuple[keys.QuantKey, ...]]] = {"mxfp4_w4a8": _GROUP_ACTS}
    weight_dtype: ClassVar[torch.dtype] = torch.uint8  # two E2M1 codes per byte

    @classmethod
    def _engines(cls) -> str:
        return (
            "on Hopper with Triton 3.6's Gluon, the FP8 activations dequantized to bf16 into "
            "the MXFP4 x bf16 Gluon kernel (fusedmoe.kernels.wo_hopper: Hopper has no FP4 tensor "
            "cores), the intermediate through FP8 as the scheme says; elsewhere fusedmoe Triton "
            "GEMMs (the DeepGEMM library has no Hopper GEMM for MXFP4 weights)"
        )

    def apply(self, call):
        if (
            self.engine == "auto"
            and self.supports_quant_config(call.quant_config)
            and self._apply_on_wo_hopper(call)
        ):
            return
        super().apply(call)

    def _apply_on_wo_hopper(self, call) -> bool:
        """The call on wo_hopper's kernel where it runs (see _engines): a1 dequantized from its
        FP8 1 x 128 groups to bf16 (rounded once), both GEMMs with MXFP4 weights x bf16, a2
        quantized to FP8 1 x 128 (UE8M0 scales where the config says) and read back between
        them. False where the kernel does not run the call (the Triton GEMMs do)."""
        from fusedmoe.kernels import wo_hopper
        from fusedmoe.kernels.wo_moe import dequantize_groups

        qc, weights, activation = call.quant_config, call.weights, call.activation
        a1q, a1_scale = call.hidden_states, call.a1q_scale
        if a1_scale is None or call.output.dtype != torch.bfloat16 or a1q.dim() != 2:
            return False
        m, hidden = a1q.shape
        width = activation.kind.output_size(weights.w13.shape[1])
        if a1_scale.shape != (m, -(-hidden // 128)):
            return False
        reason = wo_hopper.weights_unusable_reason(
            a1q.device, call.output.dtype, hidden, width, weights.w13, qc.w1.scale,
            weights.w2, qc.w2.scale,
        )  # fmt: skip
        if reason is not None:
            self._log_once(f"{self.name}: the Triton GEMMs run MXFP4 x FP8: {reason}")
            return False
        x = dequantize_groups(a1q, a1_scale.float(), 128).to(torch.bfloat16)
        TritonExperts()._apply_weight_only(
            call, "mxfp4", 32, x=x, a2_fp8_group=128,
            a2_ue8m0=qc.a2.key == keys.FP8_DYNAMIC_GROUP128_UE8M0,
        )  # fmt: skip
        return True


__all__ = ["DeepGemmExperts", "DeepGemmFP4Experts"]

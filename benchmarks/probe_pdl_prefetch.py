"""GEMM2's weight prefetch and the GEMMs' early trigger (fusedmoe.kernels.fused_moe
_EARLY_TRIGGER, _PREFETCH_W, _PREFETCH_L2_SHARE) at decode sizes: the triton backend's whole
layer, CUDA-graph medians, one line per cell and mode, and a hash of each output (bit for bit
comparisons across processes). Run it once on the checkout under test and once with the
package of another checkout first on PYTHONPATH (the baseline), alternating:

    PYTHONPATH=. python3 benchmarks/probe_pdl_prefetch.py --modes early,prefetch,prefetch_all
    PYTHONPATH=<baseline>:. python3 benchmarks/probe_pdl_prefetch.py --modes shipped
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
from pathlib import Path

import torch

import fusedmoe
from fusedmoe import fused_experts
from fusedmoe.kernels import fused_moe
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.bench.timing import time_ms
from fusedmoe.tools.presets import PRESETS

MODES = {  # mode -> (_EARLY_TRIGGER, _PREFETCH_W, _PREFETCH_L2_SHARE)
    "shipped": None,  # the package as it is (the baseline checkout)
    "early": (True, False, 0.5),
    "prefetch": (True, True, 0.5),
    "prefetch_all": (True, True, 8.0),
    "prefetch_only": (False, True, 0.5),
    "none": (False, False, 0.5),  # neither: the act + quant kernel's early start alone
}


def _set(mode: str) -> None:
    if MODES[mode] is not None:
        early, prefetch, share = MODES[mode]
        fused_moe._EARLY_TRIGGER, fused_moe._PREFETCH_W = early, prefetch
        fused_moe._PREFETCH_L2_SHARE = share


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--tokens", default="1,4,8,64")
    ap.add_argument("--quant", default="bf16,fp8_block")
    ap.add_argument("--modes", default="prefetch")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} fusedmoe from {Path(fusedmoe.__file__).parent}")
    if hasattr(fused_moe, "_l2_bytes"):
        print(f"# L2 {fused_moe._l2_bytes(0)} bytes, {fused_moe._sm_count(0)} SMs", flush=True)
    rows = []
    for name in args.presets.split(","):
        p = PRESETS[name]
        w13, w2 = make_expert_weights(
            p.name, p.num_experts, p.hidden_size, p.intermediate_size, p.activation,
            torch.bfloat16, device,
        )  # fmt: skip
        for quant in args.quant.split(","):
            if quant == "bf16":
                a, b, qc = w13, w2, None
            else:
                experts = quantize_expert_set(w13, w2, quant, with_plain=False)
                a, b, qc = experts.w13, experts.w2, experts.quant_config
            for m in (int(t) for t in args.tokens.split(",")):
                r = make_routing(
                    p.name, m, p.num_experts, p.top_k, p.hidden_size, "uniform",
                    torch.bfloat16, device,
                )  # fmt: skip

                def run(r=r, a=a, b=b, qc=qc, act=p.activation):
                    return fused_experts(
                        r.x, a, b, r.topk_weights, r.topk_ids, activation=act,
                        quant_config=qc, backend="triton",
                    )  # fmt: skip

                for mode in args.modes.split(","):
                    _set(mode)
                    out = run()
                    us = time_ms(run, device, rep_ms=40)[0] * 1e3
                    digest = hashlib.sha1(out.view(torch.int16).cpu().numpy().tobytes())
                    row = dict(preset=name, quant=quant, tokens=m, mode=mode, us=us,
                               out=digest.hexdigest()[:12])  # fmt: skip
                    if hasattr(fused_moe, "_prefetch_ok"):
                        row["prefetch_ok"] = fused_moe._prefetch_ok(b, m * p.top_k)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            a = b = qc = experts = None
        del w13, w2
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Programmatic dependent launch (fusedmoe._pdl) on and off, same inputs: the triton
backend's whole layer at decode sizes, CUDA-graph medians, the two settings alternating (four
timings each, the second best kept), and whether their outputs are bit for bit the same.

    PYTHONPATH=. python3 benchmarks/bench_pdl.py [--presets mixtral-8x7b,...] [--tokens 1,8,64]
        [--quant bf16,fp8_block] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe import _pdl as pdl
from fusedmoe import fused_experts
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.bench.timing import time_ms
from fusedmoe.tools.presets import PRESETS


def _set_pdl(on: bool) -> None:
    pdl._BY_DEVICE.clear()  # pdl_args reads the setting again at the next launch
    os.environ["FUSEDMOE_PDL"] = "1" if on else "0"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--quant", default="bf16,fp8_block")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_pdl: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows = []
    print(f"# {torch.cuda.get_device_name()}")
    print(f"{'preset':<16}{'quant':<10}{'M':>6}{'off us':>9}{'on us':>9}{'on/off':>8}  same")
    for name in args.presets.split(","):
        p = PRESETS[name]
        w13, w2 = make_expert_weights(
            p.name, p.num_experts, p.hidden_size, p.intermediate_size, p.activation,
            torch.bfloat16, device,
        )  # fmt: skip
        for quant in args.quant.split(","):
            experts = None
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
                run = functools.partial(
                    fused_experts, r.x, a, b, r.topk_weights, r.topk_ids,
                    activation=p.activation, quant_config=qc, backend="triton",
                )  # fmt: skip
                times: dict[bool, list[float]] = {False: [], True: []}
                outs = {}
                for i in range(args.rounds):
                    for on in (False, True) if i % 2 == 0 else (True, False):
                        _set_pdl(on)
                        outs[on] = run()
                        times[on].append(time_ms(run, device, rep_ms=40)[0] * 1e3)
                off, on = (sorted(times[s])[1] for s in (False, True))
                same = torch.equal(outs[False], outs[True])
                print(f"{name:<16}{quant:<10}{m:>6}{off:>9.1f}{on:>9.1f}{on / off:>8.3f}  {same}",
                      flush=True)  # fmt: skip
                row = dict(preset=name, quant=quant, tokens=m, off_us=off, on_us=on)
                rows.append(dict(row, off_runs=times[False], on_runs=times[True], same=same))
            a = b = qc = experts = None  # the quantized copy goes before the next preset
        del w13, w2
        gc.collect()
        torch.cuda.empty_cache()
    _set_pdl(True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The MoE benchmark behind the README's first performance table, now `fusedmoe bench`
(fusedmoe/tools/bench/).

    PYTHONPATH=. python3 benchmarks/bench_moe.py [--quick] [any fusedmoe bench flag]

runs `fusedmoe bench` with this script's old defaults: every preset at its real size, bf16 and
fp8_block, uniform and skewed routing, the triton backend beside the grouped_mm and eager
baselines, the float64 reference up to 8192 slots. --quick: tokens 1, 64, 4096; --presets is
the old spelling of --preset. Flags given after these defaults override them.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import fusedmoe  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe.tools.cli import main

DEFAULTS = ["--quant", "bf16,fp8_block", "--routing", "uniform,skewed:1", "--backends", "triton"]
DEFAULTS += ["--ref-max-slots", "8192"]


def translate(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        if arg == "--quick":
            out += ["--tokens", "1,64,4096"]
        elif arg == "--presets" or arg.startswith("--presets="):
            out.append(arg.replace("--presets", "--preset", 1))
        else:
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main(["bench", *DEFAULTS, *translate(sys.argv[1:])]))

"""`fusedmoe bench`: every backend that supports a shape and scheme on this machine, beside two
plain-PyTorch baselines, timed against the roofline floor and checked against the reference.

    spec = BenchSpec(presets=[get_preset("qwen3-30b-a3b")], quants=["bf16"], tokens=[1, 64],
                     routings=["uniform"], device=torch.device("cuda"), ceilings=H200)
    rows = run_bench(spec)  # list[Row]: time_ms, tflops, gbps, roofline_pct, rel_err, ...

inputs       expert weights in each format and the routing of one row (seeded)
contenders   which backends run (oracle.BACKENDS and their predicates) and the baselines
             (peers, other libraries timed beside them with --peers: fusedmoe.tools.peers)
timing       CUDA-graph replay on a GPU, perf_counter on the CPU; rel_err
sweep        the loops, the floor of each row
report       table, JSON, CSV, plot, progress
command      the command line's driver (fusedmoe.tools.cli parses)
"""

from fusedmoe.tools.bench.sweep import QUANTS, BenchSpec, Row, run_bench

__all__ = ["QUANTS", "BenchSpec", "Row", "run_bench"]

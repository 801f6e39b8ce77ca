#!/usr/bin/env bash
# The GPU runs behind the README's bench table and plot and the shipped tuned tables.
#
#   OUT=/some/dir bash benchmarks/cli_gpu_runs.sh tune-bf16|tune-fp8|bench
#
# tune-*: fusedmoe tune for every preset, token buckets 1 ... 16384, into fusedmoe/kernels/tuned/
#         (--ship); a tarball of that folder lands in $OUT. About 4 minutes each on an H100/H200.
# bench:  fusedmoe bench for every preset, bf16 and fp8_block, the triton backend beside the two
#         baselines, with JSON, CSV and the PNG plot in $OUT. About 2 minutes on an H200.
# Run from the repository root; each step fits in one 10-minute device command.
set -euo pipefail
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEDMOE_CACHE_DIR=${FUSEDMOE_CACHE_DIR:-/tmp/fusedmoe-cache}
gpu=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
tokens=1,8,64,256,1024,4096,16384
case "${1:?tune-bf16, tune-fp8 or bench}" in
  tune-bf16|tune-fp8)
    dtype=$([ "$1" = tune-bf16 ] && echo bf16 || echo fp8_block)
    python3 -m fusedmoe tune --dtype "$dtype" --tokens "$tokens" --ship --budget-s 200 \
      2>&1 | tee "$OUT/tune_${gpu}_${dtype}.log" | grep -v dropped
    tar czf "$OUT/tuned_${gpu}_${dtype}.tgz" -C fusedmoe/kernels tuned
    ;;
  bench)
    python3 -m fusedmoe backends > "$OUT/backends_${gpu}.txt"
    # the measured ceilings (what --ceilings auto uses), for the record; the table and plot
    # take PERFORMANCE.md's figures on the lent H200 / H100, as the README's table does
    python3 -c "from fusedmoe.tools.ceilings import measured_ceilings as m; print(m('cuda'))" \
      | tee "$OUT/ceilings_${gpu}.txt"
    ceilings=$([ "$gpu" = gpu ] && echo auto || echo "$gpu")
    python3 -m fusedmoe bench --quant bf16,fp8_block --tokens "$tokens" --backends triton \
      --ceilings "$ceilings" \
      --ref-max-slots 8192 --rep-ms 30 --json "$OUT/bench_${gpu}.json" \
      --csv "$OUT/bench_${gpu}.csv" --plot "$OUT/bench_${gpu}.png" | tee "$OUT/bench_${gpu}.txt"
    ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac

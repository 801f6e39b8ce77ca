#!/usr/bin/env bash
# OpenAI's triton_kernels MXFP4 MoE (the kernel gpt-oss runs on Hopper in vLLM) timed as a peer
# of fusedmoe's backends: one `fusedmoe bench` run, one table, the same MXFP4 weights and the
# same routing for every contender (fusedmoe/tools/peers.py says how the peer is called).
#
#   OUT=/some/dir bash benchmarks/bench_peer_triton_kernels.sh
#
# gpt-oss-120b, mxfp4_w4a16, uniform routing, 1 ... 16384 tokens, on an H100 or H200 (sm90: the
# peer refuses other GPUs, with the reason in the notes). The peer's rows are "triton_kernels",
# its time includes its routing (top-k of the router logits and the sort by expert); its weight
# conversion into triton_kernels' Hopper layouts happens once, untimed. Writes the table
# (.txt), JSON, CSV and, where matplotlib is installed, a PNG plot into $OUT.
#
# Environment:
#   BACKENDS        fusedmoe backends to time (default: every one that supports the row here)
#   TOKENS          token counts (default 1,8,64,256,1024,4096,16384)
#   ROUTING         uniform (default), skewed, skewed:<strength>
#   REP_MS          timed milliseconds per contender and row (default 30)
#   REF_MAX_SLOTS   rows with more M*k slots compare against the first contender instead of the
#                   float64 reference (default 8192, as benchmarks/cli_gpu_runs.sh)
# Run from the repository root; triton_kernels comes from .vendor (git-ignored) unless
# PYTHONPATH already has one.
set -euo pipefail
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEDMOE_CACHE_DIR=${FUSEDMOE_CACHE_DIR:-/tmp/fusedmoe-cache}
export PYTHONPATH="$PWD/.vendor${PYTHONPATH:+:$PYTHONPATH}"
tokens=${TOKENS:-1,8,64,256,1024,4096,16384}
routing=${ROUTING:-uniform}
gpu=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
ceilings=$([ "$gpu" = gpu ] && echo auto || echo "$gpu")
# which triton_kernels the peer will call (the bench says why not if it cannot)
python3 -c "import triton, triton_kernels; print('triton', triton.__version__, '| triton_kernels from', triton_kernels.__path__[0])" \
  | tee "$OUT/peer_triton_kernels_${gpu}_versions.txt" || true
name="peer_triton_kernels_${gpu}_gpt-oss-120b_mxfp4_w4a16_${routing//:/-}"
plot=()  # the PNG only where matplotlib is installed (--plot refuses to run without it)
if python3 -c "import matplotlib" 2>/dev/null; then plot=(--plot "$OUT/$name.png"); fi
python3 -m fusedmoe bench --preset gpt-oss-120b --quant mxfp4_w4a16 --tokens "$tokens" \
  --routing "$routing" --peers triton_kernels ${BACKENDS:+--backends "$BACKENDS"} \
  --ceilings "$ceilings" --rep-ms "${REP_MS:-30}" --ref-max-slots "${REF_MAX_SLOTS:-8192}" \
  --json "$OUT/$name.json" --csv "$OUT/$name.csv" "${plot[@]}" \
  | tee "$OUT/$name.txt"

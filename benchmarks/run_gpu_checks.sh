#!/usr/bin/env bash
# One command for a GPU machine (a few minutes on an H100/H200):
#   1. the CUDA tests (tests/gpu: kernels, CUDA graph replay vs eager, the measured memory plan;
#      in their own pytest process: the interpreter-mode unit tests set TRITON_INTERPRET=1
#      process-wide, so they must not be collected alongside);
#   2. the Llama-3-8B-shaped benchmark, JSON report to $OUT (default gpu_bench.json), then a
#      summary of decode latency with and without CUDA graphs and the engine's memory plan.
# With --tensor-parallel-size N (N > 1) step 2 times the model split over N GPUs (cuda:0..N-1,
# one rank process each) against TP=1 instead, and the summary labels every figure with its TP
# size; it needs N visible GPUs and stops before anything runs when there are fewer. The split
# ranks are bounded by gpu_bench.py's SPLIT_DEADLINE_S (300 s), so the command stays within 10
# minutes.
# Usage: benchmarks/run_gpu_checks.sh [out.json] [gpu_bench.py args, e.g. --requests 200,
#        --tensor-parallel-size 2]
set -euo pipefail

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }

cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python
OUT="gpu_bench.json"
if [[ $# -gt 0 && "$1" != -* ]]; then
  OUT="$1"
  shift
fi

TP=1
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    -h | --help) usage; exit 0 ;;
    --tensor-parallel-size) TP="${args[i + 1]:-}" ;;
    --tensor-parallel-size=*) TP="${args[i]#*=}" ;;
  esac
done
if ! [[ "$TP" =~ ^[1-9][0-9]*$ ]]; then
  echo "--tensor-parallel-size needs a whole number >= 1, got '$TP'" >&2
  exit 2
fi

unset TRITON_INTERPRET
FERRUM_CHECK_TP="$TP" "$PY" - <<'PYEOF'
import os, sys
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch")
tp = int(os.environ["FERRUM_CHECK_TP"])
visible = torch.cuda.device_count()
if visible < tp:
    shown = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    sys.exit(
        f"--tensor-parallel-size {tp} needs {tp} GPUs, but torch sees {visible} "
        f"(CUDA_VISIBLE_DEVICES={shown}); nothing was run"
    )
import triton
names = ", ".join(torch.cuda.get_device_name(i) for i in range(max(tp, 1)))
print(f"torch {torch.__version__}, triton {triton.__version__}, TP={tp} on {names}")
PYEOF

echo "== GPU kernel tests"
"$PY" -m pytest tests/gpu -m gpu -q -p no:cacheprovider

echo "== benchmark (TP=$TP)"
"$PY" benchmarks/gpu_bench.py --out "$OUT" "$@"

echo "== summary (TP=$TP)"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
for row in report.get("decode", []):
    graph = row.get("graph_step_ms")
    extra = f", graph {graph:.3f} ms (x{row['graph_speedup']:.2f})" if graph else ""
    print(f"TP=1 decode b={row['batch']}: eager {row['step_ms']:.3f} ms{extra}")
split = report.get("tensor_parallel")
if split:
    for section, key in (("decode", "batch"), ("prefill", "tokens")):
        for row in split[section]:
            line = f"TP={row['tp']} {section} {key}={row[key]}: eager {row['step_ms']:.3f} ms"
            if "speedup_vs_tp1" in row:
                line += (
                    f" (x{row['speedup_vs_tp1']:.2f} vs TP=1), collectives"
                    f" {row['collectives_ms']:.3f} ms ({row['collectives_share']:.0%} of the step)"
                )
            print(line)
plan = report.get("memory_plan")
if plan:
    parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in plan.items() if k != "kv_blocks")
    print(f"TP=1 memory plan: {parts}, {plan['kv_blocks']} KV blocks")
PYEOF

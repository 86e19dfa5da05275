#!/usr/bin/env bash
# One command for a GPU machine (a few minutes on an H100/H200):
#   1. the CUDA tests (tests/gpu: kernels, CUDA graph replay vs eager, the measured memory plan;
#      in their own pytest process: the interpreter-mode unit tests set TRITON_INTERPRET=1
#      process-wide, so they must not be collected alongside);
#   2. the Llama-3-8B-shaped benchmark, JSON report to $OUT (default gpu_bench.json), then a
#      summary of decode latency with and without CUDA graphs and the engine's memory plan.
# Usage: benchmarks/run_gpu_checks.sh [out.json] [extra gpu_bench.py args, e.g. --requests 200]
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python
OUT="${1:-gpu_bench.json}"
shift || true

unset TRITON_INTERPRET
"$PY" - <<'PYEOF'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch")
import triton
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
PYEOF

echo "== GPU kernel tests"
"$PY" -m pytest tests/gpu -m gpu -q -p no:cacheprovider

echo "== benchmark"
"$PY" benchmarks/gpu_bench.py --out "$OUT" "$@"

echo "== summary"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
for row in report.get("decode", []):
    graph = row.get("graph_step_ms")
    extra = f", graph {graph:.3f} ms (x{row['graph_speedup']:.2f})" if graph else ""
    print(f"decode b={row['batch']}: eager {row['step_ms']:.3f} ms{extra}")
plan = report.get("memory_plan")
if plan:
    parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in plan.items() if k != "kv_blocks")
    print(f"memory plan: {parts}, {plan['kv_blocks']} KV blocks")
PYEOF

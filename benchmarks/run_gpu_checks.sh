#!/usr/bin/env bash
# One command for a GPU machine (a few minutes on an H100/H200):
#   1. the CUDA tests (tests/gpu: kernels, CUDA graph replay vs eager, the measured memory plan;
#      one pytest process per file, apart from the other tests: the interpreter-mode unit tests
#      set TRITON_INTERPRET=1 process-wide, so they must not be collected alongside);
#   2. the Llama-3-8B-shaped benchmark, JSON report to $OUT (default gpu_bench.json), then a
#      summary of decode latency with and without CUDA graphs and the engine's memory plan;
#   3. the engine's host time per decode step on this machine's CPU, phase by phase
#      (benchmarks/step_overhead_bench.py --device cuda: a table beside $OUT, *_host_overhead.md).
# With --tensor-parallel-size N (N > 1) step 2 times the model split over N GPUs (cuda:0..N-1,
# one rank process each) against TP=1 instead, and the summary labels every figure with its TP
# size; it needs N visible GPUs and stops before anything runs when there are fewer. The split
# ranks are bounded by gpu_bench.py's SPLIT_DEADLINE_S (300 s), so the command stays within 10
# minutes.
# A failing step does not stop the later ones (a device lease may allow only one try): the
# benchmark writes its JSON after every section and records a failing section's traceback in
# it; the command exits non-zero if the tests or any section failed. On a bare machine with no
# install of this package, the checkout's server/, kernels/ and client/ go on PYTHONPATH.
# Usage: benchmarks/run_gpu_checks.sh [out.json] [gpu_bench.py args, e.g. --requests 200,
#        --tensor-parallel-size 2]
set -euo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }

cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
if ! "$PY" -c 'import ferrum_server' 2>/dev/null; then
  export PYTHONPATH="$PWD/server:$PWD/kernels:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"
fi
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

failed=0
echo "== GPU tests"
# One process per file: a CUDA fault (an illegal address) poisons the process's context and
# would abort every test after it.
for test_file in tests/gpu/test_*.py; do
  echo "-- $test_file"
  "$PY" -m pytest "$test_file" -m gpu -q -p no:cacheprovider -rfE --durations=3 --timeout 150 \
    || failed=1
done

echo "== benchmark (TP=$TP)"
"$PY" benchmarks/gpu_bench.py --out "$OUT" "$@" || failed=1
[[ -f "$OUT" ]] || { echo "the benchmark wrote no report" >&2; exit 1; }

echo "== host time per decode step on this machine's CPU (one-layer model, CUDA graphs)"
# What the engine's own Python costs a served GPU step, phase by phase (docs/gpu.md).
HOST_OUT="${OUT%.json}_host_overhead.md"
timeout -k 5 150 "$PY" benchmarks/step_overhead_bench.py --device cuda --batches 1,64,256 \
  --rounds 3 --wire 2>"${OUT%.json}_host_overhead.log" | tee "$HOST_OUT" || failed=1

echo "== summary (TP=$TP)"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
for row in report.get("decode", []):
    graph = row.get("graph_step_ms")
    extra = ""
    if graph:
        extra = f", graph {graph:.3f} ms (x{row['graph_speedup']:.2f}; replay alone"
        extra += f" {row['graph_replay_ms']:.3f} ms)"
    print(
        f"TP=1 decode b={row['batch']}: eager {row['step_ms']:.3f} ms{extra}; "
        f"weight-read floor {row['weight_floor_ms']:.3f} ms (eager x{row['vs_weight_floor']:.2f})"
    )
for row in report.get("split_sweep", []):
    best = row["best_splits"]
    best_us = row["s%d_us" % best]
    print(
        f"TP=1 decode attention {row['case']}: heuristic {row['heuristic_us']:.1f} us "
        f"({row['heuristic_kv_gbps']:.0f} GB/s), best {best} splits "
        f"{best_us:.1f} us ({row['best_kv_gbps']:.0f} GB/s)"
    )
prefill = report.get("prefill")
if prefill:
    print(
        f"TP=1 prefill {prefill['tokens']} tokens: {prefill['step_ms']:.1f} ms, "
        f"{prefill['tokens_per_s']:.0f} tok/s, {prefill['fraction_of_gemm_rate']:.0%} of the GEMM rate"
    )
engine = report.get("engine")
if engine:
    print(
        f"TP=1 engine offline: {engine['output_tokens_per_s']:.0f} output tok/s, "
        f"{engine['total_tokens_per_s']:.0f} total tok/s, {engine['requests']} requests "
        f"in {engine['seconds']:.1f} s, {engine['graph_steps']} graph steps"
    )
    ahead = engine.get("launch_ahead")
    if ahead:
        print(
            f"  launched ahead: {ahead['output_tokens_per_s']:.0f} output tok/s "
            f"(x{ahead['speedup']:.2f}), {ahead['graph_steps']} graph steps, "
            f"{ahead['identical_outputs']:.0%} identical outputs"
        )
    for kind, row in engine.get("steps_by_kind", {}).items():
        print(
            f"  {kind}: {row['steps']} steps, {row['seconds']:.2f} s, p50 {row['p50_ms']:.1f} ms; "
            f"engine forward {row['mean_forward_ms']:.1f}, sample {row['mean_sample_ms']:.1f}, "
            f"total {row['mean_engine_total_ms']:.1f} ms a step"
        )
profiles = dict(report.get("profile", {}))
if engine and engine.get("profile_decode_steps"):
    profiles["engine_decode_steps"] = engine["profile_decode_steps"]
for name, prof in profiles.items():
    print(
        f"TP=1 profile {name}: {prof['wall_ms_per_step']:.2f} ms a step, device busy "
        f"{prof['device_busy_ms_per_step']:.2f} ms, host ops {prof['host_op_ms_per_step']:.2f} ms"
    )
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
for name in report.get("errors", {}):
    print(f"section {name} FAILED (traceback in the report's 'errors')")
PYEOF
exit "$failed"

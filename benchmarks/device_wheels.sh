#!/usr/bin/env bash
# Wheels for a bare GPU machine whose Python already holds torch and triton but not this
# package's other needs: grpcio, protobuf, grpcio-health-checking and structlog, at the versions
# this checkout's .venv runs (the generated protobuf code checks its runtime's version), for
# CPython 3.12 on x86-64 Linux. They go to .whl/ (ignored via .git/info/exclude); on the GPU
# machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site; PYTHON=python3 benchmarks/run_gpu_checks.sh out.json
# Usage: benchmarks/device_wheels.sh [python-version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
target="${1:-3.12}"
pins=$("$PY" - <<'PYEOF'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in
      ("grpcio", "protobuf", "grpcio-health-checking", "structlog")))
PYEOF
)
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$target" \
  --implementation cp "${platforms[@]}" -d .whl $pins
ls .whl

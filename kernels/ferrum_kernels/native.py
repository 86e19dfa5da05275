"""The native CPU kernels (``csrc/``), compiled on first use into one extension module.

Built with ``torch.utils.cpp_extension.load_inline`` for the CPU it runs on (``-march=native``);
a C++ compiler and ninja must be present. The build (about a minute) is cached by torch per source
digest, CPU flags, venv and ninja, so later processes load it in milliseconds. When it cannot be
built, or ``FERRUM_CPU_NATIVE=0``, ``load()`` returns None and every caller keeps its torch path.
On a CPU with AMX the bfloat16 GEMM and prefill attention run on its tiles; ``FERRUM_CPU_AMX=0``
keeps them on the AVX-512 register tiles (docs/cpu-kernels.md).

The outcome is logged once through stdlib logging (the server renders it as a JSON line): event
``native_kernels`` with ``state=loaded``, the seconds the load took and ``amx`` (``on``, ``off``
or ``unavailable``), or a warning
``native_kernels_unavailable`` with the reason (no compiler on PATH, no ninja, or the build's last
lines). Nothing is written to stderr directly, and a missing compiler is found before torch is
asked to build, so torch's own compiler warnings do not appear either.

Every function releases the GIL while it runs (``_bindings``): the kernels touch no Python
object, and a server's other threads (its gRPC handlers: health checks, admission probes, the
next step's parse) then need not wait for a whole GEMM or attention call on the engine thread.
Served, under a prefill-heavy load, a health check's p99 latency went from 24-25 ms to 6-8 ms
(``benchmarks/probe_latency_bench.py``, docs/operations.md).

``-ffast-math`` lets the attention reductions and ``exp`` vectorise (measured: about 15% on the
decode kernel over ``omp simd`` reductions and a hand-written exp). The fused elementwise kernels
still round to bfloat16 with explicit integer arithmetic, and ``-ffp-contract=off`` stops the
compiler fusing their a*b+c into FMAs, so products and sums round where the torch reference's
do: rotary is bit-identical (tested); RMSNorm differs only through the order of its sum and
SwiGLU through exp's last bit (at most one bfloat16 ulp, rarely; tested).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["available", "load", "with_common_header"]

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (
    "decode_attention.cpp",
    "fused_ops.cpp",
    "sampling.cpp",
    "prefill_attention.cpp",
    "gemm.cpp",
    "kv_store.cpp",
    "decode_layers.cpp",
)
_FUNCTIONS = [
    "decode_attention",
    "decode_shared_prefixes",
    "shared_prompt_available",
    "set_shared_prompt",
    "rms_norm",
    "add_rms_norm_",
    "silu_and_mul",
    "rotary_",
    "causal_softmax_",
    "argmax_logsumexp",
    "prefill_attention",
    "prefill_attention_vectorized",
    "gemm_isa",
    "gemm_bf16_available",
    "gemm_bf16_emulated",
    "amx_available",
    "set_amx",
    "pack_gemm_weight",
    "packed_gemm",
    "pack_gemm_weight_halves",
    "packed_gemm_halves",
    "packed_gemm_widened",
    "packed_gemm_greedy",
    "store_kv_",
    "rotary_store_kv_",
    "decode_layers",
    "prefill_layers",
]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-ffp-contract=off", "-std=c++17"]

_LOG = logging.getLogger(__name__)
# Most characters of a failed build's output kept in the log line (its tail holds the error).
_REASON_CHARS = 800

_lock = threading.Lock()
_module: Any = None
_failed = False


def _cpu_tag() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    return hashlib.sha1((platform.machine() + flags).encode()).hexdigest()[:8]


def with_common_header(*sources: str, header: str | None = None) -> str:
    """Kernel sources as one translation unit: ``csrc/common.h`` inlined once, ahead of them
    (their own ``#include "common.h"`` lines dropped), so a build's digest covers it too. Also
    how a benchmark builds one kernel file of any revision on its own, with `header` that
    revision's ``common.h`` (the kernels and the header change together)."""
    include = '#include "common.h"'
    text = (_CSRC / "common.h").read_text() if header is None else header
    parts = [text.replace("#pragma once", "")]
    parts += [source.replace(include, "") for source in sources]
    return "\n".join(parts)


def kernel_at_revision(rev: str, kernel: str) -> str | None:
    """The kernel file `kernel` (a name in ``csrc/``) as git revision `rev` had it, after that
    revision's ``common.h`` (the two change together), as one translation unit for
    ``build_alone``; None where both files are as in the working tree (the package's own build
    then serves). How a benchmark's ``--old REV`` gets the kernel it compares against."""

    def at_revision(name: str) -> str:
        # "./name": the path relative to csrc/, where git runs.
        return subprocess.run(
            ["git", "show", f"{rev}:./{name}"],
            cwd=_CSRC,
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    source, header = at_revision(kernel), at_revision("common.h")
    if source == (_CSRC / kernel).read_text() and header == (_CSRC / "common.h").read_text():
        return None
    return with_common_header(source, header=header)


def build_alone(tag: str, source: str, functions: list[str]) -> Any:
    """`source` (a whole translation unit: see ``with_common_header``) built on its own, with
    the package's flags, into a module exposing `functions`: how a benchmark builds a kernel
    as a git revision had it, beside the package's module. Named by `tag` and a digest of the
    source, so a rerun reuses the build."""
    from torch.utils.cpp_extension import load_inline

    digest = hashlib.sha1(source.encode()).hexdigest()[:10]
    return load_inline(
        name=f"ferrum_{tag}_{digest}",
        cpp_sources=source,
        functions=functions,
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
    )


def _source() -> str:
    return with_common_header(*((_CSRC / name).read_text() for name in _SOURCES)) + _bindings()


def _bindings() -> str:
    """The module's bindings, each releasing the GIL while its function runs (torch's own
    generated ones, ``load_inline(functions=...)``, hold it)."""
    wrap = "torch::wrap_pybind_function_no_gil"
    lines = [f'  m.def("{name}", {wrap}({name}));' for name in _FUNCTIONS]
    return "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n" + "\n".join(lines) + "\n}\n"


def _missing_toolchain() -> str | None:
    """Why the module cannot be built here, checked before torch tries (and warns)."""
    compiler = os.environ.get("CXX", "c++")  # what torch's extension builder runs
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed"
    return None


def _unavailable(reason: str) -> None:
    reason = " ".join(reason.split())  # one line, whatever the compiler printed
    if len(reason) > _REASON_CHARS:
        reason = "..." + reason[-_REASON_CHARS:]
    _LOG.warning("native_kernels_unavailable", extra={"reason": reason, "fallback": "torch"})


def load() -> Any:
    """The compiled module, or None when it is disabled or cannot be built (reported once)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        if os.environ.get("FERRUM_CPU_NATIVE", "1") == "0":
            _failed = True
            return None
        started = time.monotonic()
        try:
            missing = _missing_toolchain()
            if missing is not None:
                _unavailable(missing)
                _failed = True
                return None
            from torch.utils.cpp_extension import load_inline

            source = _source()
            # The build folder is keyed by the toolchain too: two venvs (their include paths in
            # build.ninja) or two ninjas (they hash a build command differently) sharing one
            # folder each rebuilt it on every switch, about a minute each time.
            toolchain = f"{sys.prefix} {shutil.which('ninja')}"
            digest = hashlib.sha1((source + " ".join(_FLAGS) + toolchain).encode()).hexdigest()[:10]
            _module = load_inline(
                name=f"ferrum_cpu_native_{digest}_{_cpu_tag()}",
                cpp_sources=source,
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # a failed build, a bad flag, ...: the torch paths still work
            _unavailable(f"{type(exc).__name__}: {exc}")
            _failed = True
            _module = None
        else:
            load_s = round(time.monotonic() - started, 2)
            amx = _amx_setting(_module)
            _LOG.info("native_kernels", extra={"state": "loaded", "load_s": load_s, "amx": amx})
    return _module


def _amx_setting(module: Any) -> str:
    """Applies FERRUM_CPU_AMX to a freshly loaded module: "on" (the bfloat16 GEMM and prefill
    attention run on AMX tiles), "off" (FERRUM_CPU_AMX=0: the register tiles instead) or
    "unavailable" (no AMX in this CPU or build, or Linux refused the tiles)."""
    if not module.amx_available():
        return "unavailable"
    if os.environ.get("FERRUM_CPU_AMX", "1").strip() == "0":
        module.set_amx(False)
        return "off"
    return "on"


def available() -> bool:
    return load() is not None

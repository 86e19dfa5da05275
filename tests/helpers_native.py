"""Skip markers for tests of the native GEMMs: what this CPU's build of them has."""

from __future__ import annotations

import pytest
from ferrum_kernels import native

_module = native.load()
needs_native_gemm = pytest.mark.skipif(
    _module is None or not _module.gemm_isa()[0], reason="native GEMM not built (needs AVX2)"
)
needs_avx512_float32_gemm = pytest.mark.skipif(
    _module is None or not _module.gemm_isa()[1],
    reason="native AVX-512 float32 GEMM not built (needs AVX-512F)",
)
needs_bf16_gemm = pytest.mark.skipif(
    _module is None or not _module.gemm_bf16_available(),
    reason="native bfloat16 GEMM not built (needs AVX512_BF16)",
)
needs_amx_gemm = pytest.mark.skipif(
    _module is None or not _module.amx_available(),
    reason="no AMX tiles here (needs a CPU with AMX-BF16 and Linux granting them)",
)

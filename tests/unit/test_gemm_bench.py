"""A seconds-long smoke run of the GEMM benchmark (native against oneDNN, as CI runs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ferrum_kernels import native
from ferrum_kernels.cpu_linear import mkldnn_linear_available
from helpers_scripts import load_script

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gemm_bench.py"

_module = native.load()
pytestmark = pytest.mark.skipif(
    _module is None or not _module.gemm_isa()[0] or not mkldnn_linear_available(),
    reason="needs the native GEMM (an AVX2 build) and oneDNN",
)


def test_smoke_run_times_both_kernels_and_they_agree() -> None:
    bench: Any = load_script("ferrum_gemm_bench", _BENCH)
    results = bench.main(["--rows", "7,64", "--rounds", "1", "--layers", "1"])
    assert sorted(results) == ["M=64 native", "M=64 onednn", "M=7 native", "M=7 onednn"]
    for row in results.values():
        assert row["layers_gflops"] > 0 and row["lm_head_gflops"] > 0
        assert row["diff"] < 1e-5  # weights N(0, 0.02), inputs N(0, 1), K = 768


@pytest.mark.skipif(_module is None or not _module.gemm_bf16_available(), reason="needs AVX-512F")
def test_bfloat16_smoke_run_compares_the_native_bf16_gemm() -> None:
    bench: Any = load_script("ferrum_gemm_bench", _BENCH)
    results = bench.main(["--rows", "9", "--rounds", "1", "--layers", "1", "--dtype", "bfloat16"])
    # On an AMX CPU the native packs are timed on the register tiles too.
    extra = ["M=9 avx512"] if _module.amx_available() else []
    assert sorted(results) == sorted(["M=9 native", "M=9 onednn", *extra])
    # Outputs of about 0.5 in magnitude, each rounded to bfloat16 by both: an ulp or two apart.
    assert results["M=9 native"]["layers_gflops"] > 0 and results["M=9 native"]["diff"] < 0.02


@pytest.mark.skipif(_module is None or not _module.gemm_bf16_available(), reason="needs AVX-512F")
def test_old_revision_smoke_run_times_both_builds() -> None:
    """--old HEAD: the working tree's GEMM against the last commit's (the package's own build
    for both where they are the same, as in CI), every row of both timed, outputs compared."""
    bench: Any = load_script("ferrum_gemm_bench", _BENCH)
    results = bench.main(
        ["--rows", "40", "--rounds", "2", "--layers", "1", "--dtype", "bfloat16", "--old", "HEAD"]
    )
    assert sorted(results) == ["M=40 new", "M=40 old"]
    for row in results.values():
        assert row["gflops"] > 0 and row["best_gflops"] >= row["gflops"]
        assert row["diff"] < 0.02  # the same kernel, or one an ulp or two apart

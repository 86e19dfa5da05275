"""A seconds-long smoke run of the LM head benchmark (as CI runs it): its three paths, checked
against each other by the benchmark itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ferrum_kernels import native
from helpers_scripts import load_script

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_head_bench.py"


def _bf16_gemm() -> bool:
    module = native.load()
    return module is not None and bool(module.gemm_bf16_available())


@pytest.mark.skipif(not _bf16_gemm(), reason="no native bfloat16 GEMM on this CPU")
def test_smoke_run_times_every_path() -> None:
    bench: Any = load_script("ferrum_lm_head_bench", _BENCH)
    results = bench.main(["--rows", "5", "--vocab", "333", "--hidden", "40", "--rounds", "2"])
    assert sorted(results) == ["copy", "folded", "widened"]
    assert sorted(results["copy"]) == ["argmax_logsumexp", "float", "gemm", "total"]
    assert sorted(results["widened"]) == ["argmax_logsumexp", "gemm", "total"]
    assert sorted(results["folded"]) == ["gemm_greedy", "total"]
    assert all(ms > 0 for row in results.values() for ms in row.values())


@pytest.mark.parametrize(
    "args", [["--rows", "0"], ["--vocab", "0"], ["--rounds", "0"], ["--flush-mb", "-1"]]
)
def test_bad_arguments_are_refused(args: list[str]) -> None:
    bench: Any = load_script("ferrum_lm_head_bench", _BENCH)
    with pytest.raises(SystemExit):
        bench.main(args)

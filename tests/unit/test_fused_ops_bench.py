"""A seconds-long smoke run of the fused elementwise kernels' benchmark (as CI runs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ferrum_kernels import native
from helpers_scripts import load_script

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "fused_ops_bench.py"

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ toolchain")


def test_smoke_run_times_both_kernels_in_both_dtypes() -> None:
    bench: Any = load_script("ferrum_fused_ops_bench", _BENCH)
    results = bench.main(["--rows", "3,64", "--rounds", "1", "--calls", "2", "--pool-mb", "4"])
    assert sorted(results) == [
        "bfloat16 rows=3",
        "bfloat16 rows=64",
        "float32 rows=3",
        "float32 rows=64",
    ]
    for row in results.values():
        assert row["add_rms_norm_us"] > 0 and row["rotary_us"] > 0
        assert row["rotary_store_us"] > 0 and row["fused_us"] > 0


@pytest.mark.parametrize(
    "args",
    [
        ["--rows", "0"],
        ["--rounds", "0"],
        ["--calls", "-1"],
        ["--dtype", "float16"],
        ["--pool-mb", "0"],
    ],
)
def test_bad_arguments_are_refused(args: list[str]) -> None:
    bench: Any = load_script("ferrum_fused_ops_bench", _BENCH)
    with pytest.raises(SystemExit):
        bench.main(args)

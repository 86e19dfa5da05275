"""A seconds-long smoke run of the CPU prefill-attention microbenchmark (as CI runs it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ferrum_kernels import native
from helpers_scripts import load_script

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_attention_bench.py"

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ toolchain")


def test_smoke_run_times_both_paths_and_they_agree(tmp_path: Path) -> None:
    bench: Any = load_script("ferrum_prefill_bench", _BENCH)
    out = tmp_path / "bench.json"
    bench.main(["--repeats", "1", "--shapes", "40x40,24x90", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["dtype"], r["n"], r["ctx"]) for r in rows] == [
        ("float32", 40, 40),
        ("float32", 24, 90),
        ("bfloat16", 40, 40),
        ("bfloat16", 24, 90),
    ]
    for row in rows:
        assert row["old_ms"] > 0 and row["new_ms"] > 0
        # The two paths compute the same attention: float32 to rounding, bfloat16 to a few ulps.
        assert row["max_abs_diff"] < (1e-5 if row["dtype"] == "float32" else 3e-2)


def test_old_revision_runs_as_the_old_column(tmp_path: Path) -> None:
    bench: Any = load_script("ferrum_prefill_bench_old", _BENCH)
    out = tmp_path / "bench.json"
    # --old HEAD: the last commit's kernel against the working tree's (the same source in CI,
    # where the package's own build serves as both, so the outputs are equal).
    args = ["--repeats", "1", "--dtypes", "bfloat16", "--shapes", "40x40", "--old", "HEAD"]
    bench.main([*args, "--json", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["old_ms"] > 0 and row["new_ms"] > 0
    assert row["max_abs_diff"] < 3e-2

"""A seconds-long smoke run of the KV placement benchmark (as CI runs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ferrum_kernels import native
from helpers_scripts import load_script

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_layout_bench.py"

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ toolchain")


def test_smoke_run_lays_each_cache_out_in_one_run_where_the_free_list_scatters_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench: Any = load_script("ferrum_kv_layout_bench", _BENCH)
    # Steps of 40 tokens split most of the smoke prompts (8-48 tokens) across steps.
    found = bench.main(["--workload", "smoke", "--rounds", "1", "--step-tokens", "40"])
    (runs,), (free_list,) = found["runs"], found["free-list"]
    assert runs["blocks"] == free_list["blocks"] > 12
    assert runs["out_of_order"] == 0
    assert free_list["out_of_order"] > 0
    assert runs["attention_ms"] > 0 and free_list["attention_ms"] > 0
    out = capsys.readouterr().out
    assert "runs     : 0 of" in out and "free-list:" in out

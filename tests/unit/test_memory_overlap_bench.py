"""A seconds-long smoke run of the memory/compute overlap benchmark (as CI runs it)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from ferrum_kernels import native
from helpers_scripts import load_script

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_overlap_bench.py"

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ toolchain")


def test_the_walks_read_each_items_rows_through_its_table() -> None:
    bench: Any = load_script("ferrum_overlap_bench", _BENCH)
    module = bench._build()
    ctx, blocks = 20, 2  # the second block half used: rows past ctx must not count
    pool = torch.randn(2, bench.ITEMS * blocks, bench.BLOCK, bench.ROW, dtype=torch.float32)
    tables = torch.randperm(bench.ITEMS * blocks).view(bench.ITEMS, blocks).contiguous()
    token = torch.arange(ctx)
    slots = tables[:, token // bench.BLOCK] * bench.BLOCK + token % bench.BLOCK  # [items, ctx]
    expected = float(pool.view(2, -1, bench.ROW)[:, slots.flatten()].double().sum())
    read = module.walk([pool], tables, ctx, 0, 2, 4)
    assert math.isclose(read, expected, rel_tol=1e-4, abs_tol=1e-2)
    # Read by head: the same rows in another order.
    assert math.isclose(
        module.walk([pool], tables, ctx, 4, 2, 4), expected, rel_tol=1e-4, abs_tol=1e-2
    )
    for mode in (2, 3):  # FMAs by 0.1, 0.2 and 0.3: 0.6 of the plain sum
        assert math.isclose(
            module.walk([pool], tables, ctx, mode, 1, 4), 0.6 * expected, rel_tol=1e-4, abs_tol=1e-2
        )


def test_smoke_run_reports_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    bench: Any = load_script("ferrum_overlap_bench", _BENCH)
    results = bench.main(["--ctx", "40", "--layers", "2", "--rounds", "1", "--threads", "1"])
    assert list(results) == [1]
    row = results[1]
    assert all(row[mode] > 0 for mode in bench.MODES)
    assert math.isfinite(row["overlap"])
    assert "threads 1: read" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--layers", "0"], ["--threads", "2,x"], ["--threads", "0"]])
def test_bad_arguments_are_refused(args: list[str]) -> None:
    bench: Any = load_script("ferrum_overlap_bench", _BENCH)
    with pytest.raises(SystemExit):
        bench.main(args)

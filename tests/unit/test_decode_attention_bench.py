"""A seconds-long smoke run of the CPU decode-attention microbenchmark (as CI runs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ferrum_kernels import native
from helpers_scripts import load_script

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_attention_bench.py"

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ toolchain")


@pytest.mark.parametrize("in_order", [False, True])
def test_smoke_run_walks_every_pool_and_the_builds_agree(
    in_order: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    bench: Any = load_script("ferrum_decode_bench", _BENCH)
    # --old HEAD: the working tree's kernel against the last commit's (the same in CI).
    args = ["--ctx", "20", "--rounds", "2", "--layers", "3"] + (["--in-order"] if in_order else [])
    times = bench.main(args)
    assert len(times["old"]) == len(times["new"]) == 2
    assert all(ms > 0 for ms in times["old"] + times["new"])
    assert times["diff"][0] < 1e-5  # float32: the same kernel, or two close builds
    # The machine's read rate before each round, printed with them.
    assert len(times["memory_gbs"]) == 2 and all(r > 0 for r in times["memory_gbs"])
    out = capsys.readouterr().out
    layout = "consecutive" if in_order else "shuffled"
    assert f"3 pool(s), {layout} blocks" in out
    assert f"memory read GB/s by round: {times['memory_gbs']}" in out
    assert out.count("by round") == 3  # the rates, and each build's times


def test_a_shared_prefix_gives_every_item_the_same_first_blocks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench: Any = load_script("ferrum_decode_bench", _BENCH)
    times = bench.main(["--ctx", "40", "--rounds", "1", "--shared-prefix", "33"])
    assert times["diff"][0] < 1e-5
    assert "shuffled blocks, the first 2 shared" in capsys.readouterr().out


def test_bad_counts_are_refused() -> None:
    bench: Any = load_script("ferrum_decode_bench", _BENCH)
    with pytest.raises(SystemExit):
        bench.main(["--layers", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--ctx", "40", "--shared-prefix", "34"])

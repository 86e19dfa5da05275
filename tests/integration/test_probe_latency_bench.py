"""A seconds-long smoke run of the health-check latency bench (as CI runs it): a served smoke
model answers health checks while the reference scheduler drives it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers_scripts import load_script

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "probe_latency_bench.py"


def test_smoke_run_times_health_checks_during_steps(tmp_path: Path) -> None:
    bench: Any = load_script("ferrum_probe_latency_bench", _BENCH)
    args = [
        "--workload", "smoke",
        "--dtype", "float32",
        "--prompts", "6",
        "--prompt-tokens", "32",
        "--new-tokens", "3",
        "--interval-ms", "0",
        "--cache-dir", str(tmp_path),
    ]  # fmt: skip
    result = bench.main(args)
    assert result["checks"] >= 1
    assert 0 < result["p50_ms"] <= result["p90_ms"] <= result["p99_ms"] <= result["max_ms"]
    assert result["wall_s"] > 0


@pytest.mark.parametrize(
    "args",
    [["--prompts", "0"], ["--prompt-tokens", "0"], ["--new-tokens", "0"], ["--interval-ms", "-1"]],
)
def test_bad_arguments_are_refused(args: list[str]) -> None:
    bench: Any = load_script("ferrum_probe_latency_bench", _BENCH)
    with pytest.raises(SystemExit):
        bench.main(args)

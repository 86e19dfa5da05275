"""A seconds-long smoke run of the AMX stream benchmark (as CI runs it), and its tile loop's
products against torch where the CPU has AMX tiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ferrum_kernels import native
from helpers_scripts import load_script

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "amx_stream_bench.py"

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ toolchain")


def _bench() -> Any:
    return load_script("ferrum_amx_stream_bench", _BENCH)


def test_the_tile_loop_multiplies_what_the_gemm_packs() -> None:
    bench = _bench()
    module = bench._build()
    if not module.amx_ready():
        pytest.skip("no AMX tiles on this CPU, build or kernel")
    torch.manual_seed(0)
    panels = 3
    weight = torch.randn(panels * bench.COLS, bench.K).bfloat16()  # [N, K]
    packed = native.load().pack_gemm_weight(weight)  # the native GEMM's own panels
    x = torch.randn(bench.ROWS, bench.K).bfloat16()
    got = module.products(packed, x)  # [P, 64, 32]
    want = (x.double() @ weight.double().T).view(bench.ROWS, panels, bench.COLS).transpose(0, 1)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-3)
    with pytest.raises(RuntimeError, match="x must be"):
        module.products(packed, x[:32].contiguous())


def test_smoke_run_reports_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    results = bench.main(["--mb", "4", "--rounds", "1", "--cached-panels", "4"])
    out = capsys.readouterr().out
    if not results:
        assert "no AMX tiles" in out
        return
    assert all(results[mode] > 0 for mode in bench.MODES)
    assert "overlap" in out and "read" in out


@pytest.mark.parametrize("args", [["--mb", "0"], ["--rounds", "0"], ["--cached-panels", "x"]])
def test_bad_arguments_are_refused(args: list[str]) -> None:
    with pytest.raises(SystemExit):
        _bench().main(args)

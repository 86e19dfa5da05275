"""The W1 step profiler's per-kernel clock (benchmarks/profile_w1_steps.py --kernels): it times
native kernels and packed linears by call, and puts back what it wrapped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ferrum_kernels import cpu_linear, native
from ferrum_kernels.cpu_linear import packed_linear
from helpers_scripts import load_script

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_w1_steps.py"


def test_clock_times_kernels_and_linears_then_restores_them() -> None:
    if native.load() is None:
        pytest.skip("no C++ toolchain for the native kernels")
    weight = torch.randn(24, 8)
    pack = packed_linear(weight)
    if pack is None:
        pytest.skip("no packed linears on this CPU")
    script: Any = load_script("ferrum_profile_w1_steps", _SCRIPT)
    clock = script.KernelClock()
    load, call = native.load, cpu_linear.PackedWeight.__call__
    clock.install()
    try:
        x = torch.randn(3, 8)
        out = pack(x)
        pack(x)
        native.load().silu_and_mul(torch.randn(3, 8))
    finally:
        clock.remove()
    torch.testing.assert_close(out, x @ weight.T, atol=1e-5, rtol=0)
    assert clock.calls == {"linear 24 x 8": 2, "silu_and_mul": 1}
    assert all(seconds > 0 for seconds in clock.seconds.values())
    # Put back: later calls are not counted.
    assert native.load is load and cpu_linear.PackedWeight.__call__ is call
    pack(x)
    assert clock.calls["linear 24 x 8"] == 2
    report = clock.report("step", wall_ms=5.0, reps=1, faults=12.0)
    assert "linear 24 x 8" in report and "the rest" in report
    assert "12 minor page faults" in report


@pytest.mark.parametrize(("method", "suffix"), [("widened", "float32"), ("greedy", "greedy")])
def test_clock_times_a_heads_gemm_then_restores_it(method: str, suffix: str) -> None:
    """The LM head's widened GEMM and its folded greedy choice are clocked under their own
    names, and put back after."""
    module = native.load()
    if module is None or not module.gemm_bf16_available():
        pytest.skip("no native bfloat16 GEMM on this CPU")
    pack = cpu_linear.PackedWeight(torch.randn(40, 16).bfloat16(), None, kernel="native")
    script: Any = load_script("ferrum_profile_w1_steps", _SCRIPT)
    clock = script.KernelClock()
    original = getattr(cpu_linear.PackedWeight, method)
    x = torch.randn(3, 16).bfloat16()
    clock.install()
    try:
        out = getattr(pack, method)(x)
    finally:
        clock.remove()
    logits = pack(x).float()
    if method == "widened":
        assert torch.equal(out, logits)
    else:
        assert out is not None and torch.equal(out[0], logits.argmax(dim=-1))
    assert clock.calls == {f"linear 40 x 16 -> {suffix}": 1}
    assert getattr(cpu_linear.PackedWeight, method) is original


def test_clock_times_a_layers_direct_gemm_calls_once() -> None:
    """A GEMM entry point a layer calls directly (the native decode layer's linears) is timed
    as its linear, and a packed linear's own call of it is not counted a second time."""
    module = native.load()
    if module is None:
        pytest.skip("no C++ toolchain for the native kernels")
    weight = torch.randn(24, 8)
    pack = packed_linear(weight)
    if pack is None or pack.kernel != "native":
        pytest.skip("no native packed linears on this CPU")
    script: Any = load_script("ferrum_profile_w1_steps", _SCRIPT)
    clock = script.KernelClock()
    gemm = module.packed_gemm
    x = torch.randn(3, 8)
    clock.install()
    try:
        direct = native.load().packed_gemm(x, pack.packed(), None, 24)
        pack(x)
    finally:
        clock.remove()
    torch.testing.assert_close(direct, x @ weight.T, atol=1e-5, rtol=0)
    assert clock.calls == {"linear 24 x 8": 2}
    assert native.load().packed_gemm is gemm

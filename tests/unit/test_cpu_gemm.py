"""The native GEMMs (``csrc/gemm.cpp``) that packed linears run: float32 (AVX-512, or AVX2 and
FMA) and bfloat16 (AVX-512: vdpbf16ps with AVX512_BF16, else emulated with FMAs). Each against
float64 F.linear over the edges of its blocking, batch-invariant per row, and the kernel choice
(``FERRUM_CPU_GEMM``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from ferrum_kernels import cpu_linear, native
from ferrum_kernels.cpu_linear import PackedWeight, gemm_kernel, mkldnn_linear_available
from helpers_native import (
    needs_amx_gemm,
    needs_avx512_float32_gemm,
    needs_bf16_gemm,
    needs_native_gemm,
)

_module = native.load()


@contextmanager
def _register_tiles() -> Iterator[None]:
    """The native bfloat16 GEMM on its register tiles instead of AMX's, for the block."""
    assert _module is not None
    _module.set_amx(False)
    try:
        yield
    finally:
        _module.set_amx(True)


@pytest.fixture
def choose_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Lets a test set FERRUM_CPU_GEMM and have it read again; restores the cached choice."""
    saved = cpu_linear._native_gemm
    cpu_linear._native_gemm = None
    yield
    cpu_linear._native_gemm = saved


def _packed_gemm_on(
    threads: int, x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None, n: int
) -> torch.Tensor:
    """The native packed_gemm run with `threads` intra-op threads (restored after)."""
    assert _module is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out: torch.Tensor = _module.packed_gemm(x, packed, b, n)
    finally:
        torch.set_num_threads(before)
    return out


def _float64_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())


@needs_native_gemm
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 16, 8),  # one row, one panel
        (5, 33, 70),  # partial row panel, partial last column panel
        (64, 200, 768),  # a decode step's rows, K = one block
        (151, 48, 1000),  # two row blocks (144 rows each), K over one block (768)
        (7, 20, 1),
        (12, 40, 13),  # whole row panels, K past a multiple of 8 (the packing's scalar tail)
        (6, 16, 9),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_gemm_matches_float64_linear(
    m: int, n: int, k: int, bias: bool, threads: int
) -> None:
    assert _module is not None
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    packed = _module.pack_gemm_weight(w)
    cols = 32 if _module.gemm_isa()[1] else 16  # the AVX-512 kernel's panels, or the AVX2 one's
    assert packed.shape == (-(-n // cols), k, cols)
    got = _packed_gemm_on(threads, x, packed, b, n)
    want = _float64_linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # float32 sums of k products of N(0, 1) values: error grows about with sqrt(k).
    torch.testing.assert_close(got.double(), want, atol=2e-6 * k**0.5 * 4, rtol=1e-5)


@needs_native_gemm
def test_native_gemm_rows_do_not_depend_on_the_batch() -> None:
    """Each row is summed in the same order whatever else is batched with it."""
    assert _module is not None
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(100, 900, generator=gen)
    x = torch.randn(200, 900, generator=gen)
    packed = _module.pack_gemm_weight(w)
    whole = _module.packed_gemm(x, packed, None, 100)
    # Batches ending in a 6-row panel of every fill from 1 to 5 rows, and in whole panels.
    for rows in (
        slice(0, 1),
        slice(3, 10),
        slice(140, 200),
        *(slice(9, 9 + n) for n in (2, 3, 4, 5, 16)),
    ):
        assert torch.equal(
            _module.packed_gemm(x[rows].contiguous(), packed, None, 100), whole[rows]
        )


@needs_native_gemm
def test_native_gemm_refuses_mismatched_inputs() -> None:
    assert _module is not None
    packed = _module.pack_gemm_weight(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="K=8, x has K=9"):
        _module.packed_gemm(torch.randn(2, 9), packed, None, 20)
    with pytest.raises(RuntimeError, match="N does not match"):
        _module.packed_gemm(torch.randn(2, 8), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias must be"):
        _module.packed_gemm(torch.randn(2, 8), packed, torch.randn(19), 20)
    with pytest.raises(RuntimeError, match="float32"):
        _module.packed_gemm(torch.randn(2, 8, dtype=torch.float64), packed, None, 20)


@needs_bf16_gemm
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 32, 8),  # one row, one panel
        (5, 45, 767),  # a partial row tile and last panel (13 columns), an odd K
        (64, 1280, 768),  # a decode step's qkv
        (9, 100, 64),  # a tile of one row after a whole one; a panel of four columns
        (17, 33, 3),  # a panel of one column past the first
        (300, 64, 2048),  # several blocks of rows (64 each at this K, 32 emulated), K long
        (3, 16, 1),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_bf16_gemm_matches_float64_linear(
    m: int, n: int, k: int, bias: bool, threads: int
) -> None:
    assert _module is not None
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    packed = _module.pack_gemm_weight(w)
    assert packed.shape == (-(-n // 32), -(-k // 2), 32, 2) and packed.dtype == torch.bfloat16
    got = _packed_gemm_on(threads, x, packed, b, n)
    want = _float64_linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # One rounding to bfloat16 (half an ulp: 2^-9 relative) after a float32 sum of k exact
    # products.
    torch.testing.assert_close(got.double(), want, atol=1e-5 * k**0.5 * 4, rtol=2**-8)
    # As F.linear rounds, but for sums that land within float32 error of a rounding tie.
    same = got == torch.nn.functional.linear(x, w, b)
    assert same.float().mean() > 0.97


@needs_bf16_gemm
def test_native_bf16_gemm_rows_do_not_depend_on_the_batch() -> None:
    assert _module is not None
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(70, 2048, generator=gen).bfloat16()
    x = torch.randn(200, 2048, generator=gen).bfloat16()
    packed = _module.pack_gemm_weight(w)
    whole = _module.packed_gemm(x, packed, None, 70)
    # Batches ending in a tile of every fill from 1 to 8 rows, and across a block of rows (64;
    # 32 where the GEMM is emulated, its x widened to float32).
    for rows in (slice(0, 1), slice(60, 130), *(slice(9, 9 + n) for n in range(2, 9))):
        assert torch.equal(_module.packed_gemm(x[rows].contiguous(), packed, None, 70), whole[rows])


@pytest.mark.skipif(
    _module is None or not _module.gemm_bf16_emulated(),
    reason="the bfloat16 GEMM is vdpbf16ps here (the emulated one needs AVX-512F without it)",
)
@pytest.mark.parametrize(("m", "n", "k"), [(3, 40, 9), (11, 33, 64), (70, 64, 301)])
def test_the_emulated_bf16_gemm_sums_as_vdpbf16ps_defines_it(m: int, n: int, k: int) -> None:
    """Without AVX512_BF16 each step of K adds its pair's odd product, then its even one, into
    the float32 sum (as Intel defines vdpbf16ps; the products of bfloat16 values are exact in
    float32, so each add is one rounding), and the sum is rounded to bfloat16 once. Odd Ks
    end on an even element alone; 40 and 33 columns leave panels partly empty."""
    assert _module is not None
    gen = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    got = _module.packed_gemm(x, _module.pack_gemm_weight(w), b, n)
    xf, wf = x.float(), w.float()
    acc = torch.zeros(m, n)
    for i in range(0, k, 2):
        if i + 1 < k:
            acc = acc + xf[:, i + 1 : i + 2] * wf[:, i + 1]
        acc = acc + xf[:, i : i + 1] * wf[:, i]
    assert torch.equal(got, (acc + b).bfloat16())
    # The order is visible where a sum cancels: 1, then 1 - 1 + 2^-30 is 2^-30 odd product
    # first, and 0 even first (1 + 2^-30 rounds to 1). The random sums above rarely round to a
    # different bfloat16 either way.
    w = torch.tensor([[1.0, 0.0, 2**-15, -1.0]]).repeat(n, 1).bfloat16()
    x = torch.tensor([[1.0, 0.0, 2**-15, 1.0]]).repeat(m, 1).bfloat16()
    cancelled = _module.packed_gemm(x, _module.pack_gemm_weight(w), None, n)
    assert torch.equal(cancelled, torch.full((m, n), 2**-30).bfloat16())


@needs_amx_gemm
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 16, 32),  # one row of one tile, one K step, half a panel
        (16, 33, 64),  # one whole row tile; a panel of one column past the first
        (17, 64, 96),  # a second row tile of one row (the zero-padded tail)
        (31, 40, 768),  # a tail one row short of a block; a decode step's K
        (32, 96, 64),  # one whole block of two row tiles
        (70, 200, 2048),  # whole blocks, then a tail of six; K long
        (300, 48, 1024),  # several groups of blocks (a group of 4 at this K)
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_amx_bf16_gemm_matches_float64_and_the_register_tiles(
    m: int, n: int, k: int, threads: int
) -> None:
    """On AMX tiles (K a multiple of 32): F.linear's product to one bfloat16 rounding, within
    an ulp of the register tiles (the same exact products summed in float32 in another order),
    the widened store exactly its float32 copy, and each row's outputs the same in any batch."""
    assert _module is not None
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    packed = _module.pack_gemm_weight(w)
    got = _packed_gemm_on(threads, x, packed, b, n)
    with _register_tiles():
        registers = _packed_gemm_on(threads, x, packed, b, n)
    torch.testing.assert_close(
        got.double(), _float64_linear(x, w, b), atol=1e-5 * k**0.5 * 4, rtol=2**-8
    )
    ulp = registers.float().abs() * 2**-7
    assert bool(((got.float() - registers.float()).abs() <= ulp).all())
    assert (got == registers).float().mean() > 0.97
    if k == 2048:  # the two orders do differ somewhere over 14,000 long sums: AMX did run
        assert not torch.equal(got, registers)
    assert torch.equal(_module.packed_gemm_widened(x, packed, b, n), got.float())
    for rows in (slice(0, 1), slice(m // 2, m), slice(m - 1, m)):
        alone = _module.packed_gemm(x[rows].contiguous(), packed, b, n)
        assert torch.equal(alone, got[rows])


@needs_amx_gemm
@torch.no_grad()
def test_the_amx_gemm_applies_a_paired_weights_swiglu_and_can_be_turned_off() -> None:
    """A paired gate/up pack on AMX tiles: its plain product is the plain pack's bit for bit,
    its fused SwiGLU silu_and_mul of that product bit for bit, over row tails and a half of 40
    columns; set_amx(False) runs the register tiles, and a K that is not a multiple of 32
    runs them too (the same result with AMX on or off)."""
    from ferrum_kernels.cpu_fused import silu_and_mul_cpu

    assert _module is not None
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(80, 96, generator=gen).bfloat16()
    b = torch.randn(80, generator=gen).bfloat16()
    paired = PackedWeight(w.clone(), b, kernel="native", gate_up=True)
    plain = PackedWeight(w.clone(), b, kernel="native")
    for rows in (1, 17, 64, 100):
        x = torch.randn(rows, 96, generator=gen).bfloat16()
        want = plain(x)
        assert torch.equal(paired(x), want)
        assert torch.equal(paired.swiglu(x), silu_and_mul_cpu(want))
        with _register_tiles():
            registers = plain(x)
        torch.testing.assert_close(registers, want, atol=0, rtol=2**-7)
    x = torch.randn(40, 80, generator=gen).bfloat16()  # K = 80: the register tiles either way
    odd = PackedWeight(torch.randn(48, 80, generator=gen).bfloat16(), None, kernel="native")
    with _register_tiles():
        registers = odd(x)
    assert torch.equal(odd(x), registers)
    assert _module.set_amx(True) is True  # left on


@needs_bf16_gemm
def test_native_bf16_gemm_refuses_mismatched_inputs() -> None:
    assert _module is not None
    packed = _module.pack_gemm_weight(torch.randn(40, 8).bfloat16())
    with pytest.raises(RuntimeError, match="x has K=10"):
        _module.packed_gemm(torch.randn(2, 10).bfloat16(), packed, None, 40)
    with pytest.raises(RuntimeError, match="N does not match"):
        _module.packed_gemm(torch.randn(2, 8).bfloat16(), packed, None, 80)
    with pytest.raises(RuntimeError, match="bias must be"):
        _module.packed_gemm(torch.randn(2, 8).bfloat16(), packed, torch.randn(39), 40)
    with pytest.raises(RuntimeError, match="pack_gemm_weight"):  # a float32 packing
        _module.packed_gemm(torch.randn(2, 8).bfloat16(), torch.zeros(3, 8, 16), None, 40)


@pytest.mark.skipif(not mkldnn_linear_available(), reason="no oneDNN")
@pytest.mark.usefixtures("choose_kernel")
@torch.no_grad()
def test_the_gemm_kernel_follows_ferrum_cpu_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(40, 24)
    x = torch.randn(3, 24)
    monkeypatch.setenv("FERRUM_CPU_GEMM", "onednn")
    assert gemm_kernel(torch.float32) == "onednn"
    onednn = PackedWeight(w, None)
    assert onednn.kernel == "onednn"
    cpu_linear._native_gemm = None
    monkeypatch.setenv("FERRUM_CPU_GEMM", "native")
    built = _module is not None and _module.gemm_isa()[0]
    assert gemm_kernel(torch.float32) == ("native" if built else "onednn")
    forced = PackedWeight(w, None)
    # Either kernel computes the same linear, to float32 rounding.
    torch.testing.assert_close(forced(x), onednn(x), atol=1e-5, rtol=1e-5)
    if mkldnn_linear_available(torch.bfloat16):  # bfloat16 likewise, to bfloat16 rounding
        half, rows = w.bfloat16(), x.bfloat16()
        cpu_linear._native_gemm = None
        monkeypatch.setenv("FERRUM_CPU_GEMM", "onednn")
        assert gemm_kernel(torch.bfloat16) == "onednn"
        onednn_half = PackedWeight(half, None)
        cpu_linear._native_gemm = None
        monkeypatch.setenv("FERRUM_CPU_GEMM", "native")
        bf16_built = _module is not None and _module.gemm_bf16_available()
        assert gemm_kernel(torch.bfloat16) == ("native" if bf16_built else "onednn")
        native_half = PackedWeight(half, None)
        assert native_half.kernel == ("native" if bf16_built else "onednn")
        torch.testing.assert_close(native_half(rows), onednn_half(rows), atol=0.05, rtol=2**-7)
    cpu_linear._native_gemm = None
    monkeypatch.setenv("FERRUM_CPU_GEMM", "fastest")
    with pytest.raises(ValueError, match="FERRUM_CPU_GEMM must be one of auto, native, onednn"):
        gemm_kernel(torch.float32)


@pytest.mark.usefixtures("choose_kernel")
def test_auto_picks_the_native_gemm_wherever_it_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FERRUM_CPU_GEMM", raising=False)
    built = _module is not None and _module.gemm_isa()[0]
    assert gemm_kernel(torch.float32) == ("native" if built else "onednn")
    bf16_built = _module is not None and _module.gemm_bf16_available()
    assert gemm_kernel(torch.bfloat16) == ("native" if bf16_built else "onednn")


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.bfloat16, marks=needs_bf16_gemm),
        pytest.param(torch.float32, marks=needs_avx512_float32_gemm),
    ],
)
@pytest.mark.parametrize("k", [80, 81])  # an odd K: a bfloat16 last pair's other half is zero
@torch.no_grad()
def test_a_gate_up_weight_is_paired_and_its_gemm_applies_the_swiglu(
    dtype: torch.dtype, k: int
) -> None:
    """A gate/up weight's paired pack (the same 16 columns of both halves in a panel) gives the
    plain product bit for bit, and its fused SwiGLU is silu_and_mul of that product bit for bit;
    a half of 40 columns leaves the last panel partly empty."""
    from ferrum_kernels.cpu_fused import silu_and_mul_cpu

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(80, k, generator=gen).to(dtype)  # gate rows 0-39, up rows 40-79
    b = torch.randn(80, generator=gen).to(dtype)
    paired = PackedWeight(w.clone(), b, kernel="native", gate_up=True)
    plain = PackedWeight(w.clone(), b, kernel="native")
    assert paired.paired and not plain.paired
    paired.release_plain()  # serves from its packed copy alone
    for rows in (1, 9, 300):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        want = plain(x)
        assert torch.equal(paired(x), want)
        assert paired.fuses_swiglu(x)
        assert torch.equal(paired.swiglu(x), silu_and_mul_cpu(want))
        # The plain product is the linear, to the dtype's rounding.
        reference = torch.nn.functional.linear(x.double(), w.double(), b.double())
        atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (0.05, 2**-7)
        torch.testing.assert_close(want.double(), reference, atol=atol, rtol=rtol)
    x = torch.randn(2, 3, k, generator=gen).to(dtype)  # leading dims kept
    assert paired.swiglu(x).shape == (2, 3, 40)
    # (silu_and_mul_cpu runs the native kernel on [T, 2I] rows; torch's silu differs by an ulp)
    assert torch.equal(paired.swiglu(x).flatten(0, 1), silu_and_mul_cpu(plain(x).flatten(0, 1)))
    # Not paired: oneDNN's kernel, an odd N; swiglu refuses them.
    others = [PackedWeight(w[:79].clone(), None, kernel="native", gate_up=True)]
    if mkldnn_linear_available(dtype):
        others.append(PackedWeight(w.clone(), None, kernel="onednn", gate_up=True))
    for other in others:
        assert not other.paired
        with pytest.raises(ValueError, match="paired gate/up weight on the AVX-512"):
            other.swiglu(x.to(other.dtype))


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.bfloat16, marks=needs_bf16_gemm),
        pytest.param(torch.float32, marks=needs_avx512_float32_gemm),
    ],
)
@torch.no_grad()
def test_prepack_pairs_gate_up_projections_and_the_backend_fuses_them(
    dtype: torch.dtype, choose_kernel: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prepack_linears pairs the linears named gate_up_proj (only those) where the native GEMM
    runs the dtype (the default); the CPU backend's gate_up_silu then runs them fused, and falls
    back to silu_and_mul of the projection for anything else (a plain linear), with the same
    result."""
    from ferrum_kernels.backend import cpu_backend
    from ferrum_kernels.cpu_fused import silu_and_mul_cpu
    from ferrum_kernels.cpu_linear import PackedLinear, fused_gate_up_silu, prepack_linears
    from torch import nn

    monkeypatch.delenv("FERRUM_CPU_GEMM", raising=False)  # the default kernel choice
    torch.manual_seed(5)
    mlp = nn.Module()
    mlp.gate_up_proj = nn.Linear(48, 64, bias=False, dtype=dtype)
    mlp.other_proj = nn.Linear(48, 64, bias=False, dtype=dtype)
    want = {name: m.weight.detach().clone() for name, m in mlp.named_children()}
    assert prepack_linears(mlp) == 2
    gate_up, other = mlp.gate_up_proj, mlp.other_proj
    assert isinstance(gate_up, PackedLinear) and isinstance(other, PackedLinear)
    assert gate_up._pack is not None and gate_up._pack.paired
    assert other._pack is not None and not other._pack.paired
    x = torch.randn(7, 48).to(dtype)
    backend = cpu_backend()
    for name, module in (("gate_up_proj", gate_up), ("other_proj", other)):
        reference = silu_and_mul_cpu(module(x))
        assert torch.equal(backend.gate_up_silu(module, x), reference)
        torch.testing.assert_close(
            reference.float(),
            torch.nn.functional.silu((x @ want[name].T)[:, :32].float()).to(dtype).float()
            * (x @ want[name].T)[:, 32:].float(),
            atol=0.05,
            rtol=0.02,
        )
    assert fused_gate_up_silu(gate_up, x) is not None
    assert fused_gate_up_silu(other, x) is None
    assert fused_gate_up_silu(nn.Linear(48, 64, dtype=dtype), x) is None


@needs_bf16_gemm
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (9, 33, 81), (64, 200, 768), (0, 40, 16)])
@torch.no_grad()
def test_the_widened_bf16_gemm_stores_exactly_the_rounded_product_in_float32(
    m: int, n: int, k: int
) -> None:
    """packed_gemm_widened is packed_gemm(...).float() bit for bit (each output rounded to
    bfloat16 first), with and without a bias, over partial tiles, panels and an odd K."""
    assert _module is not None
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    packed = _module.pack_gemm_weight(w)
    for bias in (None, torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()):
        got = _module.packed_gemm_widened(x, packed, bias, n)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert torch.equal(got, _module.packed_gemm(x, packed, bias, n).float())
    with pytest.raises(RuntimeError, match="x must be"):
        _module.packed_gemm_widened(x.float(), packed, None, n)
    with pytest.raises(RuntimeError, match="N does not match"):
        _module.packed_gemm_widened(x, packed, None, n + 32)


@needs_bf16_gemm
@torch.no_grad()
def test_the_backend_widens_a_packed_heads_logits_in_its_gemm() -> None:
    """float32_logits equals head(x).float() whatever the head; the widening GEMM serves packed
    bfloat16 heads (a linear, released or not, and a tied one), and anything else (float32, a
    paired weight, an unpacked linear) falls back to the head's own output."""
    from ferrum_kernels.backend import cpu_backend, torch_backend
    from ferrum_kernels.cpu_linear import float32_linear, prepack_linears
    from ferrum_kernels.layers import TiedLinear
    from torch import nn

    torch.manual_seed(7)
    model = nn.Module()
    model.lm_head = nn.Linear(48, 100, bias=False, dtype=torch.bfloat16)
    model.embed = nn.Embedding(100, 48, dtype=torch.bfloat16)
    model.tied = TiedLinear(model.embed)
    model.float_head = nn.Linear(48, 100, bias=False)
    model.gate_up_proj = nn.Linear(48, 100, bias=False, dtype=torch.bfloat16)
    plain = nn.Linear(48, 100, bias=False, dtype=torch.bfloat16)
    prepack_linears(model)
    x = torch.randn(5, 48).bfloat16()
    backend = cpu_backend()
    for head in (model.lm_head, model.tied):
        assert float32_linear(head, x) is not None
        assert torch.equal(backend.float32_logits(head, x), head(x).float())
    model.lm_head._pack.release_plain()
    assert torch.equal(backend.float32_logits(model.lm_head, x), model.lm_head(x).float())
    assert float32_linear(model.float_head, x.float()) is None
    assert float32_linear(model.gate_up_proj, x) is None  # paired for the SwiGLU
    assert float32_linear(plain, x) is None
    for head, rows in ((model.float_head, x.float()), (model.gate_up_proj, x), (plain, x)):
        assert torch.equal(backend.float32_logits(head, rows), head(rows).float())
    assert torch.equal(torch_backend().float32_logits(plain, x), plain(x).float())
    with pytest.raises(ValueError, match="plain bfloat16 weight"):
        model.gate_up_proj._pack.widened(x)


@needs_native_gemm
def test_a_native_gemm_call_lets_other_python_threads_run() -> None:
    """The native kernels release the GIL while they run, so the server's other Python threads
    (gRPC handlers, health checks) are not held up for a whole GEMM. With the GIL held, no
    bytecode of another thread runs inside a call."""
    pack = PackedWeight(torch.randn(2048, 2048), None, kernel="native")
    x = torch.randn(1024, 2048)
    pack(x)  # packs the weight outside the timed calls
    calls: list[tuple[float, float]] = []
    ticks: list[float] = []
    done = threading.Event()

    def gemms() -> None:
        try:
            for _ in range(6):
                started = time.perf_counter()
                pack(x)
                calls.append((started, time.perf_counter()))
        finally:
            done.set()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # leaves a core to this thread on a 2-core machine
    try:
        worker = threading.Thread(target=gemms)
        worker.start()
        while not done.is_set():
            ticks.append(time.perf_counter())
        worker.join()
    finally:
        torch.set_num_threads(threads)
    # Ticks in the middle 80% of a call: none can land there while the call holds the GIL.
    inside = sum(
        1
        for start, end in calls
        for tick in ticks
        if start + 0.1 * (end - start) < tick < end - 0.1 * (end - start)
    )
    assert len(calls) == 6
    assert inside > 100, f"{inside} ticks of another thread inside {len(calls)} GEMM calls"


@needs_native_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_trailing_columns_are_the_full_products_columns_bit_for_bit(dtype: torch.dtype) -> None:
    """PackedWeight.trailing(x, start) is self(x)[..., start:] exactly: the same panels run the
    same tiles, over partial tiles and a partial last panel, with and without a bias, for 2-D
    and 3-D inputs. Only a plain native pack at a panel boundary short of N trails."""
    if dtype == torch.bfloat16 and not _module.gemm_bf16_available():  # type: ignore[union-attr]
        pytest.skip("no bfloat16 GEMM on this CPU")
    gen = torch.Generator().manual_seed(12)
    n, k = 200, 72  # the last panel partial
    weight = torch.randn(n, k, generator=gen).to(dtype)
    for bias in (None, torch.randn(n, generator=gen).to(dtype)):
        pack = PackedWeight(weight, bias, kernel="native")
        width = int(pack.packed().shape[2])
        x = torch.randn(2, 13, k, generator=gen).to(dtype)
        for start in (width, 2 * width, (n - 1) // width * width):
            assert pack.trails(x, start)
            tail = pack.trailing(x, start)
            assert tail.shape == (2, 13, n - start)
            assert torch.equal(tail, pack(x)[..., start:])
            assert torch.equal(pack.trailing(x[0], start), pack(x[0])[:, start:])
        for start in (0, width // 2, n, n + width):
            assert not pack.trails(x, start)
        assert not pack.trails(x.double(), width)
        with pytest.raises(ValueError, match="panel start"):
            pack.trailing(x, width + 1)
    paired = PackedWeight(weight, None, kernel="native", gate_up=True)
    if paired.paired:  # a gate/up weight pairs its halves on the AVX-512 GEMM only
        assert not paired.trails(x, width)


@needs_native_gemm
@torch.no_grad()
def test_the_backend_computes_a_projections_trailing_columns_alone_where_it_can() -> None:
    """output_columns(proj, x, start) equals proj(x)[:, start:] on every backend: the CPU
    backend's from the trailing panels alone for a packed linear, the torch backend's from the
    weight's rows for a bare nn.Linear, and the full projection sliced where neither applies."""
    from ferrum_kernels.backend import cpu_backend, torch_backend
    from ferrum_kernels.cpu_linear import PackedLinear, prepack_linears, trailing_columns
    from torch import nn

    torch.manual_seed(8)
    model = nn.Module()
    model.qkv_proj = nn.Linear(48, 160, bias=True)
    plain = nn.Linear(48, 160, bias=True)
    prepack_linears(model)
    assert isinstance(model.qkv_proj, PackedLinear)
    x = torch.randn(9, 48)
    width = int(model.qkv_proj._pack.packed().shape[2])
    assert trailing_columns(model.qkv_proj, x, width) is not None
    assert trailing_columns(model.qkv_proj, x, width + 1) is None  # not a panel boundary
    assert trailing_columns(plain, x, width) is None  # not packed
    cpu, reference = cpu_backend(), torch_backend()
    for start in (width, width + 1):
        expected = model.qkv_proj(x)[:, start:]
        assert torch.equal(cpu.output_columns(model.qkv_proj, x, start), expected)
    torch.testing.assert_close(
        reference.output_columns(plain, x, 96), plain(x)[:, 96:], rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(  # a bare nn.Linear on the CPU backend: its rows from 100
        cpu.output_columns(plain, x, 100), plain(x)[:, 100:], rtol=1e-6, atol=1e-6
    )


@needs_bf16_gemm
@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("amx", [True, False])
def test_any_thread_count_computes_every_panel_once_to_the_same_bits(
    dtype: torch.dtype, amx: bool
) -> None:
    """Threads share a GEMM's panels in runs, a thread done with its own taking the others'
    from the back: with one, two or three threads (three share two cores here, so one falls
    behind and its runs are taken) every output is the same bits. A panel skipped would leave
    the output's uninitialised memory, and one taken twice would fold a greedy segment twice,
    so its log-probability would move. Rows span several groups of x (256 rows at this K), the
    plain, paired (SwiGLU) and greedy stores all run, on AMX tiles and on the register tiles."""
    assert _module is not None
    if dtype == torch.float32 and not _module.gemm_isa()[1]:
        pytest.skip("the float32 GEMM here is the AVX2 one, which keeps its own split")
    gen = torch.Generator().manual_seed(7)
    m, k, n, vocab = 700, 2048, 1280, 3000
    x = torch.randn(m, k, generator=gen).to(dtype)
    packed = _module.pack_gemm_weight(torch.randn(n, k, generator=gen).to(dtype))
    paired = _module.pack_gemm_weight_halves(torch.randn(2 * n, k, generator=gen).to(dtype))
    head = _module.pack_gemm_weight(torch.randn(vocab, k, generator=gen).to(dtype))
    before = torch.get_num_threads()
    results = []
    _module.set_amx(amx)
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(
                (
                    _module.packed_gemm(x, packed, None, n),
                    _module.packed_gemm_halves(x, paired, None, 2 * n, True),
                    _module.packed_gemm_greedy(x, head, None, vocab),
                )
            )
    finally:
        torch.set_num_threads(before)
        _module.set_amx(True)
    plain, swiglu, (ids, logprobs, finite) = results[0]
    assert bool(finite.all()) and plain.isfinite().all() and swiglu.isfinite().all()
    for other_plain, other_swiglu, (other_ids, other_logprobs, other_finite) in results[1:]:
        assert torch.equal(other_plain, plain)
        assert torch.equal(other_swiglu, swiglu)
        assert torch.equal(other_ids, ids) and torch.equal(other_logprobs, logprobs)
        assert torch.equal(other_finite, finite)

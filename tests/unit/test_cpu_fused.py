"""The fused native CPU elementwise kernels against their torch references."""

from __future__ import annotations

import pytest
import torch
from ferrum_kernels import cpu_fused, native
from ferrum_kernels.cpu_fused import rms_norm_residual_cpu, rotary_cpu, silu_and_mul_cpu
from ferrum_kernels.layers import apply_rotary, rms_norm, silu_and_mul

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ toolchain")

DTYPES = [torch.float32, torch.bfloat16]


def _close(dtype: torch.dtype) -> dict[str, float]:
    # float32: summation order and exp's last bit; bfloat16: one unit in the last place, rarely.
    return (
        {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-6, "rtol": 1.6e-2}
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("width", [96, 100])  # whole vectors of 16, and a masked tail
def test_add_rms_norm_matches_reference_and_updates_the_residual(
    dtype: torch.dtype, rows: int, width: int
) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, width, dtype=dtype)
    residual = torch.randn(rows, width, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(width)).to(dtype)
    want_sum = residual + x
    want = rms_norm(want_sum, weight, 1e-5)
    stream = residual.clone()
    got, got_sum = rms_norm_residual_cpu(x, stream, weight, 1e-5)
    assert torch.equal(got_sum, want_sum)  # the add rounds exactly like torch's
    assert got_sum.data_ptr() == stream.data_ptr()  # and lands in the residual stream
    torch.testing.assert_close(got, want, **_close(dtype))
    alone, passed = rms_norm_residual_cpu(x, None, weight, 1e-5)
    assert passed is x
    torch.testing.assert_close(alone, rms_norm(x, weight, 1e-5), **_close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [160, 37])  # whole vectors of 16, and a masked tail
def test_silu_and_mul_matches_reference(dtype: torch.dtype, inter: int) -> None:
    torch.manual_seed(1)
    gate_up = torch.randn(33, 2 * inter, dtype=dtype) * 4  # wide range: both tails of the exp
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, float("inf"), -88.5])
    gate_up[1, inter - 1] = 30.0  # the tail's last lane
    got = silu_and_mul_cpu(gate_up)
    want = silu_and_mul(gate_up)
    if dtype == torch.bfloat16:
        # The float32 value differs from torch's by at most an ulp, which bf16 rounding absorbs
        # except on rare ties.
        assert (got != want).float().mean() < 5e-3
    torch.testing.assert_close(got, want, **_close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 40])  # halves of whole vectors of 16, and with a tail
def test_rotary_in_place_on_qkv_views_is_bit_identical(dtype: torch.dtype, d: int) -> None:
    torch.manual_seed(2)
    t, h, hkv = 19, 6, 2
    qkv = torch.randn(t, (h + 2 * hkv) * d, dtype=dtype)
    cos = torch.randn(t, d // 2).to(dtype)
    sin = torch.randn(t, d // 2).to(dtype)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k = q.reshape(t, h, d), k.reshape(t, hkv, d)
    assert cpu_fused._k_follows_q(q.flatten(1), k.flatten(1))  # the one-call path
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = v.clone()
    got_q, got_k = rotary_cpu(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(v, v_before)  # the V part of the row is left alone
    # k alone, as a layer writing K/V for no query row rotates it: q given with no heads.
    kv = torch.randn(t, 2 * hkv * d, dtype=dtype)
    k_only = kv[:, : hkv * d].reshape(t, hkv, d)
    want_k, v_before = apply_rotary(k_only, cos, sin), kv[:, hkv * d :].clone()
    _, got_k = rotary_cpu(k_only[:, :0], k_only, cos, sin)
    assert got_k.data_ptr() == k_only.data_ptr() and torch.equal(got_k, want_k)
    assert torch.equal(kv[:, hkv * d :], v_before)


@pytest.mark.parametrize("layout", ["separate", "k first", "gap"])
def test_rotary_of_q_and_k_not_side_by_side_rotates_each_alone(layout: str) -> None:
    # Only k starting where q's row ends takes the one-pass path; every other layout must
    # rotate q's and k's own heads and nothing between or after them.
    torch.manual_seed(5)
    t, h, hkv, d = 11, 4, 2, 64
    if layout == "separate":
        q, k = torch.randn(t, h, d), torch.randn(t, hkv, d)
        row = None
    else:
        row = torch.randn(t, (h + hkv + 1) * d)
        if layout == "k first":
            k, q = row[:, : hkv * d], row[:, hkv * d : (hkv + h) * d]
        else:  # one head of something else between q and k
            q, k = row[:, : h * d], row[:, (h + 1) * d : (h + 1 + hkv) * d]
        q, k = q.reshape(t, h, d), k.reshape(t, hkv, d)
    cos, sin = torch.randn(t, d // 2), torch.randn(t, d // 2)
    assert not cpu_fused._k_follows_q(q.flatten(1), k.flatten(1))  # two calls
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    before = None if row is None else row.clone()
    got_q, got_k = rotary_cpu(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    if row is not None and before is not None:
        untouched = torch.ones(row.shape[1], dtype=torch.bool)
        for view in (q, k):
            start = (view.data_ptr() - row.data_ptr()) // row.element_size()
            untouched[start : start + view.shape[1] * d] = False
        assert torch.equal(row[:, untouched], before[:, untouched])


def test_inputs_the_kernels_do_not_serve_fall_back_to_the_reference() -> None:
    x = torch.randn(4, 8, dtype=torch.float16)
    weight = torch.ones(8, dtype=torch.float16)
    got, _ = rms_norm_residual_cpu(x, None, weight, 1e-6)
    assert torch.equal(got, rms_norm(x, weight, 1e-6))
    strided = torch.randn(8, 6)[:, ::2]  # not contiguous
    assert torch.equal(silu_and_mul_cpu(strided), silu_and_mul(strided))


def test_the_model_runs_the_fused_kernels_once_bound_to_the_cpu_backend() -> None:
    from ferrum_kernels.backend import cpu_backend
    from ferrum_server.models.tiny import build_tiny

    model = build_tiny(torch.float32, torch.device("cpu"))
    assert model.backend.name == "torch"
    assert model.backend.rms_norm_residual is not rms_norm_residual_cpu
    model.bind_backend(cpu_backend())
    kernels = model.backend
    assert kernels.rms_norm_residual is rms_norm_residual_cpu
    assert kernels.rotary is rotary_cpu and kernels.silu_and_mul is silu_and_mul_cpu
    assert all(layer.backend is kernels for layer in model.layers)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_logsumexp_matches_torch_with_first_index_ties(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    logits = (4 * torch.randn(9, 5003)).to(dtype)
    logits[2, 17] = logits[2, 4000] = logits[2].max() + 1  # a tie: the lower id must win
    logits[3, :50] = -1e4  # far below the maximum: exp's argument clamped, adding nothing
    # The maximum in the row's last, partial vector (5003 = 312 x 16 + 11), at its first
    # element, and tied within one vector of sixteen.
    logits[4, 5001] = logits[4].max() + 1
    logits[5, 0] = logits[5].max() + 1
    logits[6, 35] = logits[6, 33] = logits[6].max() + 1
    ids, lse, finite = native.load().argmax_logsumexp(logits)
    wide = logits.float()
    assert torch.equal(ids, wide.argmax(dim=-1))
    assert ids[2].item() == 17
    assert ids[4:7].tolist() == [5001, 0, 33]
    torch.testing.assert_close(lse, torch.logsumexp(wide, dim=-1), atol=1e-5, rtol=1e-6)
    assert bool(finite.all())


def test_rows_with_nan_or_infinity_are_flagged_and_sample_keeps_torch_semantics() -> None:
    from ferrum_kernels.sampling import SamplingTensors, sample

    logits = torch.randn(4, 300)
    logits[1, 5] = float("nan")
    logits[3, 9] = float("inf")
    _, _, finite = native.load().argmax_logsumexp(logits)
    assert finite.tolist() == [True, False, True, False]
    out = sample(logits, SamplingTensors.greedy(4, "cpu"))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))  # first NaN, then the infinity
    assert torch.equal(out.logprobs.isnan(), torch.tensor([False, True, False, True]))

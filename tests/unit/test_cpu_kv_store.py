"""The CPU attention's KV write (``cpu_attention.write_kv_cpu``, ``csrc/kv_store.cpp``) against
the torch write (``attention.write_kv``): the same pool afterwards, bit for bit, and a bad slot
refused before anything is written."""

from __future__ import annotations

import pytest
import torch
from ferrum_kernels import native
from ferrum_kernels.attention import write_kv
from ferrum_kernels.cpu_attention import write_kv_cpu

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, Q_HEADS = 40, 16, 2, 64, 6

needs_native = pytest.mark.skipif(not native.available(), reason="no C++ toolchain")


def _pool(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype)


def _projection(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value as the model hands them over: strided views of one qkv projection."""
    width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(rows, width).to(dtype)
    _, k, v = qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return k.reshape(rows, KV_HEADS, HEAD_DIM), v.reshape(rows, KV_HEADS, HEAD_DIM)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 600])  # 600: more than one parallel chunk
def test_the_pool_equals_the_torch_writes(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    key, value = _projection(rows, dtype)
    assert rows == 1 or not key.is_contiguous()  # the case the model has
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:rows]
    want = _pool(dtype)
    got = want.clone()
    write_kv(want, key, value, slots)
    write_kv_cpu(got, key, value, slots)
    # Every slot, the untouched ones included.
    assert torch.equal(
        got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )


@needs_native
@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS * BLOCK_SIZE])
def test_a_slot_outside_the_pool_is_refused_and_nothing_is_written(bad: int) -> None:
    key, value = _projection(4, torch.float32)
    pool = _pool(torch.float32)
    before = pool.clone()
    slots = torch.tensor([3, 9, bad, 20])
    with pytest.raises(RuntimeError, match=f"slot {bad} of row 2 is outside the pool's 640 slots"):
        write_kv_cpu(pool, key, value, slots)
    assert torch.equal(pool, before)


@needs_native
def test_the_native_store_refuses_what_it_cannot_copy() -> None:
    module = native.load()
    pool = _pool(torch.float32)
    key, value = _projection(3, torch.float32)
    slots = torch.tensor([0, 1, 2])
    before = pool.clone()
    with pytest.raises(RuntimeError, match="the pool's dtype"):
        module.store_kv_(pool, key.to(torch.bfloat16), value.to(torch.bfloat16), slots)
    heads_last = torch.randn(3, HEAD_DIM, KV_HEADS).transpose(1, 2)  # [3, Hkv, D], D strided
    with pytest.raises(RuntimeError, match="row must be contiguous"):
        module.store_kv_(pool, heads_last, heads_last, slots)
    with pytest.raises(RuntimeError, match=r"\[T\] int64"):
        module.store_kv_(pool, key, value, slots.int())
    with pytest.raises(RuntimeError, match="one shape"):
        module.store_kv_(pool, key, value[:2], slots)
    assert torch.equal(pool, before)


def test_what_the_native_store_does_not_take_goes_to_the_torch_write() -> None:
    """A float32 K/V into a bfloat16 pool (cast on the way), and rows that are not contiguous:
    the same result as ``write_kv``, with or without the native module."""
    torch.manual_seed(0)
    key, value = _projection(5, torch.float32)
    slots = torch.tensor([7, 0, 33, 100, 639])
    heads_last = torch.randn(5, HEAD_DIM, KV_HEADS).transpose(1, 2)  # [5, Hkv, D], D strided
    for k, v, dtype in ((key, value, torch.bfloat16), (heads_last, value, torch.float32)):
        want = _pool(dtype)
        got = want.clone()
        write_kv(want, k, v, slots)
        write_kv_cpu(got, k, v, slots)
        assert torch.equal(got, want)


def _qkv(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection's rows and their rotary tables, as the native layers hold them."""
    qkv = torch.randn(rows, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    angles = torch.randn(rows, HEAD_DIM // 2)
    return qkv, angles.cos().to(dtype), angles.sin().to(dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 600])
def test_the_fused_rotary_and_store_equal_the_two_calls(dtype: torch.dtype, rows: int) -> None:
    """``rotary_store_kv_`` (the native layers' form) against ``rotary_`` over q and k, then
    ``store_kv_``: the same rotated rows and the same pool, bit for bit."""
    module = native.load()
    torch.manual_seed(rows)
    qkv, cos, sin = _qkv(rows, dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:rows]
    k0, v0 = Q_HEADS * HEAD_DIM, (Q_HEADS + KV_HEADS) * HEAD_DIM
    want_qkv, want_pool = qkv.clone(), _pool(dtype)
    got_qkv, got_pool = qkv.clone(), want_pool.clone()
    module.rotary_(want_qkv[:, :v0], cos, sin, Q_HEADS + KV_HEADS, HEAD_DIM)
    module.store_kv_(
        want_pool,
        want_qkv[:, k0:v0].view(rows, KV_HEADS, HEAD_DIM),
        want_qkv[:, v0:].view(rows, KV_HEADS, HEAD_DIM),
        slots,
    )
    module.rotary_store_kv_(got_qkv, cos, sin, Q_HEADS, KV_HEADS, HEAD_DIM, got_pool, slots)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert not torch.equal(want_qkv, qkv)  # the rotation did something
    assert torch.equal(got_qkv.view(bits), want_qkv.view(bits))
    assert torch.equal(got_pool.view(bits), want_pool.view(bits))


@needs_native
def test_the_fused_rotary_and_store_refuse_bad_input_and_change_nothing() -> None:
    module = native.load()
    qkv, cos, sin = _qkv(4, torch.float32)
    pool = _pool(torch.float32)
    qkv_before, pool_before = qkv.clone(), pool.clone()
    slots = torch.tensor([3, 9, NUM_BLOCKS * BLOCK_SIZE, 20])
    with pytest.raises(RuntimeError, match="slot 640 of row 2 is outside the pool's 640 slots"):
        module.rotary_store_kv_(qkv, cos, sin, Q_HEADS, KV_HEADS, HEAD_DIM, pool, slots)
    good = torch.tensor([3, 9, 10, 20])
    with pytest.raises(RuntimeError, match="q, k and v heads"):
        module.rotary_store_kv_(qkv[:, :-1], cos, sin, Q_HEADS, KV_HEADS, HEAD_DIM, pool, good)
    with pytest.raises(RuntimeError, match="the pool's dtype"):
        module.rotary_store_kv_(
            qkv, cos, sin, Q_HEADS, KV_HEADS, HEAD_DIM, pool.to(torch.bfloat16), good
        )
    with pytest.raises(RuntimeError, match=r"cos/sin must be \[T, D/2\]"):
        module.rotary_store_kv_(qkv, cos[:3], sin[:3], Q_HEADS, KV_HEADS, HEAD_DIM, pool, good)
    assert torch.equal(qkv, qkv_before)
    assert torch.equal(pool, pool_before)

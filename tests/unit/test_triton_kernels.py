"""Every Triton kernel against the torch reference, on CPU tensors through the Triton interpreter.

Shapes are tiny because the interpreter executes each program in numpy. Interpreter caveats that
shape the tolerances here (the GPU tests in tests/gpu check the compiled kernels exactly):
  * its float32 -> bfloat16 conversion is not round-to-nearest-even, so bf16 results are compared
    within a couple of bf16 ulps instead of bit for bit (fp16 goes through numpy and is exact);
  * its tl.dot is wrong for bf16 operands, so the attention kernel computes dots in fp32 there.
"""

from __future__ import annotations

import math
import os
import random
import sys
from pathlib import Path

# Must precede the first triton import: @triton.jit picks the interpreter at decoration time.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'triton>=3.7')")

from ferrum_kernels.attention import (
    DecodeBatch,
    decode_attention_reference,
    paged_attention,
    write_kv,
)
from ferrum_kernels.backend import (
    KernelBackend,
    WriteThenAttend,
    register_attention_provider,
    select_backend,
)
from ferrum_kernels.layers import apply_rotary, rms_norm
from ferrum_kernels.sampling import (
    SamplingTensors,
    _gumbel_noise,
    build_sampling_tensors,
    sample,
)
from ferrum_kernels.triton_attention import (
    choose_num_splits,
    paged_attention_triton,
    prepare_decode_triton,
    triton_attention_metadata,
    triton_write_kv,
)
from ferrum_kernels.triton_norm import (
    rms_norm_residual_triton,
    rms_norm_triton,
    rotary_triton,
)
from ferrum_kernels.triton_sampling import gumbel_noise_triton, sample_triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_models import BlockAllocator, build_meta

# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------

_TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _paged_case(
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    items: list[tuple[int, int]],  # (history_len, query_len)
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """A pool with shuffled blocks (plus garbage spares) already holding every item's K/V."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_item = [math.ceil((h + n) / block_size) for h, n in items]
    num_blocks = sum(blocks_per_item) + 3
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    allocator = BlockAllocator(num_blocks, shuffle=True, seed=seed)
    block_lists = [allocator.allocate(nb) for nb in blocks_per_item]
    meta = build_meta(block_lists, [n for _, n in items], [h + n for h, n in items], block_size)
    q = torch.randn(meta.num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, kv, meta


# (history, query) per item: prefill from scratch, chunk on top of history, decodes, a
# one-token context, a decode whose context ends exactly on a block boundary.
_MIXED = [(5, 3), (0, 7), (9, 1), (0, 1), (3, 1), (11, 5), (7, 1)]


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "group", "head_dim", "dtype"),
    [
        (4, 2, 1, 16, torch.float32),  # MHA
        (16, 2, 2, 16, torch.float32),  # GQA 2, one block holds most items
        (1, 1, 4, 16, torch.float32),  # GQA 4, one position per block
        (3, 2, 2, 16, torch.float32),  # block size that is not a power of two
        (4, 1, 3, 24, torch.float32),  # group and head_dim that need padding
        (4, 2, 2, 16, torch.float16),
        (8, 2, 4, 32, torch.bfloat16),
    ],
)
def test_attention_matches_reference(
    block_size: int, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    q, kv, meta = _paged_case(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        items=_MIXED,
        dtype=dtype,
        seed=block_size * 10 + group,
    )
    scale = head_dim**-0.5
    got = paged_attention_triton(q, kv, meta, scale, num_splits=1)
    want = paged_attention(q, kv, meta, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **_TOL[dtype])


def test_attention_decode_only_and_single_prefill() -> None:
    for items in ([(6, 1), (0, 1), (13, 1)], [(0, 19)], [(21, 2)]):
        q, kv, meta = _paged_case(
            block_size=4,
            num_kv_heads=2,
            group=2,
            head_dim=16,
            items=items,
            dtype=torch.float32,
            seed=len(items),
        )
        got = paged_attention_triton(q, kv, meta, 0.3)
        torch.testing.assert_close(got, paged_attention(q, kv, meta, 0.3), **_TOL[torch.float32])


@pytest.mark.parametrize(("num_splits", "group"), [(2, 2), (3, 1), (5, 4)])
def test_attention_split_k_matches_reference(num_splits: int, group: int) -> None:
    # Contexts long enough that partitions differ per item; the 1-token item leaves later
    # partitions empty, which the reduce must weight by zero.
    items = [(40, 1), (0, 1), (25, 6), (33, 1)]
    q, kv, meta = _paged_case(
        block_size=4,
        num_kv_heads=2,
        group=group,
        head_dim=16,
        items=items,
        dtype=torch.float32,
        seed=num_splits,
    )
    got = paged_attention_triton(q, kv, meta, 0.25, num_splits=num_splits)
    torch.testing.assert_close(got, paged_attention(q, kv, meta, 0.25), **_TOL[torch.float32])


# (history, new rows) per item for the sliding-window tests: chunks crossing the window edge
# (one longer than a query tile), a chunk far past it, decodes far past it and inside it.
_WINDOWED = [(3, 9), (0, 21), (40, 1), (2, 1), (33, 6), (0, 1), (58, 1)]


@pytest.mark.parametrize(
    ("window", "num_splits", "group", "dtype"),
    [
        (5, 1, 2, torch.float32),
        (1, 1, 1, torch.float32),  # each query sees only itself
        (7, 3, 2, torch.float32),  # split-K over the windowed range
        (16, None, 4, torch.float32),
        (6, 2, 2, torch.bfloat16),
    ],
)
def test_sliding_window_attention_matches_reference(
    window: int, num_splits: int | None, group: int, dtype: torch.dtype
) -> None:
    q, kv, meta = _paged_case(
        block_size=4,
        num_kv_heads=2,
        group=group,
        head_dim=16,
        items=_WINDOWED,
        dtype=dtype,
        seed=window,
    )
    got = paged_attention_triton(q, kv, meta, 0.3, window, num_splits=num_splits)
    want = paged_attention(q, kv, meta, 0.3, window)
    torch.testing.assert_close(got.float(), want.float(), **_TOL[dtype])
    # The window changes the answer here, so a kernel that ignored it would fail above.
    assert (paged_attention(q, kv, meta, 0.3) - want).abs().max().item() > 0.05


@pytest.mark.parametrize(
    ("softcap", "window", "num_splits", "dtype"),
    [
        (1.0, 0, 1, torch.float32),
        (0.5, 5, 1, torch.float32),  # a soft-capped sliding-window layer (Gemma 2)
        (2.0, 0, 3, torch.float32),  # split-K: the partial outputs carry capped scores
        (1.0, 6, 2, torch.bfloat16),
    ],
)
def test_softcap_attention_matches_reference(
    softcap: float, window: int, num_splits: int, dtype: torch.dtype
) -> None:
    q, kv, meta = _paged_case(
        block_size=4,
        num_kv_heads=2,
        group=2,
        head_dim=16,
        items=_WINDOWED,
        dtype=dtype,
        seed=int(softcap * 10) + window,
    )
    scale = 0.5  # scores of a few units: the cap changes them
    got = paged_attention_triton(q, kv, meta, scale, window, softcap, num_splits=num_splits)
    want = paged_attention(q, kv, meta, scale, window, softcap)
    torch.testing.assert_close(got.float(), want.float(), **_TOL[dtype])
    # The cap changes the answer here, so a kernel that ignored it would fail above.
    assert (paged_attention(q, kv, meta, scale, window) - want).abs().max().item() > 0.05


def _decode_batch(
    contexts: list[int], width: int, block_size: int, num_blocks: int, seed: int
) -> tuple[DecodeBatch, list[list[int]]]:
    """Tables `width` wide: each item's blocks, then stale (valid, unrelated) block ids."""
    gen = torch.Generator().manual_seed(seed)
    allocator = BlockAllocator(num_blocks - 1, shuffle=True, seed=seed)
    rows = []
    for ctx in contexts:
        blocks = allocator.allocate(math.ceil(ctx / block_size))
        stale = torch.randint(0, num_blocks, (width - len(blocks),), generator=gen).tolist()
        rows.append(blocks + stale)
    batch = DecodeBatch(
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(contexts, dtype=torch.int32),
        block_size,
    )
    return batch, rows


@pytest.mark.parametrize(("num_splits", "group"), [(1, 2), (3, 1), (4, 4), (None, 2)])
def test_graph_decode_entry_matches_reference(num_splits: int | None, group: int) -> None:
    """The graph-safe decode entry: device-only metadata, tables wider than any context with
    stale entries past it, a padding row (context 1 on the last, scratch, block), and the
    kernel spreading each item's own context over a split count fixed in advance."""
    block_size, num_kv_heads, head_dim = 4, 2, 16
    contexts = [1, 37, 200, 130, 5, 1]
    width = 64  # 256 positions: more than any context
    num_blocks = sum(math.ceil(c / block_size) for c in contexts) + 5
    gen = torch.Generator().manual_seed(group)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    batch, rows = _decode_batch(contexts, width, block_size, num_blocks, seed=group)
    rows[-1] = [num_blocks - 1] * width  # the padding row reads only the scratch block
    batch.block_tables[-1] = num_blocks - 1
    q = torch.randn(len(contexts), num_kv_heads * group, head_dim, generator=gen)
    attend = prepare_decode_triton(batch, num_kv_heads * group, num_kv_heads, num_splits=num_splits)
    got = attend(q, kv, 0.25)
    want = decode_attention_reference(q, kv, batch, 0.25)
    torch.testing.assert_close(got, want, **_TOL[torch.float32])
    # The unified kernel over the same items agrees too.
    meta = build_meta(
        [r[: math.ceil(c / block_size)] for r, c in zip(rows, contexts, strict=True)],
        [1] * len(contexts),
        contexts,
        block_size,
    )
    torch.testing.assert_close(got, paged_attention(q, kv, meta, 0.25), **_TOL[torch.float32])

    # A "replay": new contents in the same tensors, the same prepared callable.
    new_contexts = [9, 1, 250, 4, 64, 1]
    new_batch, _ = _decode_batch(new_contexts, width, block_size, num_blocks, seed=group + 10)
    batch.block_tables.copy_(new_batch.block_tables)
    batch.context_lens.copy_(new_batch.context_lens)
    q2 = torch.randn(q.shape, generator=gen)
    torch.testing.assert_close(
        attend(q2, kv, 0.25),
        decode_attention_reference(q2, kv, batch, 0.25),
        **_TOL[torch.float32],
    )


@pytest.mark.parametrize(("num_splits", "window"), [(1, 6), (3, 9), (4, 1)])
def test_graph_decode_entry_with_sliding_window(num_splits: int, window: int) -> None:
    """The graph-safe decode entry with a window: each split covers only the window's span
    of the item's own context, contexts shorter than the window included."""
    block_size, num_kv_heads, group, head_dim = 4, 2, 2, 16
    contexts = [1, 37, 70, 4, 9]
    width = 20
    num_blocks = sum(math.ceil(c / block_size) for c in contexts) + 3
    gen = torch.Generator().manual_seed(window)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    batch, rows = _decode_batch(contexts, width, block_size, num_blocks, seed=window)
    q = torch.randn(len(contexts), num_kv_heads * group, head_dim, generator=gen)
    attend = prepare_decode_triton(batch, num_kv_heads * group, num_kv_heads, num_splits=num_splits)
    got = attend(q, kv, 0.25, window)
    want = decode_attention_reference(q, kv, batch, 0.25, window)
    torch.testing.assert_close(got, want, **_TOL[torch.float32])
    meta = build_meta(
        [r[: math.ceil(c / block_size)] for r, c in zip(rows, contexts, strict=True)],
        [1] * len(contexts),
        contexts,
        block_size,
    )
    torch.testing.assert_close(want, paged_attention(q, kv, meta, 0.25, window), atol=1e-6, rtol=0)
    assert (decode_attention_reference(q, kv, batch, 0.25) - want).abs().max().item() > 0.05


@pytest.mark.parametrize(("num_splits", "window"), [(1, 0), (3, 6)])
def test_graph_decode_entry_with_softcap(num_splits: int, window: int) -> None:
    """The graph-safe decode entry with soft-capped scores (Gemma 2 decodes under CUDA graphs),
    against the graph-safe reference and the unified reference."""
    block_size, num_kv_heads, group, head_dim = 4, 2, 2, 16
    contexts = [1, 37, 70, 4, 9]
    width = 20
    num_blocks = sum(math.ceil(c / block_size) for c in contexts) + 3
    gen = torch.Generator().manual_seed(num_splits)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    batch, rows = _decode_batch(contexts, width, block_size, num_blocks, seed=num_splits)
    q = torch.randn(len(contexts), num_kv_heads * group, head_dim, generator=gen)
    attend = prepare_decode_triton(batch, num_kv_heads * group, num_kv_heads, num_splits=num_splits)
    got = attend(q, kv, 0.5, window, 1.0)
    want = decode_attention_reference(q, kv, batch, 0.5, window, 1.0)
    torch.testing.assert_close(got, want, **_TOL[torch.float32])
    meta = build_meta(
        [r[: math.ceil(c / block_size)] for r, c in zip(rows, contexts, strict=True)],
        [1] * len(contexts),
        contexts,
        block_size,
    )
    torch.testing.assert_close(
        want, paged_attention(q, kv, meta, 0.5, window, 1.0), atol=1e-6, rtol=0
    )
    assert (decode_attention_reference(q, kv, batch, 0.5, window) - want).abs().max().item() > 0.05


def test_graph_decode_entry_checks_its_inputs() -> None:
    batch, _ = _decode_batch([3, 4], 2, 4, 8, seed=0)
    with pytest.raises(ValueError, match="int32"):
        DecodeBatch(batch.block_tables, batch.context_lens.long(), 4)
    with pytest.raises(ValueError, match="context_lens"):
        DecodeBatch(batch.block_tables, batch.context_lens[:1], 4)
    kv = torch.zeros(2, 8, 4, 2, 16)
    attend = prepare_decode_triton(batch, 4, 2)
    with pytest.raises(ValueError, match="rows"):
        attend(torch.zeros(3, 4, 16), kv, 1.0)


def test_attention_split_k_half_precision() -> None:
    q, kv, meta = _paged_case(
        block_size=8,
        num_kv_heads=1,
        group=2,
        head_dim=16,
        items=[(50, 1), (17, 3)],
        dtype=torch.float16,
        seed=7,
    )
    got = paged_attention_triton(q, kv, meta, 0.25, num_splits=4)
    want = paged_attention(q, kv, meta, 0.25)
    torch.testing.assert_close(got.float(), want.float(), **_TOL[torch.float16])


def test_split_heuristic() -> None:
    # Short contexts or a full grid: never split.
    assert choose_num_splits(num_programs=8, max_context=512, num_sms=132) == 1
    assert choose_num_splits(num_programs=512, max_context=32768, num_sms=132) == 1
    # Batch-1 decode over a long context: split, but never into tiny partitions.
    assert choose_num_splits(num_programs=8, max_context=32768, num_sms=132) == 32
    assert choose_num_splits(num_programs=8, max_context=2048, num_sms=132) == 8
    assert choose_num_splits(num_programs=64, max_context=8192, num_sms=132) == 5


def test_attention_metadata_is_cached_per_step() -> None:
    _, _, meta = _paged_case(
        block_size=4,
        num_kv_heads=2,
        group=2,
        head_dim=16,
        items=_MIXED,
        dtype=torch.float32,
        seed=0,
    )
    first = triton_attention_metadata(meta, 4, 2)
    assert triton_attention_metadata(meta, 4, 2) is first  # every layer reuses it
    assert first.query_start.tolist() == meta.query_start
    assert first.context_lens.tolist() == meta.context_lens
    # Tiles never straddle items and cover every query token exactly once.
    covered = [0] * meta.num_items
    for item, q_lo in zip(first.tile_item.tolist(), first.tile_q_start.tolist(), strict=True):
        n = meta.query_start[item + 1] - meta.query_start[item]
        assert q_lo == covered[item] and q_lo < n
        covered[item] = min(n, q_lo + first.block_q)
    assert covered == [meta.query_start[i + 1] - meta.query_start[i] for i in range(meta.num_items)]


def test_attention_rejects_bad_shapes() -> None:
    q, kv, meta = _paged_case(
        block_size=4,
        num_kv_heads=2,
        group=2,
        head_dim=16,
        items=[(3, 2)],
        dtype=torch.float32,
        seed=0,
    )
    with pytest.raises(ValueError, match="rows"):
        paged_attention_triton(q[:1], kv, meta, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_triton(q[:, :3], kv, meta, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, hkv, d = 6, 4, 2, 16
    pool = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    # K/V as strided views of one fused projection, like the model produces them.
    qkv = torch.randn(7, (4 + 2 * hkv) * d, generator=gen).to(dtype)
    k = qkv[:, 4 * d : (4 + hkv) * d].view(7, hkv, d)
    v = qkv[:, (4 + hkv) * d :].view(7, hkv, d)
    slots = torch.tensor([5, 0, 23, 9, 10, 11, 16])
    want = pool.clone()
    write_kv(want, k, v, slots)
    got = pool.clone()
    triton_write_kv(got, k, v, slots)
    assert torch.equal(got, want)


def test_write_kv_skips_negative_slots() -> None:
    pool = torch.zeros(2, 3, 4, 1, 16)
    k = torch.ones(3, 1, 16)
    triton_write_kv(pool, k, -k, torch.tensor([2, -1, 7]))
    assert pool[0].flatten(0, 1)[[2, 7]].eq(1).all() and pool[1].flatten(0, 1)[[2, 7]].eq(-1).all()
    assert pool.abs().sum() == 2 * 2 * 16


# ----------------------------------------------------------------------------------------------
# RMSNorm / rotary
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 48])
def test_rms_norm_residual(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(5, width, generator=gen).to(dtype)
    res = torch.randn(5, width, generator=gen).to(dtype)
    w = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    x_before, res_before = x.clone(), res.clone()
    normed, new_res = rms_norm_residual_triton(x, res, w, 1e-5)
    want_res = res + x
    want = rms_norm(want_res, w, 1e-5)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched
    if dtype == torch.bfloat16:
        torch.testing.assert_close(new_res, want_res, atol=0, rtol=2**-7)
        torch.testing.assert_close(normed, want, atol=2e-2, rtol=2e-2)
    else:
        assert torch.equal(new_res, want_res)
        torch.testing.assert_close(normed, want, **_TOL[dtype])
    # Without a residual: plain RMSNorm, the input passed through as the residual.
    normed2, passthrough = rms_norm_residual_triton(x, None, w, 1e-5)
    assert passthrough is x
    torch.testing.assert_close(normed2, rms_norm(x, w, 1e-5), **_TOL[dtype])


def test_rms_norm_per_head() -> None:
    # Qwen3's q/k norm: RMSNorm over head_dim of a [T, H, D] tensor.
    x = torch.randn(3, 4, 16)
    w = torch.rand(16) + 0.5
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotary_in_place(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    t, h, hkv, d = 6, 4, 2, 20
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(dtype)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    v_before = qkv[:, (h + hkv) * d :].clone()
    angles = torch.rand(t, d // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    got_q, got_k = rotary_triton(q, k, cos, sin)
    assert got_q is q and got_k is k
    assert torch.equal(qkv[:, (h + hkv) * d :], v_before)  # V untouched
    if dtype == torch.float16:
        assert torch.equal(q, want_q) and torch.equal(k, want_k)  # bit-identical
    else:
        # bf16: the interpreter's rounding of each intermediate can be an ulp off, and the
        # final difference of two products amplifies that relative to small outputs.
        tol = _TOL[dtype]
        torch.testing.assert_close(q, want_q, **tol)
        torch.testing.assert_close(k, want_k, **tol)
    # k alone (q with no heads), as a layer writing K/V for no query row rotates it.
    k_only = torch.randn(t, hkv, d, generator=gen).to(dtype)
    want_k = apply_rotary(k_only, cos, sin)
    _, got_k = rotary_triton(k_only[:, :0], k_only, cos, sin)
    assert got_k is k_only
    torch.testing.assert_close(k_only, want_k, **_TOL[dtype])


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------

_V = 3000  # > the kernel's 2048-wide chunk, so the cross-chunk reductions are exercised
_N = 6


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(_N, _V, generator=torch.Generator().manual_seed(seed)) * 3


def _params(
    temperature: list[float],
    *,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    penalty: list[float] | None = None,
    penalty_ids: list[list[int]] | None = None,
    masks: list[bytes | None] | None = None,
    num_logprobs: int = 0,
) -> SamplingTensors:
    return build_sampling_tensors(
        temperature=temperature,
        top_k=top_k or [0] * _N,
        top_p=top_p or [1.0] * _N,
        seeds=[1, 2**64 - 1, 2**62 + 3, 7, 0, 12345],
        offsets=[0, 1, 17, 100, 3, 9],
        repetition_penalty=penalty or [1.0] * _N,
        penalty_ids=penalty_ids,
        token_mask_bits=masks,
        num_logprobs=num_logprobs,
        vocab_size=_V,
        device="cpu",
    )


def _masks() -> list[bytes | None]:
    rnd = random.Random(0)
    nbytes = (_V + 7) // 8
    sparse = bytearray(nbytes)
    sparse[2900 // 8] = 1 << (2900 % 8)  # only token 2900 allowed (in the second chunk)
    return [
        None,
        bytes(rnd.getrandbits(8) for _ in range(nbytes)),
        bytes(nbytes),  # allows nothing: falls back to the unmasked argmax
        bytes(sparse),
        None,
        bytes(rnd.getrandbits(8) for _ in range(nbytes)),
    ]


def _assert_same(params: SamplingTensors, logits: torch.Tensor) -> None:
    got, want = sample_triton(logits, params), sample(logits, params)
    assert torch.equal(got.token_ids, want.token_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.top_ids, want.top_ids)
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=1e-5, rtol=1e-5)


def test_gumbel_noise_matches_reference() -> None:
    seeds = torch.tensor([1, -5, 2**62, 7], dtype=torch.int64)
    offsets = torch.tensor([0, 1, 5, 1 << 40], dtype=torch.int64)
    got = gumbel_noise_triton(seeds, offsets, 2100)
    want = _gumbel_noise(seeds, offsets, torch.arange(2100))
    # Same integer stream and uniforms; only the two float logs may differ in the last ulp.
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_greedy_plain() -> None:
    logits = _logits(0)
    logits[0, 100] = logits[0, 2500] = 50.0  # tie across chunks: the lower id wins
    _assert_same(_params([0.0] * _N), logits)
    assert sample_triton(logits, SamplingTensors.greedy(_N, "cpu")).token_ids[0] == 100


def test_greedy_with_penalty_mask_and_logprobs() -> None:
    logits = _logits(1)
    seen = [[int(t) for t in logits[i].topk(3).indices] for i in range(_N)]  # penalise the top
    params = _params(
        [0.0] * _N,
        penalty=[1.5, 1.0, 0.5, 2.0, 1.2, 1.0],
        penalty_ids=seen,
        masks=_masks(),
        num_logprobs=4,
    )
    _assert_same(params, logits)


def test_sampled_unfiltered_matches_reference() -> None:
    logits = _logits(2)
    params = _params(
        [0.7, 1.0, 0.0, 2.0, 0.5, 1.3],
        penalty=[1.3, 1.0, 1.0, 1.0, 0.8, 1.0],
        penalty_ids=[[1, 2, 3]] * _N,
        masks=_masks(),
    )
    assert not params.needs_top_k_top_p
    _assert_same(params, logits)


def test_sampled_top_k_top_p_matches_reference() -> None:
    logits = _logits(3)
    params = _params(
        [0.7, 1.0, 0.0, 2.0, 0.5, 1.0],
        top_k=[5, 0, 0, 50, 0, 1],
        top_p=[1.0, 0.9, 1.0, 0.5, 0.3, 1.0],
        masks=_masks(),
        num_logprobs=2,
    )
    assert params.needs_top_k_top_p
    _assert_same(params, logits)


def test_sampling_is_batch_invariant() -> None:
    logits = _logits(4)
    params = _params([1.0] * _N, top_p=[0.8] * _N)
    full = sample_triton(logits, params).token_ids
    one = _params([1.0] * _N, top_p=[0.8] * _N)
    sub = SamplingTensors(
        temperature=one.temperature[3:4],
        top_k=one.top_k[3:4],
        top_p=one.top_p[3:4],
        seeds=one.seeds[3:4],
        offsets=one.offsets[3:4],
        repetition_penalty=one.repetition_penalty[3:4],
        penalty_mask=None,
        token_mask=None,
        num_logprobs=0,
        all_greedy=False,
    )
    assert sample_triton(logits[3:4], sub).token_ids.item() == full[3].item()


# ----------------------------------------------------------------------------------------------
# Backend selection
# ----------------------------------------------------------------------------------------------


def test_select_backend() -> None:
    assert select_backend("cpu").name == "cpu"  # the interpreter is never picked implicitly
    assert select_backend(torch.device("cpu"), prefer="torch").name == "torch"
    forced = select_backend("cpu", prefer="triton")  # allowed here: TRITON_INTERPRET=1
    assert forced.name == "triton"
    assert forced.attention == WriteThenAttend(triton_write_kv, paged_attention_triton)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        select_backend("cpu", prefer="nope")


def test_attention_provider_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    import ferrum_kernels.backend as backend_module

    monkeypatch.setattr(backend_module, "_PROVIDERS", {})  # leave no global registration behind
    calls: list[str] = []

    def provider(device: torch.device):  # type: ignore[no-untyped-def]
        def attention(q, k, v, kv, meta, scale):  # type: ignore[no-untyped-def]
            calls.append("hit")
            write_kv(kv, k, v, meta.slot_mapping)
            return paged_attention(q, kv, meta, scale)

        return attention if device.type == "cpu" else None

    register_attention_provider("fake", provider)
    backend = select_backend("cpu", prefer="fake")
    assert backend.name == "triton+fake"
    q, kv, meta = _paged_case(
        block_size=4,
        num_kv_heads=1,
        group=1,
        head_dim=16,
        items=[(2, 1)],
        dtype=torch.float32,
        seed=0,
    )
    k = v = torch.zeros(meta.num_tokens, 1, 16)
    backend.attention(q, k, v, kv, meta, 1.0)
    assert calls == ["hit"]


def _layer(
    backend: KernelBackend,
    hidden: torch.Tensor,
    residual: torch.Tensor,
    weights: dict[str, torch.Tensor],
    kv: torch.Tensor,
    meta: object,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention block the way the model would run it through a backend."""
    t = hidden.shape[0]
    x, residual = backend.rms_norm_residual(hidden, residual, weights["norm"], 1e-5)
    qkv = x @ weights["qkv"]  # [T, (H + 2Hkv) * D]
    q = qkv[:, :64].view(t, 4, 16)
    k = qkv[:, 64:96].view(t, 2, 16)
    v = qkv[:, 96:].view(t, 2, 16)
    q, k = backend.rotary(q, k, cos, sin)
    out = backend.attention(q, k, v, kv, meta, 0.25)  # type: ignore[arg-type]
    return out.reshape(t, 64), residual


def test_backends_agree_on_an_attention_block() -> None:
    gen = torch.Generator().manual_seed(9)
    items = [(0, 5), (4, 1), (2, 3)]
    _, kv, meta = _paged_case(
        block_size=4,
        num_kv_heads=2,
        group=2,
        head_dim=16,
        items=items,
        dtype=torch.float32,
        seed=9,
    )
    t = meta.num_tokens
    hidden = torch.randn(t, 32, generator=gen)
    residual = torch.randn(t, 32, generator=gen)
    weights = {"norm": torch.rand(32, generator=gen) + 0.5, "qkv": torch.randn(32, 128) * 0.2}
    angles = torch.rand(t, 8, generator=gen)
    outs = []
    for name in ("torch", "triton"):
        pool = kv.clone()
        out, res = _layer(
            select_backend("cpu", prefer=name),
            hidden,
            residual,
            weights,
            pool,
            meta,
            angles.cos(),
            angles.sin(),
        )
        outs.append((out, res, pool))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1])
    torch.testing.assert_close(outs[0][2], outs[1][2], atol=1e-5, rtol=1e-5)


def test_engine_on_triton_kernels_matches_the_torch_engine() -> None:
    """The whole executor path (attention, KV write, sampling) on the Triton backend, run by
    the interpreter, gives the torch engine's tokens and logits."""
    from ferrum_server.config import EngineConfig
    from ferrum_server.domain import ItemKind, OutputPolicy, Sampling, Step, StepItem
    from ferrum_server.engine import Engine

    logits = Sampling(policy=OutputPolicy.LOGITS)
    outputs = []
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(block_size=4, kv_cache_bytes=1 << 20, kernel_backend=backend))
        assert engine.runner.kernels.name == backend
        prompt = [(7 * i + 3) % 512 for i in range(11)]
        first = engine.execute(Step([StepItem(ItemKind.PREFILL_CHUNK, "r", "", prompt, 0, 11)]))
        result = first.results[0]
        steps = [result.token_ids[0]]
        for position in range(11, 14):
            item = StepItem(ItemKind.DECODE, "r", result.cache_id, [steps[-1]], position)
            steps.append(engine.execute(Step([item])).results[0].token_ids[0])
        item = StepItem(ItemKind.DECODE, "r", result.cache_id, [steps[-1]], 14, sampling=logits)
        row = engine.execute(Step([item])).results[0].logits
        outputs.append((steps, torch.frombuffer(bytearray(row), dtype=torch.float32)))
        engine.shutdown()
    assert outputs[0][0] == outputs[1][0]
    torch.testing.assert_close(outputs[1][1], outputs[0][1], atol=1e-4, rtol=1e-4)


def test_engine_decode_graphs_on_triton_match_the_eager_torch_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode steps replayed through the graph path (eager stand-in for the CUDA graph) on the
    Triton kernels, run by the interpreter: same tokens and logits as the torch engine."""
    from dataclasses import replace

    from ferrum_server import engine as engine_module
    from ferrum_server import startup
    from ferrum_server.config import EngineConfig
    from ferrum_server.cuda_graphs import EagerCapturer
    from ferrum_server.domain import ItemKind, OutputPolicy, Sampling, Step, StepItem

    monkeypatch.setattr(startup, "graph_capturer_for", lambda device: EagerCapturer())
    logits = Sampling(policy=OutputPolicy.LOGITS)
    config = EngineConfig(
        block_size=4,
        kv_cache_bytes=1 << 20,
        max_sequence_length=32,
        max_batch_size=4,
        cuda_graph_max_batch=2,
    )
    outputs = []
    for backend in ("torch", "triton"):
        engine = engine_module.Engine(replace(config, kernel_backend=backend))
        assert engine.graph_batch_sizes == (() if backend == "torch" else (1, 2))
        prompts = [[(7 * i + 3 + r) % 512 for i in range(9 + 4 * r)] for r in range(3)]
        first = engine.execute(
            Step(
                [
                    StepItem(ItemKind.PREFILL_CHUNK, f"r{r}", "", p, 0, len(p))
                    for r, p in enumerate(prompts)
                ]
            )
        )
        caches = [res.cache_id for res in first.results]
        tokens = [[res.token_ids[0]] for res in first.results]
        for step in range(3):
            live = range(3) if step == 2 else range(1, 3)  # 2 items replay, 3 run eagerly
            items = [
                StepItem(
                    ItemKind.DECODE,
                    f"r{r}",
                    caches[r],
                    [tokens[r][-1]],
                    len(prompts[r]) + len(tokens[r]) - 1,
                    sampling=logits if step == 1 else Sampling(),
                )
                for r in live
            ]
            results = engine.execute(Step(items)).results
            for r, res in zip(live, results, strict=True):
                if res.logits:
                    row = torch.frombuffer(bytearray(res.logits), dtype=torch.float32)
                    outputs.append((backend, r, row))
                    tokens[r].append(int(row.argmax()))
                else:
                    tokens[r].append(res.token_ids[0])
        outputs.append((backend, -1, tokens))
        assert engine.stats.graph_steps == (0 if backend == "torch" else 2)
        engine.shutdown()
    half = len(outputs) // 2
    for (_, r_a, a), (_, r_b, b) in zip(outputs[:half], outputs[half:], strict=True):
        assert r_a == r_b
        if r_a < 0:
            assert a == b
        else:
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_penalty_scope_matches_a_hand_computed_expectation() -> None:
    """The scope only changes which ids reach the penalty mask, which the Triton kernel reads:
    the same hand-computed rows as tests/unit/test_sampling.py."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 3.0]] * 3)
    params = build_sampling_tensors(
        temperature=[0.0] * 3,
        top_k=[0] * 3,
        top_p=[1.0] * 3,
        seeds=[0] * 3,
        offsets=[0] * 3,
        repetition_penalty=[2.0] * 3,
        penalty_ids=[[4, 1, 2]] * 3,
        token_mask_bits=None,
        num_logprobs=0,
        vocab_size=5,
        device="cpu",
        penalty_start=[0, 2, 3],  # prompt and outputs; outputs only; outputs only, none yet
    )
    assert sample_triton(logits, params).token_ids.tolist() == [0, 4, 4]

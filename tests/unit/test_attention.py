"""paged_attention / write_kv against a dense per-item causal attention on contiguous K/V."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from ferrum_kernels.attention import AttentionMetadata, paged_attention, write_kv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_models import build_meta, random_paged_batch


def run_case(
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    items: list[tuple[int, int]],  # (history_len, query_len) per item
    shuffle: bool,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (paged output, float64 dense reference), both [T, H, D]."""
    batch = random_paged_batch(
        items,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=16,
        dtype=dtype,
        seed=seed,
        shuffle=shuffle,
        device=device,
        window=window,
    )
    query = torch.cat(batch.queries).to(device)  # [T, H, D]
    out = paged_attention(query, batch.kv_layer, batch.meta, batch.scale, window).cpu()
    return out, batch.reference


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_batch_matches_dense(block_size: int, group: int) -> None:
    items = [
        (0, 1),  # single-token prompt: a "decode" with no history
        (0, 13),  # fresh prefill, partial last block
        (7, 1),  # decode
        (21, 5),  # prefill chunk on top of history
        (16, 1),  # decode landing on a block boundary
        (3, 9),  # chunk crossing blocks
        (40, 1),  # long decode
        (0, 2),
    ]
    out, ref = run_case(
        block_size=block_size, num_kv_heads=2, group=group, items=items, shuffle=True, seed=7
    )
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed: int) -> None:
    rng = random.Random(seed)
    items = []
    for _ in range(rng.randint(1, 7)):
        hist = rng.choice([0, rng.randint(1, 40)])
        items.append((hist, 1 if rng.random() < 0.5 else rng.randint(1, 20)))
    out, ref = run_case(
        block_size=rng.choice([1, 2, 4, 8, 16]),
        num_kv_heads=rng.choice([1, 2, 4]),
        group=rng.choice([1, 2, 4]),
        items=items,
        shuffle=rng.random() < 0.8,
        seed=seed,
    )
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# (history, new rows) per item against a window of 6: chunks that start before the window edge
# and cross it, a chunk far past it, decodes far past it, and items shorter than the window.
_WINDOWED = [(0, 13), (3, 9), (21, 5), (40, 1), (7, 1), (2, 1), (0, 1), (30, 12)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 6])
def test_sliding_window_matches_dense(block_size: int, window: int) -> None:
    out, ref = run_case(
        block_size=block_size,
        num_kv_heads=2,
        group=2,
        items=_WINDOWED,
        shuffle=True,
        seed=13,
        window=window,
    )
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # The window matters here: global attention gives other answers.
    glob, _ = run_case(
        block_size=block_size, num_kv_heads=2, group=2, items=_WINDOWED, shuffle=True, seed=13
    )
    assert (glob - out).abs().max().item() > 1e-2


def test_window_covering_every_context_is_global() -> None:
    out, _ = run_case(
        block_size=4, num_kv_heads=2, group=2, items=_WINDOWED, shuffle=True, seed=2, window=42
    )
    glob, ref = run_case(
        block_size=4, num_kv_heads=2, group=2, items=_WINDOWED, shuffle=True, seed=2
    )
    torch.testing.assert_close(out, glob, atol=0, rtol=0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_negative_window_is_rejected() -> None:
    batch = random_paged_batch(
        [(3, 2)], block_size=4, num_kv_heads=1, group=1, head_dim=16, dtype=torch.float32, seed=0
    )
    with pytest.raises(ValueError, match="sliding window"):
        paged_attention(torch.cat(batch.queries), batch.kv_layer, batch.meta, 1.0, -1)


def test_only_decodes_and_only_prefills() -> None:
    for items in ([(5, 1), (0, 1), (30, 1)], [(0, 6), (10, 4)]):
        out, ref = run_case(
            block_size=4, num_kv_heads=2, group=2, items=items, shuffle=True, seed=3
        )
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype: torch.dtype) -> None:
    out, ref = run_case(
        block_size=4,
        num_kv_heads=2,
        group=2,
        items=[(9, 1), (0, 11), (6, 3), (20, 1)],
        shuffle=True,
        seed=11,
        dtype=dtype,
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_write_kv_scatters_to_slots() -> None:
    torch.manual_seed(0)
    num_blocks, block_size, hkv, d = 5, 4, 2, 8
    kv_layer = torch.zeros(2, num_blocks, block_size, hkv, d)
    slots = torch.tensor([17, 0, 6, 19, 8], dtype=torch.int64)
    key = torch.randn(5, hkv, d)
    value = torch.randn(5, hkv, d)
    write_kv(kv_layer, key, value, slots)
    for t, slot in enumerate(slots.tolist()):
        block, off = divmod(slot, block_size)
        assert torch.equal(kv_layer[0, block, off], key[t])
        assert torch.equal(kv_layer[1, block, off], value[t])
    # Nothing else was touched.
    assert int((kv_layer.abs().sum(dim=(-1, -2)) != 0).sum()) == 2 * len(slots)


def test_write_kv_into_pool_slice_and_casts() -> None:
    # The model receives kv_cache[layer]; the write must land in the shared pool.
    pool = torch.zeros(3, 2, 4, 2, 1, 4, dtype=torch.bfloat16)
    key = torch.ones(2, 1, 4)
    write_kv(pool[1], key, 2 * key, torch.tensor([0, 7]))
    assert pool[1, 0, 0, 0].eq(1).all() and pool[1, 1, 3, 1].eq(2).all()
    assert pool[0].eq(0).all() and pool[2].eq(0).all()


def test_metadata_validation() -> None:
    table = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="query_start"):
        AttentionMetadata.build([0, 2], [2, 1], table, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="smaller than"):
        AttentionMetadata.build([0, 3, 4], [2, 1], table, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping"):
        AttentionMetadata.build([0, 2, 3], [2, 1], table, torch.zeros(5, dtype=torch.int64))
    meta = AttentionMetadata.build(
        [0, 1, 4, 5],
        [9, 3, 1],
        torch.zeros(3, 3, dtype=torch.int64),
        torch.zeros(5, dtype=torch.int64),
    )
    assert meta.decode_items == (0, 2) and meta.prefill_items == (1,)
    assert meta.decode_rows.tolist() == [0, 4]
    assert meta.max_decode_context == 9


def test_too_narrow_block_table_is_rejected() -> None:
    meta = build_meta([[0, 1]], [1], [8], block_size=4)
    narrow = AttentionMetadata.build(meta.query_start, [9], meta.block_tables, meta.slot_mapping)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        paged_attention(torch.zeros(1, 2, 8), torch.zeros(2, 4, 4, 2, 8), narrow, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_dense(dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    out, ref = run_case(
        block_size=16,
        num_kv_heads=2,
        group=4,
        items=[(0, 1), (0, 37), (50, 1), (21, 9), (100, 1), (5, 64)],
        shuffle=True,
        seed=13,
        dtype=dtype,
        device="cuda",
    )
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("block_size", [1, 4])
def test_softcap_matches_dense(block_size: int, window: int) -> None:
    """Soft-capped scores (Gemma 2), decodes and chunks, with and without a window."""
    kwargs = dict(block_size=block_size, num_kv_heads=2, group=2, head_dim=16, seed=5)
    batch = random_paged_batch(
        _WINDOWED,
        dtype=torch.float32,
        window=window,
        softcap=0.5,
        **kwargs,  # type: ignore[arg-type]
    )
    query = torch.cat(batch.queries)
    out = paged_attention(query, batch.kv_layer, batch.meta, batch.scale, window, 0.5)
    torch.testing.assert_close(out.double(), batch.reference, atol=1e-5, rtol=1e-5)
    # The cap matters here: uncapped attention gives other answers.
    plain = paged_attention(query, batch.kv_layer, batch.meta, batch.scale, window)
    assert (plain - out).abs().max().item() > 1e-2


@pytest.mark.parametrize("softcap", [-1.0, float("inf"), float("nan")])
def test_bad_softcap_is_rejected(softcap: float) -> None:
    batch = random_paged_batch(
        [(3, 2)], block_size=4, num_kv_heads=1, group=1, head_dim=16, dtype=torch.float32, seed=0
    )
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(torch.cat(batch.queries), batch.kv_layer, batch.meta, 1.0, 0, softcap)

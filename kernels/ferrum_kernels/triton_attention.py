# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
# (@triton.jit kernels take untyped pointer/scalar arguments by design; triton ships no stubs.
# The Python wrappers below are fully annotated.)
"""Paged attention and KV writes as Triton kernels (the CUDA fast path).

Same contract as ``ferrum_kernels.attention``: ``paged_attention_triton(query, kv_layer, meta,
scale)`` is a drop-in replacement for ``paged_attention`` and ``triton_write_kv`` for
``write_kv``. The torch functions stay the CPU path and the test oracle.

One launch covers a whole unified batch. The flat token dimension T is cut into *tiles* of
``BLOCK_Q`` query tokens that never straddle two items; a tile together with one KV head is one
program. Its ``BLOCK_Q * GROUP_PAD`` rows are (token, query head) pairs of the heads that share
that KV head, so every K/V block read from the pool serves the whole GQA group. K/V are read
straight from the pool through the block table (no gather copy) and combined with an online
(flash) softmax in float32.

Split-K ("flash decoding"): with few programs (small batch) and long contexts the GPU would sit
mostly idle, so the KV range of every tile is cut into ``num_splits`` partitions processed by
separate programs; each writes a normalised partial output plus its log-sum-exp, and a small
reduce kernel merges them.

CUDA graphs: ``prepare_decode_triton(DecodeBatch, ...)`` returns a decode-only entry point whose
launches depend on device tensors alone (no per-step host metadata, no host sync). Its split
count is fixed when it is prepared (sized for the longest context the block tables allow), and
the kernel cuts each item's *actual* context into that many spans itself, so one captured graph
serves every mix of context lengths.

Sliding window: ``window > 0`` (a runtime argument, so local and global layers share one
compiled kernel per WINDOWED flag) limits a query at position p to keys in (p - window, p]. Each
tile starts its KV loop at the first position its earliest query can see, so a decode far past
the window reads only ``window`` positions, and splits share that shorter range.

Soft-capping: ``softcap > 0`` (Gemma 2; a compile-time SOFTCAP flag plus the runtime cap)
turns each scaled score s into ``softcap * tanh(s / softcap)`` before the mask and the online
softmax. ``tanh`` is written as ``1 - 2 / (exp(2x) + 1)`` (exact at both saturations, about
1e-7 absolute near 0), since ``tl`` has no portable tanh that also runs in the interpreter.

Constraints (checked by the wrappers):
  * any pool block size >= 1 (positions are mapped to blocks per KV position, so block sizes need
    not be powers of two or match the kernel's KV tile);
  * any head_dim <= 256 and any GQA ratio (both padded to powers of two inside the kernel);
  * query/key/value last dimension contiguous; the pool contiguous in its last dimension.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrum_kernels.attention import (
    AttentionMetadata,
    DecodeAttentionFn,
    DecodeBatch,
    check_softcap,
    check_window,
)
from ferrum_kernels.transfer import to_device

__all__ = [
    "TritonAttentionMetadata",
    "choose_num_splits",
    "paged_attention_triton",
    "prepare_decode_triton",
    "triton_attention_metadata",
    "triton_write_kv",
]

_LOG2E = 1.4426950408889634
# A non-split launch gives each program the whole KV range; this bound is "infinite" for it.
_NO_SPLIT_SPAN = 1 << 30
_MAX_SPLITS = 32
# Below this context a tile's KV loop is short enough that splitting only adds reduce overhead.
_SPLIT_MIN_CONTEXT = 1024
# Each split should still stream a meaningful amount of KV.
_SPLIT_MIN_SPAN = 256
_MAX_HEAD_DIM = 256


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------
# Derived device metadata
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TritonAttentionMetadata:
    """Device tensors the kernels need, derived once per (AttentionMetadata, BLOCK_Q)."""

    query_start: torch.Tensor  # [B+1] int32: cumulative query offsets into T
    context_lens: torch.Tensor  # [B] int32: KV length per item after this step's writes
    tile_item: torch.Tensor  # [num_tiles] int32: item of each query tile
    tile_q_start: torch.Tensor  # [num_tiles] int32: first query token of the tile, in its item
    block_tables: torch.Tensor  # [B, max_blocks] int64, row-contiguous
    num_tiles: int
    block_q: int


def _max_query_len(meta: AttentionMetadata) -> int:
    qs = meta.query_start
    return max((qs[i + 1] - qs[i] for i in range(len(qs) - 1)), default=0)


def _build_metadata(meta: AttentionMetadata, block_q: int) -> TritonAttentionMetadata:
    qs, cl = meta.query_start, meta.context_lens
    tile_item: list[int] = []
    tile_q_start: list[int] = []
    for i in range(len(cl)):
        for q_lo in range(0, qs[i + 1] - qs[i], block_q):
            tile_item.append(i)
            tile_q_start.append(q_lo)
    num_tiles = len(tile_item)
    # One host->device copy for all four int32 arrays; the fields are views of it.
    host = torch.tensor([*qs, *cl, *tile_item, *tile_q_start], dtype=torch.int32)
    dev = to_device(host, meta.block_tables.device)
    b = len(cl)
    return TritonAttentionMetadata(
        query_start=dev[: b + 1],
        context_lens=dev[b + 1 : 2 * b + 1],
        tile_item=dev[2 * b + 1 : 2 * b + 1 + num_tiles],
        tile_q_start=dev[2 * b + 1 + num_tiles :],
        block_tables=meta.block_tables.contiguous(),
        num_tiles=num_tiles,
        block_q=block_q,
    )


class _MetadataCache:
    """Remembers the derived tensors of the last few metadata objects.

    Every layer of a forward pass passes the same ``AttentionMetadata`` object, so keying by
    identity makes the derivation (and its host->device copy) happen once per step. The entry
    keeps the metadata alive, so its id cannot be reused while cached. (``AttentionMetadata`` is
    a slotted frozen dataclass: it can neither carry extra attributes nor be weak-referenced.)
    """

    def __init__(self, capacity: int = 8) -> None:
        self._entries: OrderedDict[
            tuple[int, int], tuple[AttentionMetadata, TritonAttentionMetadata]
        ] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, meta: AttentionMetadata, block_q: int) -> TritonAttentionMetadata:
        key = (id(meta), block_q)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] is meta:
                self._entries.move_to_end(key)
                return hit[1]
        derived = _build_metadata(meta, block_q)
        with self._lock:
            self._entries[key] = (meta, derived)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return derived


_CACHE = _MetadataCache()


def _choose_block_q(max_query_len: int, group_pad: int) -> int:
    """Query tokens per tile: tl.dot needs >= 16 rows, prefill tiles want more for reuse."""
    rows = 16 if max_query_len <= 1 else 64
    rows = max(rows, group_pad)
    return max(1, rows // group_pad)


def triton_attention_metadata(
    meta: AttentionMetadata, num_heads: int, num_kv_heads: int
) -> TritonAttentionMetadata:
    """The cached device-side view of ``meta`` that ``paged_attention_triton`` launches with."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    return _CACHE.get(meta, _choose_block_q(_max_query_len(meta), group_pad))


_SM_COUNTS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs: pretend to be an H100-class part, so tests see splits
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def choose_num_splits(num_programs: int, max_context: int, num_sms: int) -> int:
    """How many KV partitions to use.

    Split only when the non-split grid cannot fill the GPU (fewer programs than SMs) and the
    contexts are long enough that each partition still streams >= _SPLIT_MIN_SPAN positions.
    Aim for about two waves of programs.
    """
    if max_context < _SPLIT_MIN_CONTEXT or num_programs >= num_sms:
        return 1
    by_occupancy = -(-2 * num_sms // max(num_programs, 1))  # ceil division
    by_length = max_context // _SPLIT_MIN_SPAN
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _unified_attention_kernel(
    q_ptr,  # [T, H, D]
    kv_ptr,  # [2, NB, BS, Hkv, D]
    out_ptr,  # [T, H, D] (non-split launches)
    part_out_ptr,  # [S, T, H, D] float32 (split launches)
    part_lse_ptr,  # [S, T, H] float32, log2 domain (split launches)
    block_table_ptr,  # [B, max_blocks] int64
    query_start_ptr,  # [B+1] int32
    context_lens_ptr,  # [B] int32
    tile_item_ptr,  # [num_tiles] int32
    tile_q_start_ptr,  # [num_tiles] int32
    qk_scale,  # scale * log2(e) (scores live in the exp2 domain); scale / softcap with SOFTCAP
    softcap_log2,  # softcap * log2(e); ignored unless SOFTCAP
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_blk,
    stride_slot,
    stride_kvh,
    stride_bt,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    kv_span,  # KV positions per split (multiple of BLOCK_N); huge when not splitting
    window,  # sliding window (keys in (p - window, p]); ignored unless WINDOWED
    BLOCK_SIZE: tl.constexpr,  # pool block size
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_N: tl.constexpr,  # KV positions per inner step
    SPLIT: tl.constexpr,
    SPAN_FROM_CONTEXT: tl.constexpr,  # derive each tile's split span from its context (graphs)
    WINDOWED: tl.constexpr,  # a sliding-window layer
    SOFTCAP: tl.constexpr,  # attention logit soft-capping
    DOT_F32: tl.constexpr,  # upcast dot operands (fp32 inputs, or the CPU interpreter)
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD

    item = tl.load(tile_item_ptr + tile)
    q_lo = tl.load(tile_q_start_ptr + tile)  # first query token of this tile, within the item
    row0 = tl.load(query_start_ptr + item)
    n_q = tl.load(query_start_ptr + item + 1) - row0
    ctx = tl.load(context_lens_ptr + item)

    # Row r of the tile is token q_lo + r // GROUP_PAD, head r % GROUP_PAD of this KV group.
    offs_m = tl.arange(0, BLOCK_M)  # [M]
    tok = q_lo + offs_m // GROUP_PAD  # [M]
    g = offs_m % GROUP_PAD  # [M]
    row_ok = (tok < n_q) & (g < GROUP)  # [M]
    head = kv_head * GROUP + g  # [M]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [Dp]
    d_ok = offs_d < HEAD_DIM  # [Dp]

    q_rows = (row0 + tok).to(tl.int64) * stride_qt + head * stride_qh  # [M]
    q = tl.load(
        q_ptr + q_rows[:, None] + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [M, Dp]
    # Token j of an n-token item sits at absolute position ctx - n + j and sees <= that.
    # Padding rows borrow the last real token's position: every row then sees position 0, so no
    # row is ever fully masked (keeps the online softmax free of inf - inf).
    q_pos = ctx - n_q + tl.minimum(tok, n_q - 1)  # [M]
    # Exclusive end of the positions any row of this tile can see.
    tile_end = ctx - n_q + tl.minimum(q_lo + BLOCK_Q, n_q)
    # First position any row of this tile can see: the window of its earliest query.
    if WINDOWED:  # noqa: SIM108 (a compile-time branch)
        tile_lo = tl.maximum(ctx - n_q + q_lo - window + 1, 0)
    else:
        tile_lo = 0
    if SPAN_FROM_CONTEXT:
        # Graph launches fix the split count whatever the contexts are, so each tile shares
        # its own range evenly (same alignment rule as the host-side span).
        num_splits = tl.num_programs(2)
        span = (tile_end - tile_lo + num_splits - 1) // num_splits
        span = tl.where(span > BLOCK_N, (span + BLOCK_N - 1) // BLOCK_N * BLOCK_N, span)
    else:
        span = kv_span
    lo = tile_lo + split * span
    hi = tl.minimum(tile_end, lo + span)

    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)  # running numerator

    kv_head_off = kv_head * stride_kvh
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [N]
        pos_ok = pos < hi  # [N]; hi <= ctx, so no read past the item's context
        # Position -> physical block per position: works for any pool block size.
        blk = tl.load(
            block_table_ptr + item * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0
        )  # [N] int64
        base = blk.to(tl.int64) * stride_blk + (pos % BLOCK_SIZE) * stride_slot + kv_head_off
        kv_mask = pos_ok[None, :] & d_ok[:, None]  # [Dp, N]
        k = tl.load(kv_ptr + base[None, :] + offs_d[:, None], mask=kv_mask, other=0.0)  # [Dp, N]
        v = tl.load(
            kv_ptr + stride_kv + base[:, None] + offs_d[None, :],
            mask=pos_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [N, Dp]
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            # The reference casts the pool to the query dtype before attending.
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        if SOFTCAP:
            # s is (q.k * scale) / softcap here: tanh it, then back to softcap units, log2 domain.
            s = (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634)) + 1.0)) * softcap_log2
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]  # [M, N]
        if WINDOWED:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
        # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # [M]
        alpha = tl.exp2(m_i - m_safe)  # [M]
        p = tl.exp2(s - m_safe[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:  # noqa: SIM108 (a compile-time branch; keeps the two dot forms readable)
            pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv  # [M, Dp]
        m_i = m_new

    if SPLIT:
        # An empty partition (l == 0) contributes weight exp2(-inf) = 0 in the reduce.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]  # [M, Dp]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # [M]
        p_rows = split * stride_ps + (row0 + tok).to(tl.int64) * stride_pt + head * stride_ph
        tl.store(
            part_out_ptr + p_rows[:, None] + offs_d[None, :],
            o,
            mask=row_ok[:, None] & d_ok[None, :],
        )
        l_rows = split * stride_ls + (row0 + tok).to(tl.int64) * stride_lt + head
        tl.store(part_lse_ptr + l_rows, lse, mask=row_ok)
    else:
        o = acc / l_i[:, None]  # [M, Dp]; l > 0: every row sees position 0
        o_rows = (row0 + tok).to(tl.int64) * stride_ot + head * stride_oh  # [M]
        tl.store(
            out_ptr + o_rows[:, None] + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _split_reduce_kernel(
    part_out_ptr,  # [S, T, H, D] float32
    part_lse_ptr,  # [S, T, H] float32 (log2 domain)
    out_ptr,  # [T, H, D]
    num_splits,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)  # [S]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [Dp]
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(
        part_lse_ptr + offs_s * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf")
    )  # [S]
    # Some split holds each row's own position (the splits cover the tile's whole range), so
    # the max is finite.
    w = tl.exp2(lse - tl.max(lse, 0))  # [S]
    parts = tl.load(
        part_out_ptr
        + offs_s[:, None] * stride_ps
        + t * stride_pt
        + h * stride_ph
        + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [S, Dp]
    o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)  # [Dp]
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok
    )


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    kv_ptr,  # [2, NB, BS, Hkv, D]
    slot_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv,
    stride_blk,
    stride_slot,
    stride_kvh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    offs_h = tl.arange(0, HEADS_PAD)  # [Hp]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [Dp]
    # A negative slot is skipped: lets padded (e.g. graph-captured) batches carry dummy rows.
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :] & (slot >= 0)
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(
        value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )  # [Hp, Dp]
    dst = (
        (slot // BLOCK_SIZE) * stride_blk
        + (slot % BLOCK_SIZE) * stride_slot
        + offs_h[:, None] * stride_kvh
        + offs_d[None, :]
    )  # [Hp, Dp]
    tl.store(kv_ptr + dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(kv_ptr + stride_kv + dst, v.to(kv_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_write_kv(
    kv_layer: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's K/V rows into their pool slots, in place (fused K and V).

    kv_layer:     [2, num_blocks, block_size, num_kv_heads, head_dim]
    key, value:   [T, num_kv_heads, head_dim]; may be strided views (e.g. slices of a fused qkv)
    slot_mapping: [T] int64; entries < 0 are skipped (the torch reference needs valid slots)
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [T, {num_kv_heads}, {head_dim}], got "
            f"{tuple(key.shape)} / {tuple(value.shape)}"
        )
    if kv_layer.stride(-1) != 1:
        raise ValueError("kv_layer must be contiguous in its last dimension")
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_layer,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )


def paged_attention_triton(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of each item's query rows over its own paged KV history.

    query:      [T, num_heads, head_dim]
    kv_layer:   [2, num_blocks, block_size, num_kv_heads, head_dim], already holding this step's K/V
    window:     0 for global attention, else a query at position p sees keys in (p - window, p]
    softcap:    0 for none, else scores s become softcap * tanh(s / softcap) before the softmax
    num_splits: force the KV partition count (1 = never split); None = heuristic
    returns     [T, num_heads, head_dim] in query's dtype
    """
    check_window(window)
    check_softcap(softcap)
    num_tokens, num_heads, _ = query.shape
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    _check_shapes(query, kv_layer)
    if num_tokens != meta.num_tokens:
        raise ValueError(f"query has {num_tokens} rows but metadata describes {meta.num_tokens}")
    needed_blocks = math.ceil(meta.max_context / block_size)
    if needed_blocks > meta.block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {meta.block_tables.shape[1]} columns but a context of "
            f"{meta.max_context} needs {needed_blocks} blocks of {block_size}"
        )
    if num_tokens == 0:
        return torch.empty_like(query)
    derived = triton_attention_metadata(meta, num_heads, num_kv_heads)
    block_n = _block_n(query.shape[2])
    # The longest KV range one tile reads: its window plus the tile's own extra queries
    # (bounded by the context), or the whole context for a global layer.
    reach = meta.max_context
    if window:
        reach = min(reach, window + derived.block_q - 1)
    if num_splits is None:
        num_splits = choose_num_splits(
            derived.num_tiles * num_kv_heads, reach, _num_sms(query.device)
        )
    num_splits = max(1, min(num_splits, reach))
    if num_splits > 1:
        kv_span = triton.cdiv(reach, num_splits)
        if kv_span > block_n:
            # Aligned partitions keep every inner step but the last one full. (Alignment is not
            # needed for correctness, so tiny test contexts can still split.)
            kv_span = triton.cdiv(kv_span, block_n) * block_n
        num_splits = triton.cdiv(reach, kv_span)  # drop partitions nobody reaches
    else:
        kv_span = _NO_SPLIT_SPAN
    return _launch(
        query,
        kv_layer,
        derived,
        scale,
        num_splits,
        kv_span,
        window,
        softcap,
        span_from_context=False,
    )


def prepare_decode_triton(
    batch: DecodeBatch, num_heads: int, num_kv_heads: int, *, num_splits: int | None = None
) -> DecodeAttentionFn:
    """Graph-safe decode attention over ``batch``: every launch value is fixed here.

    The per-item index tensors are built once (not per call) and the split count is chosen for
    the longest context the tables allow; the kernel then divides each item's actual context
    among the splits itself. The returned ``attend(query [B, H, D], kv_layer, scale, window=0,
    softcap=0.0)``
    makes no host->device copy and reads no device value on the host, so it can be captured in a
    CUDA graph and replayed after new values are copied into ``batch``'s tensors.
    """
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_items = batch.block_tables.shape[0]
    device = batch.block_tables.device
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    # One query row per item: item i is tile i, its row is row i.
    arange = torch.arange(num_items + 1, dtype=torch.int32, device=device)  # [B+1]
    derived = TritonAttentionMetadata(
        query_start=arange,
        context_lens=batch.context_lens,
        tile_item=arange[:num_items],
        tile_q_start=torch.zeros(num_items, dtype=torch.int32, device=device),
        block_tables=batch.block_tables,
        num_tiles=num_items,
        block_q=_choose_block_q(1, group_pad),
    )
    max_context = batch.max_context
    if num_splits is None:
        num_splits = choose_num_splits(num_items * num_kv_heads, max_context, _num_sms(device))
    splits = max(1, min(num_splits, max_context))

    def attend(
        query: torch.Tensor,
        kv_layer: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        check_window(window)
        check_softcap(softcap)
        _check_shapes(query, kv_layer)
        if query.shape[0] != num_items:
            raise ValueError(f"query has {query.shape[0]} rows but the batch has {num_items}")
        return _launch(
            query,
            kv_layer,
            derived,
            scale,
            splits,
            _NO_SPLIT_SPAN,
            window,
            softcap,
            span_from_context=True,
        )

    return attend


def _check_shapes(query: torch.Tensor, kv_layer: torch.Tensor) -> None:
    _, num_heads, head_dim = query.shape
    num_kv_heads, kv_head_dim = kv_layer.shape[3], kv_layer.shape[4]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if kv_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != pool head_dim {kv_head_dim}")
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {_MAX_HEAD_DIM} is not supported")
    if kv_layer.stride(-1) != 1:
        raise ValueError("kv_layer must be contiguous in its last dimension")


def _block_n(head_dim: int) -> int:
    # Larger KV steps mean fewer interpreter iterations; on GPU keep the tile in registers.
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    return 64 if head_dim_pad <= 128 or _interpreting() else 32


def _launch(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    derived: TritonAttentionMetadata,
    scale: float,
    num_splits: int,
    kv_span: int,
    window: int,
    softcap: float,
    *,
    span_from_context: bool,
) -> torch.Tensor:
    """One attention launch (+ the split reduce); allocates only device tensors, so it is
    graph-safe whenever ``derived`` already lives on the device."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
    out = torch.empty_like(query)
    query = _last_dim_contiguous(query)
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    interpret = _interpreting()
    split = num_splits > 1

    fp32 = query.dtype == torch.float32
    if split:
        part_out = torch.empty(
            (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_splits, num_tokens, num_heads), dtype=torch.float32, device=query.device
        )
    else:
        part_out, part_lse = out, out  # unused placeholders (SPLIT is a compile-time branch)

    grid = (derived.num_tiles, num_kv_heads, num_splits)
    _unified_attention_kernel[grid](
        query,
        kv_layer,
        out,
        part_out,
        part_lse,
        derived.block_tables,
        derived.query_start,
        derived.context_lens,
        derived.tile_item,
        derived.tile_q_start,
        scale / softcap if softcap else scale * _LOG2E,
        softcap * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        derived.block_tables.stride(0),
        part_out.stride(0) if split else 0,
        part_out.stride(1) if split else 0,
        part_out.stride(2) if split else 0,
        part_lse.stride(0) if split else 0,
        part_lse.stride(1) if split else 0,
        kv_span,
        window,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_Q=derived.block_q,
        BLOCK_N=_block_n(head_dim),
        SPLIT=split,
        SPAN_FROM_CONTEXT=span_from_context and split,
        WINDOWED=window > 0,
        SOFTCAP=softcap > 0,
        # The interpreter's dot is wrong for bf16 operands, so it always computes in fp32.
        DOT_F32=fp32 or interpret,
        # fp32 models (tests, CPU parity) must not silently drop to TF32 on Ampere+.
        DOT_PRECISION="ieee" if fp32 or interpret else None,
        num_warps=4,
    )
    if split:
        _split_reduce_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            num_splits,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out

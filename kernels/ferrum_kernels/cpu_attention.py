"""Paged attention tuned for CPU: same contract as ``attention.paged_attention`` (bit-for-bit
the same math up to float rounding), but cheaper in the ways that matter on a CPU.
``CpuAttention`` is the CPU backend's attention: the KV write, then ``cpu_paged_attention``.

* The KV write (``write_kv_cpu``) copies each new row of K and of V into its slot with one
  native call a layer (``csrc/kv_store.cpp``), instead of two ``index_copy_`` calls over strided
  views of the qkv projection.

* The per-step bookkeeping (which items decode, which rows and blocks they use, masks) is built
  once per forward in a ``CpuAttentionPlan`` and reused by every layer.
* KV blocks are gathered with ``index_select`` of whole contiguous blocks into a grow-only
  ``Workspace`` (no fresh allocation, so no page faults, and no element-wise advanced indexing).
* Decodes go to a native kernel (``cpu_decode``) that reads K/V straight from the pool, when it
  can be built; otherwise they are sorted by context length and attended in small groups, so
  the padding of a group is a few blocks rather than "every item padded to the longest", and
  each group's gathered K/V (a few MB) is still in cache when the two matmuls read it.
* Prefill chunks go to another native kernel (``csrc/prefill_attention.cpp``) when it is built
  with AVX-512: all chunks of the step in one call, K/V read from the pool through each chunk's
  block table and packed once per (chunk, KV head), then groups of query rows scored over
  exactly the keys they see, a float32 softmax and PV, with scores in L1/L2 and outputs in
  registers (vdpbf16ps in bfloat16). It replaces about six ATen ops and two copies per 64
  queries, and runs 2-3x ahead of them on the W1 shapes.
* Without it, a prefill chunk that starts at position 0 attends over its own fresh K/V (no
  gather at all); scores are two batched GEMMs with a float32 softmax between them
  (transformers' "eager" numerics), queries in blocks so the causal upper triangle is mostly
  skipped (about 3x ahead of ``scaled_dot_product_attention``'s CPU flash kernel).

Sliding-window layers (``window > 0``: a query at p sees keys in (p - window, p]):
* decodes still go to the native decode kernel, over a per-position slot table of each item's
  last ``window`` positions (the pool viewed as blocks of one token, so the window may start
  mid-block), built once per forward and window;
* prefill chunks go to the native prefill kernel with the window where it takes them (the same
  conditions as above): each chunk packs only the keys from its first query's window start, and
  each group of query rows is scored from its first row's window start, so the work per row is
  O(window) however long the context. Elsewhere they take the torch chunk path, each block of
  queries scored over only the keys its rows can see, with a float32 softmax.
Without the native decode kernel, a windowed layer runs the torch reference
(``attention.paged_attention`` with the window).

Soft-capped layers (``softcap > 0``, Gemma 2) run the torch reference
(``attention.paged_attention`` with the window and the cap): neither native kernel applies a
tanh to the scores, and the reference's eager path already has transformers' op order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from ferrum_kernels import native
from ferrum_kernels.attention import AttentionMetadata, check_window, paged_attention, write_kv
from ferrum_kernels.cpu_decode import decode_attention

__all__ = [
    "NATIVE_PREFILL",
    "CpuAttention",
    "CpuAttentionPlan",
    "Workspace",
    "cpu_paged_attention",
    "cpu_windowed_attention",
    "write_kv_cpu",
]

# Decodes per group: small enough that a group's gathered K/V stays in cache, large enough that
# the per-group overhead (a handful of ops) is amortised.
DECODE_GROUP = 8
# Query rows per block of a prefill chunk (see _chunk).
Q_BLOCK = 64
# The native prefill kernel packs each chunk's keys in tiles of this many positions.
_KEY_TILE = 16
# The native prefill kernel takes head dims of whole 16-lane vectors, in these dtypes.
_PREFILL_DIM_MULTIPLE = 16
_PREFILL_DTYPES = (torch.float32, torch.bfloat16)
# Whether prefill chunks may use the native kernel (tests and benchmarks switch it off to
# compare with the torch path).
NATIVE_PREFILL = True


class Workspace:
    """Grow-only scratch memory for gathered K/V, reused by every layer and step."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def take(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat [numel] tensor; `slot` separates buffers that are alive at the same time."""
        key = (dtype, slot)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel or buffer.device != device:
            # Grow by half again so a slowly rising context length does not reallocate often.
            buffer = torch.empty(max(numel, numel * 3 // 2), dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel]


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    rows: torch.Tensor  # [n] int64: query rows of the group's items
    block_ids: torch.Tensor  # [n * nb] int64: each item's first nb blocks (padding -> block 0)
    num_items: int
    num_blocks: int  # nb
    pad_mask: torch.Tensor | None  # [n, 1, 1, nb * BS] bool, True = padding (masked out)


@dataclass(frozen=True, slots=True)
class _Chunk:
    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor | None  # [nb] int64, None when the chunk is its whole context


# No slots: decode_groups is a cached_property, which needs the instance __dict__.
@dataclass(frozen=True)
class CpuAttentionPlan:
    """Per-forward attention bookkeeping, shared by every layer."""

    num_tokens: int
    meta: AttentionMetadata
    block_size: int
    decode_group_size: int  # decodes attended together by the torch decode path
    chunks: tuple[_Chunk, ...]
    # All decodes at once, for the native kernel (which needs neither groups nor padding).
    decode_rows: torch.Tensor  # [N] int64
    decode_tables: torch.Tensor  # [N, W] int64
    decode_lens: torch.Tensor  # [N] int64
    # All chunks at once, for the native prefill kernel.
    chunk_info: torch.Tensor  # [C, 3] int64 rows (start, end, context_len)
    chunk_tables: torch.Tensor  # [C, W] int64 block tables of the chunks' items
    chunk_key_slots: int  # sum of the context lengths rounded up to _KEY_TILE (see key_slots)
    # Per sliding window: the decodes' (slot table [N, W], lengths [N]) over their last
    # `window` positions, built by the first windowed layer of the forward.
    window_decodes: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=dict, compare=False
    )
    # Every row is a decode, item i at row i (a decode-only step): the decode kernel's
    # [N, H, D] is then the layer's output as it is, with no copy into a fresh one.
    decodes_are_rows: bool = False

    @classmethod
    def build(
        cls,
        meta: AttentionMetadata,
        block_size: int,
        group: int = DECODE_GROUP,
    ) -> CpuAttentionPlan:
        """group: how many decodes the torch decode path attends together."""
        qs, cl = meta.query_start, meta.context_lens
        tables = meta.block_tables  # [B, W] int64 (host tensor on CPU)
        chunks: list[_Chunk] = []
        for i in meta.prefill_items:
            start, end, ctx = qs[i], qs[i + 1], cl[i]
            fresh = ctx == end - start
            ids = None if fresh else tables[i, : math.ceil(ctx / block_size)]
            chunks.append(_Chunk(start, end, ctx, ids))
        prefills = torch.tensor(meta.prefill_items, dtype=torch.int64)
        decode_rows = meta.decode_rows.contiguous()
        decodes_are_rows = not chunks and torch.equal(
            decode_rows, torch.arange(meta.num_tokens, dtype=decode_rows.dtype)
        )
        return cls(
            meta.num_tokens,
            meta,
            block_size,
            group,
            tuple(chunks),
            decode_rows,
            meta.decode_block_tables.contiguous(),
            meta.decode_context_lens.contiguous(),
            torch.tensor([(c.start, c.end, c.context_len) for c in chunks], dtype=torch.int64)
            .view(-1, 3)
            .contiguous(),
            tables[prefills.to(tables.device)].contiguous(),
            sum(-(-c.context_len // _KEY_TILE) * _KEY_TILE for c in chunks),
            decodes_are_rows=decodes_are_rows,
        )

    def key_slots(self, window: int) -> int:
        """Key positions the native prefill kernel packs for all chunks (its scratch is this
        times Hkv * D * 2): each chunk's context rounded up to _KEY_TILE, or with a window, the
        keys from its first query's window start (rounded down to _KEY_TILE) to its end."""
        if not window:
            return self.chunk_key_slots
        total = 0
        for c in self.chunks:
            first = max(0, c.context_len - (c.end - c.start) - window + 1) // _KEY_TILE * _KEY_TILE
            total += -(-(c.context_len - first) // _KEY_TILE) * _KEY_TILE
        return total

    def windowed_decodes(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [N, W] int64, lens [N] int64): each decode's last ``window`` positions as flat
        pool slots, in order, for the decode kernel over a pool of one-token blocks."""
        cached = self.window_decodes.get(window)
        if cached is None:
            lens = self.decode_lens  # [N] int64, this step's token included
            first = (lens - window).clamp_(min=0)  # [N] first visible position
            width = max(1, min(window, self.meta.max_decode_context))
            # Positions past an item's length repeat its last one: in range, never read.
            pos = torch.minimum(
                first[:, None] + torch.arange(width, device=lens.device)[None, :],
                (lens - 1)[:, None],
            )  # [N, W]
            blocks = torch.gather(self.decode_tables, 1, pos // self.block_size)
            slots = (blocks * self.block_size + pos % self.block_size).contiguous()
            cached = (slots, (lens - first).contiguous())
            self.window_decodes[window] = cached
        return cached

    @functools.cached_property
    def decode_groups(self) -> tuple[_DecodeGroup, ...]:
        """The torch decode path's groups: decodes sorted by context length, padded per group.
        Built on first use, so steps served by the native decode kernel never pay for it."""
        meta, block_size, cl = self.meta, self.block_size, self.meta.context_lens
        decodes = sorted(meta.decode_items, key=lambda i: cl[i])
        groups: list[_DecodeGroup] = []
        for begin in range(0, len(decodes), self.decode_group_size):
            items = decodes[begin : begin + self.decode_group_size]
            lens = [cl[i] for i in items]
            nb = math.ceil(max(lens) / block_size)
            index = torch.tensor(items, dtype=torch.int64)
            span = nb * block_size
            pad_mask = None
            if min(lens) < span:
                lens_t = torch.tensor(lens, dtype=torch.int64)
                pad_mask = (torch.arange(span)[None, :] >= lens_t[:, None])[:, None, None, :]
            groups.append(
                _DecodeGroup(
                    rows=torch.tensor([meta.query_start[i] for i in items], dtype=torch.int64),
                    block_ids=meta.block_tables[index, :nb].reshape(-1),
                    num_items=len(items),
                    num_blocks=nb,
                    pad_mask=pad_mask,
                )
            )
        return tuple(groups)


def _gather(pool: torch.Tensor, block_ids: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """pool [NB, row] (one K or V plane), block_ids [m] -> [m, row] whole-block copies, written
    into flat [m * row]."""
    out = flat.view(block_ids.numel(), pool.shape[1])
    return torch.index_select(pool, 0, block_ids, out=out)


def _softmax_rows(scores: torch.Tensor, scale: float, hide: torch.Tensor | None) -> torch.Tensor:
    """scale, mask (True = hidden) and softmax over the last dim, in float32 -> float32."""
    scores = scores.float().mul_(scale)
    if hide is not None:
        scores.masked_fill_(hide, float("-inf"))
    return torch.softmax(scores, dim=-1)


def _decode_group(
    q: torch.Tensor,  # [n, Hkv, G, D]
    k: torch.Tensor,  # [n, S, Hkv, D] gathered blocks (contiguous)
    v: torch.Tensor,  # [n, S, Hkv, D]
    hide: torch.Tensor | None,  # [n, 1, 1, S] True = padding
    scale: float,
) -> torch.Tensor:
    """One group of decodes -> [n, Hkv, G, D]."""
    num_kv_heads = q.shape[1]
    # One GEMM batch per KV head: k[:, :, h] is [n, S, D] with row stride Hkv*D, which BLAS
    # takes as is; a single 4-D matmul would first copy K into [n, Hkv, D, S].
    scores = torch.stack(
        [torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)) for h in range(num_kv_heads)], dim=1
    )  # [n, Hkv, G, S]
    probs = _softmax_rows(scores, scale, hide).to(q.dtype)
    return torch.stack(
        [torch.bmm(probs[:, h], v[:, :, h]) for h in range(num_kv_heads)], dim=1
    )  # [n, Hkv, G, D]


def _chunk(
    q: torch.Tensor,  # [n, Hkv, G, D]
    k: torch.Tensor,  # [ctx, Hkv, D]
    v: torch.Tensor,  # [ctx, Hkv, D]
    scale: float,
    out: torch.Tensor,  # [n, H, D] written in place
) -> None:
    """Causal attention of a chunk's n queries (the last n of ctx positions) over ctx keys.

    Queries are taken in blocks of Q_BLOCK: block b only needs keys up to its own last position,
    so the causal half of the score matrix is mostly never computed (a dense masked GEMM would
    do twice the work, and SDPA's CPU flash kernel is slower still for these shapes).
    """
    n, num_kv_heads, group, head_dim = q.shape
    ctx = k.shape[0]
    offset = ctx - n  # absolute position of query 0
    kt = k.permute(1, 2, 0)  # [Hkv, D, ctx]
    vt = v.transpose(0, 1)  # [Hkv, ctx, D]
    # One copy into head-major order, with the softmax scale folded in (exact for power-of-two
    # scales such as 1/8 at head_dim 64), instead of a permute and a scaling pass per block.
    qh = q.new_empty((num_kv_heads, group, n, head_dim))  # [Hkv, G, n, D]
    torch.mul(q.permute(1, 2, 0, 3), scale, out=qh)
    oh = torch.empty_like(qh)  # [Hkv, G, n, D]
    fused = native.load() if q.dtype in (torch.float32, torch.bfloat16) else None
    for s0 in range(0, n, Q_BLOCK):
        s1 = min(n, s0 + Q_BLOCK)
        m, visible = s1 - s0, offset + s1  # keys [0, visible) can be seen by this block
        qb = qh[:, :, s0:s1].reshape(num_kv_heads, group * m, head_dim)
        scores = torch.bmm(qb, kt[:, :, :visible])  # [Hkv, G*m, visible]
        if fused is not None:
            # One pass: float32 softmax of each row's visible keys, rounded back in place.
            fused.causal_softmax_(scores.view(-1, visible), m, visible - m)
            probs = scores
        else:
            wide = scores.view(num_kv_heads, group, m, visible).float()  # no-op in float32
            # Only the block's own diagonal square is partly hidden; keys before it are seen.
            wide[..., visible - m :].masked_fill_(_upper(m), float("-inf"))
            probs = torch.softmax(wide, dim=-1).to(q.dtype).view(num_kv_heads, group * m, visible)
        oh[:, :, s0:s1] = torch.bmm(probs, vt[:, :visible]).view(num_kv_heads, group, m, -1)
    out.copy_(oh.permute(2, 0, 1, 3).reshape(n, num_kv_heads * group, head_dim))


def _chunk_windowed(
    q: torch.Tensor,  # [n, Hkv, G, D]
    k: torch.Tensor,  # [ctx - base, Hkv, D]: the keys at positions [base, ctx)
    v: torch.Tensor,  # [ctx - base, Hkv, D]
    scale: float,
    window: int,
    base: int,  # absolute position of k[0]; no query's window may start before it
    out: torch.Tensor,  # [n, H, D] written in place
) -> None:
    """``_chunk`` for a sliding-window layer: query p sees keys in (p - window, p]. Each block
    of queries is scored over the keys from its first row's window start to its last row."""
    n, num_kv_heads, group, head_dim = q.shape
    offset = base + k.shape[0] - n  # absolute position of query 0
    kt = k.permute(1, 2, 0)  # [Hkv, D, ctx]
    vt = v.transpose(0, 1)  # [Hkv, ctx, D]
    qh = q.new_empty((num_kv_heads, group, n, head_dim))  # [Hkv, G, n, D]
    torch.mul(q.permute(1, 2, 0, 3), scale, out=qh)
    oh = torch.empty_like(qh)
    for s0 in range(0, n, Q_BLOCK):
        s1 = min(n, s0 + Q_BLOCK)
        m, hi = s1 - s0, offset + s1  # absolute positions from here on
        lo = max(base, offset + s0 - window + 1)
        qb = qh[:, :, s0:s1].reshape(num_kv_heads, group * m, head_dim)
        keys = kt[:, :, lo - base : hi - base]  # [Hkv, D, hi - lo]
        scores = torch.bmm(qb, keys).view(num_kv_heads, group, m, hi - lo).float()
        q_pos = torch.arange(offset + s0, hi)[:, None]  # [m, 1]
        k_pos = torch.arange(lo, hi)[None, :]  # [1, hi - lo]
        scores.masked_fill_((k_pos > q_pos) | (k_pos <= q_pos - window), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(num_kv_heads, group * m, hi - lo)
        values = vt[:, lo - base : hi - base]  # [Hkv, hi - lo, D]
        oh[:, :, s0:s1] = torch.bmm(probs, values).view(num_kv_heads, group, m, -1)
    out.copy_(oh.permute(2, 0, 1, 3).reshape(n, num_kv_heads * group, head_dim))


_UPPER: dict[int, torch.Tensor] = {}


def _upper(m: int) -> torch.Tensor:
    """[m, m] bool, True strictly above the diagonal (future positions); cached per size."""
    mask = _UPPER.get(m)
    if mask is None:
        mask = torch.ones(m, m, dtype=torch.bool).triu_(1)
        _UPPER[m] = mask
    return mask


def cpu_paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D] this step's keys (already written to the pool)
    value: torch.Tensor,  # [T, Hkv, D]
    kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
    plan: CpuAttentionPlan,
    scale: float,
    workspace: Workspace,
) -> torch.Tensor:
    """Causal attention of every item's query rows over its paged history -> [T, H, D]."""
    if query.shape[0] != plan.num_tokens:
        raise ValueError(
            f"query has {query.shape[0]} rows but the plan describes {plan.num_tokens}"
        )
    decoded = None
    if plan.decode_rows.numel():
        decoded = decode_attention(
            query, kv_layer, plan.decode_tables, plan.decode_lens, plan.decode_rows, scale
        )  # [N, H, D] or None
        if decoded is not None and plan.decodes_are_rows:
            return decoded
    out = query.new_empty(query.shape)  # [T, H, D] contiguous, whatever query's strides
    if decoded is not None:
        out.index_copy_(0, plan.decode_rows, decoded)
    elif plan.decode_rows.numel():
        _torch_decodes(query, kv_layer, plan, scale, workspace, out)
    if plan.chunks and not _native_prefill(query, kv_layer, out, plan, scale, workspace):
        _torch_chunks(query, key, value, kv_layer, plan, scale, workspace, out)
    return out


@dataclass(frozen=True, slots=True)
class _PoolView:
    """The torch paths' view of one layer's pool and the query's head layout."""

    num_heads: int
    head_dim: int
    block_size: int
    num_kv_heads: int
    group: int  # query heads per KV head
    k_pool: torch.Tensor  # [NB, BS*Hkv*D]: K plane as whole-block rows, a view of the pool
    v_pool: torch.Tensor  # [NB, BS*Hkv*D]
    row: int  # BS*Hkv*D

    @classmethod
    def of(cls, query: torch.Tensor, kv_layer: torch.Tensor) -> _PoolView:
        """query [T, H, D], kv_layer [2, NB, BS, Hkv, D]."""
        _, num_heads, head_dim = query.shape
        _, num_blocks, block_size, num_kv_heads, _ = kv_layer.shape
        k_pool, v_pool = kv_layer[0].view(num_blocks, -1), kv_layer[1].view(num_blocks, -1)
        return cls(
            num_heads,
            head_dim,
            block_size,
            num_kv_heads,
            num_heads // num_kv_heads,
            k_pool,
            v_pool,
            k_pool.shape[1],
        )

    def gather(
        self, block_ids: torch.Tensor, workspace: Workspace
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids [m] -> the blocks' K and V as [m, BS*Hkv*D] copies in the workspace."""
        m, dtype, device = block_ids.numel(), self.k_pool.dtype, self.k_pool.device
        k = _gather(self.k_pool, block_ids, workspace.take(0, m * self.row, dtype, device))
        v = _gather(self.v_pool, block_ids, workspace.take(1, m * self.row, dtype, device))
        return k, v


def _torch_decodes(
    query: torch.Tensor,  # [T, H, D]
    kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
    plan: CpuAttentionPlan,
    scale: float,
    workspace: Workspace,
    out: torch.Tensor,  # [T, H, D], the decode rows written in place
) -> None:
    """The decode groups with torch ops (when the native decode kernel is unavailable)."""
    pv = _PoolView.of(query, kv_layer)
    for g in plan.decode_groups:
        n, nb = g.num_items, g.num_blocks
        k, v = pv.gather(g.block_ids, workspace)  # [n * nb, BS*Hkv*D] each
        span = nb * pv.block_size
        q = query.index_select(0, g.rows).view(n, pv.num_kv_heads, pv.group, pv.head_dim)
        o = _decode_group(
            q,
            k.view(n, span, pv.num_kv_heads, pv.head_dim),
            v.view(n, span, pv.num_kv_heads, pv.head_dim),
            g.pad_mask,
            scale,
        )  # [n, Hkv, G, D]
        out.index_copy_(0, g.rows, o.reshape(n, pv.num_heads, pv.head_dim))


def _torch_chunks(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
    plan: CpuAttentionPlan,
    scale: float,
    workspace: Workspace,
    out: torch.Tensor,  # [T, H, D], the chunk rows written in place
    window: int = 0,
) -> None:
    """The prefill chunks with torch ops (when the native prefill kernel cannot take them)."""
    pv = _PoolView.of(query, kv_layer)
    for c in plan.chunks:
        ctx = c.context_len
        # A windowed chunk needs no block before the one holding its first query's first key.
        skip = 0
        if window and c.block_ids is not None:
            skip = max(0, ctx - (c.end - c.start) - window + 1) // pv.block_size
        base = skip * pv.block_size  # absolute position of the first key gathered
        if c.block_ids is None:
            k = key[c.start : c.end]  # [n, Hkv, D]: the chunk is the whole context
            v = value[c.start : c.end]
        else:
            kb, vb = pv.gather(c.block_ids[skip:], workspace)  # [m, BS*Hkv*D] each
            k = kb.view(-1, pv.num_kv_heads, pv.head_dim)[: ctx - base]  # [ctx - base, Hkv, D]
            v = vb.view(-1, pv.num_kv_heads, pv.head_dim)[: ctx - base]
        q = query[c.start : c.end].view(
            -1, pv.num_kv_heads, pv.group, pv.head_dim
        )  # [n, Hkv, G, D]
        if window:
            _chunk_windowed(q, k, v, scale, window, base, out[c.start : c.end])
        else:
            _chunk(q, k, v, scale, out[c.start : c.end])


def cpu_windowed_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D] this step's keys (already written to the pool)
    value: torch.Tensor,  # [T, Hkv, D]
    kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
    plan: CpuAttentionPlan,
    scale: float,
    window: int,
    workspace: Workspace,
) -> torch.Tensor | None:
    """Sliding-window attention (query p sees keys in (p - window, p]) -> [T, H, D], or None
    when the native decode kernel cannot take the step's decodes (the caller then runs the
    reference). Chunks go to the native prefill kernel where it takes them, else to the torch
    chunk path."""
    decoded = None
    if plan.decode_rows.numel():
        slots, lens = plan.windowed_decodes(window)
        # The pool as blocks of one token: the slot table then starts each item's window at
        # any position, not only at a block edge.
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
        tokens = kv_layer.view(2, num_blocks * block_size, 1, num_kv_heads, head_dim)
        decoded = decode_attention(query, tokens, slots, lens, plan.decode_rows, scale)
        if decoded is None:
            return None
        if plan.decodes_are_rows:
            return decoded
    out = query.new_empty(query.shape)  # [T, H, D]
    if decoded is not None:
        out.index_copy_(0, plan.decode_rows, decoded)
    if plan.chunks and not _native_prefill(query, kv_layer, out, plan, scale, workspace, window):
        _torch_chunks(query, key, value, kv_layer, plan, scale, workspace, out, window)
    return out


def native_prefill_module(
    dtype: torch.dtype, device: torch.device, kv_layer: torch.Tensor, plan: CpuAttentionPlan
) -> Any | None:
    """The native module where its prefill kernel serves queries of `dtype` on `device` over
    this pool (``kv_layer`` [2, NB, BS, Hkv, D]) and plan, else None (the torch path serves
    them)."""
    head_dim = kv_layer.shape[-1]
    if (
        not NATIVE_PREFILL
        or device.type != "cpu"
        or dtype not in _PREFILL_DTYPES
        or kv_layer.dtype != dtype
        or head_dim % _PREFILL_DIM_MULTIPLE != 0
        or not kv_layer.is_contiguous()
        or plan.chunk_tables.device.type != "cpu"
    ):
        return None
    module = native.load()
    # Where the kernel is not vectorised (bfloat16 without AVX-512, anything without AVX2) its
    # portable loops lose to the torch path's BLAS calls.
    if module is None or not module.prefill_attention_vectorized(dtype == torch.bfloat16):
        return None
    return module


def _native_prefill(
    query: torch.Tensor,  # [T, H, D]
    kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D] holding every chunk's K/V
    out: torch.Tensor,  # [T, H, D] contiguous, the chunks' rows written in place
    plan: CpuAttentionPlan,
    scale: float,
    workspace: Workspace,
    window: int = 0,
) -> bool:
    """All of the plan's chunks with the native kernel (``window`` > 0: a query at p sees keys
    in (p - window, p]); False (nothing written) when it cannot take this input and the caller
    must use the torch path."""
    _, _, _, num_kv_heads, head_dim = kv_layer.shape
    module = native_prefill_module(query.dtype, query.device, kv_layer, plan)
    if module is None:
        return False
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()  # the kernel takes a row stride, not arbitrary strides
    # Each chunk's keys and values, packed once per (chunk, KV head) for the inner loops.
    numel = plan.key_slots(window) * num_kv_heads * head_dim * 2
    scratch = workspace.take(2, numel, query.dtype, query.device)
    module.prefill_attention(
        query,
        kv_layer[0],
        kv_layer[1],
        out,
        plan.chunk_info,
        plan.chunk_tables,
        scratch,
        kv_layer.shape[2],
        num_kv_heads,
        scale,
        window,
    )
    return True


def write_kv_cpu(
    kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """``attention.write_kv``'s contract: the same pool afterwards, bit for bit (a copy). The
    native store takes a contiguous CPU pool, K/V already in its dtype with contiguous rows (as
    the views of the qkv projection are), and checks every slot before it writes; anything else
    goes to ``write_kv``."""
    module = native.load()
    if (
        module is None
        or kv_layer.device.type != "cpu"
        or not kv_layer.is_contiguous()
        or key.dtype != kv_layer.dtype
        or value.dtype != kv_layer.dtype
        or key.device != kv_layer.device
        or value.device != kv_layer.device
        or slot_mapping.device != kv_layer.device
        or slot_mapping.dtype != torch.int64
        or key.dim() != 3
        or value.dim() != 3
        or key.stride(2) != 1
        or key.stride(1) != key.shape[2]
        or value.stride(2) != 1
        or value.stride(1) != value.shape[2]
    ):
        write_kv(kv_layer, key, value, slot_mapping)
        return
    module.store_kv_(kv_layer, key, value, slot_mapping)


class CpuAttention:
    """The CPU backend's attention, ``(query, key, value, kv_layer, meta, scale, window=0,
    softcap=0.0) -> [T, H, D]``: writes this step's K/V into the pool, then runs
    ``cpu_paged_attention`` (``cpu_windowed_attention`` for a sliding-window layer, the torch
    reference for a soft-capped one).

    It owns what that needs beyond its arguments: a ``Workspace`` (grown once, reused by every
    layer and step) and the current forward's ``CpuAttentionPlan``. Every layer of a forward
    passes the same ``AttentionMetadata`` object, so the plan is built by the first layer and
    found again by identity by the others: once per forward, with no hook for the model to call.
    (The Triton metadata cache keys on identity the same way; the plan holds its metadata, so
    the id cannot be reused while it is cached. ``AttentionMetadata`` is slotted and frozen, so
    it cannot carry the plan itself.) One instance serves one engine thread at a time.
    """

    def __init__(self) -> None:
        self.workspace = Workspace()
        self._plan: CpuAttentionPlan | None = None

    def plan(self, meta: AttentionMetadata, block_size: int) -> CpuAttentionPlan:
        """The plan of ``meta`` over a pool of ``block_size`` blocks, built on first use."""
        plan = self._plan
        if plan is None or plan.meta is not meta or plan.block_size != block_size:
            plan = CpuAttentionPlan.build(meta, block_size)
            self._plan = plan
        return plan

    def __call__(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        # Written before attending so each new token sees its own K/V.
        write_kv_cpu(kv_layer, key, value, meta.slot_mapping)
        # A pool elsewhere, or a soft-capped layer (no native kernel caps its scores): the
        # reference serves it.
        if kv_layer.device.type != "cpu" or softcap:
            return paged_attention(query, kv_layer, meta, scale, window, softcap)
        plan = self.plan(meta, kv_layer.shape[2])
        if window:
            check_window(window)
            out = cpu_windowed_attention(
                query, key, value, kv_layer, plan, scale, window, self.workspace
            )
            # Without the native decode kernel the reference serves the windowed layer.
            return out if out is not None else paged_attention(query, kv_layer, meta, scale, window)
        return cpu_paged_attention(query, key, value, kv_layer, plan, scale, self.workspace)

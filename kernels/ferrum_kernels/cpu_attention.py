"""Paged attention tuned for CPU: same contract as ``attention.paged_attention`` (bit-for-bit
the same math up to float rounding), but cheaper in the ways that matter on a CPU.

* The per-step bookkeeping (which items decode, which rows and blocks they use, masks) is built
  once per forward in a ``CpuAttentionPlan`` and reused by every layer.
* KV blocks are gathered with ``index_select`` of whole contiguous blocks into a grow-only
  ``Workspace`` (no fresh allocation, so no page faults, and no element-wise advanced indexing).
* Decodes go to a native kernel (``cpu_decode``) that reads K/V straight from the pool, when it
  can be built; otherwise they are sorted by context length and attended in small groups, so
  the padding of a group is a few blocks rather than "every item padded to the longest", and
  each group's gathered K/V (a few MB) is still in cache when the two matmuls read it.
* A prefill chunk that starts at position 0 attends over its own fresh K/V (no gather at all).
* Scores are two batched GEMMs with a float32 softmax between them (transformers' "eager"
  numerics); prefill queries go in blocks so the causal upper triangle is mostly skipped. On CPU
  this runs about 3x ahead of ``scaled_dot_product_attention``'s flash kernel for these shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ferrum_kernels import native
from ferrum_kernels.attention import AttentionMetadata
from ferrum_kernels.cpu_decode import decode_attention

__all__ = ["CpuAttentionPlan", "Workspace", "cpu_paged_attention"]

# Decodes per group: small enough that a group's gathered K/V stays in cache, large enough that
# the per-group overhead (a handful of ops) is amortised.
DECODE_GROUP = 8
# Query rows per block of a prefill chunk (see _chunk).
Q_BLOCK = 64


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


@dataclass(frozen=True, slots=True)
class CpuAttentionPlan:
    """Per-forward attention bookkeeping, shared by every layer."""

    num_tokens: int
    decode_groups: tuple[_DecodeGroup, ...]
    chunks: tuple[_Chunk, ...]
    # All decodes at once, for the native kernel (which needs neither groups nor padding).
    decode_rows: torch.Tensor  # [N] int64
    decode_tables: torch.Tensor  # [N, W] int64
    decode_lens: torch.Tensor  # [N] int64

    @classmethod
    def build(
        cls,
        meta: AttentionMetadata,
        block_size: int,
        group: int = DECODE_GROUP,
    ) -> CpuAttentionPlan:
        """group: how many decodes are attended together."""
        qs, cl = meta.query_start, meta.context_lens
        tables = meta.block_tables  # [B, W] int64 (host tensor on CPU)
        decodes = sorted(meta.decode_items, key=lambda i: cl[i])
        groups: list[_DecodeGroup] = []
        for begin in range(0, len(decodes), group):
            items = decodes[begin : begin + group]
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
                    rows=torch.tensor([qs[i] for i in items], dtype=torch.int64),
                    block_ids=tables[index, :nb].reshape(-1),
                    num_items=len(items),
                    num_blocks=nb,
                    pad_mask=pad_mask,
                )
            )
        chunks: list[_Chunk] = []
        for i in meta.prefill_items:
            start, end, ctx = qs[i], qs[i + 1], cl[i]
            fresh = ctx == end - start
            ids = None if fresh else tables[i, : math.ceil(ctx / block_size)]
            chunks.append(_Chunk(start, end, ctx, ids))
        return cls(
            meta.num_tokens,
            tuple(groups),
            tuple(chunks),
            meta.decode_rows.contiguous(),
            meta.decode_block_tables.contiguous(),
            meta.decode_context_lens.contiguous(),
        )


def _gather(pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """pool [NB, row] (one K or V plane), block_ids [m] -> out [m, row] (whole-block copies)."""
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
    num_tokens, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_layer.shape
    group = num_heads // num_kv_heads
    row = block_size * num_kv_heads * head_dim
    k_pool = kv_layer[0].view(num_blocks, row)  # [NB, BS*Hkv*D], a view of the pool
    v_pool = kv_layer[1].view(num_blocks, row)
    dtype, device = kv_layer.dtype, kv_layer.device
    out = torch.empty_like(query)
    native = None
    if plan.decode_groups:
        native = decode_attention(
            query, kv_layer, plan.decode_tables, plan.decode_lens, plan.decode_rows, scale
        )  # [N, H, D] or None
    if native is not None:
        out.index_copy_(0, plan.decode_rows, native)
    for g in plan.decode_groups if native is None else ():
        n, nb = g.num_items, g.num_blocks
        m = n * nb
        k = _gather(k_pool, g.block_ids, workspace.take(0, m * row, dtype, device).view(m, row))
        v = _gather(v_pool, g.block_ids, workspace.take(1, m * row, dtype, device).view(m, row))
        span = nb * block_size
        q = query.index_select(0, g.rows).view(n, num_kv_heads, group, head_dim)
        o = _decode_group(
            q,
            k.view(n, span, num_kv_heads, head_dim),
            v.view(n, span, num_kv_heads, head_dim),
            g.pad_mask,
            scale,
        )  # [n, Hkv, G, D]
        out.index_copy_(0, g.rows, o.reshape(n, num_heads, head_dim))
    for c in plan.chunks:
        ctx = c.context_len
        if c.block_ids is None:
            k = key[c.start : c.end]  # [n, Hkv, D]: the chunk is the whole context
            v = value[c.start : c.end]
        else:
            m = c.block_ids.numel()
            kb = _gather(
                k_pool, c.block_ids, workspace.take(0, m * row, dtype, device).view(m, row)
            )
            vb = _gather(
                v_pool, c.block_ids, workspace.take(1, m * row, dtype, device).view(m, row)
            )
            k = kb.view(m * block_size, num_kv_heads, head_dim)[:ctx]  # [ctx, Hkv, D]
            v = vb.view(m * block_size, num_kv_heads, head_dim)[:ctx]
        q = query[c.start : c.end].view(-1, num_kv_heads, group, head_dim)  # [n, Hkv, G, D]
        _chunk(q, k, v, scale, out[c.start : c.end])
    if num_tokens != plan.num_tokens:
        raise ValueError(f"query has {num_tokens} rows but the plan describes {plan.num_tokens}")
    return out

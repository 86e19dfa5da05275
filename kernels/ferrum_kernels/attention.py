"""Paged attention over a block-structured KV pool: the torch reference path (CPU and CUDA).

Pool layout for one layer: ``kv_layer [2, num_blocks, block_size, num_kv_heads, head_dim]`` with
index 0 holding K and 1 holding V. Token position ``p`` of an item lives in block
``block_tables[i, p // block_size]`` at offset ``p % block_size``.

A unified batch flattens every item's query rows into one token dimension ``T``. Single-token
items (decodes) are gathered and attended in one batched call; multi-token items (prefill chunks,
possibly on top of cached history) are attended one at a time with an offset causal mask.

Sliding-window layers pass ``window`` (0 = global): a query at absolute position ``p`` then sees
only the keys at positions ``(p - window, p]``, i.e. the last ``window`` keys with its own
included (transformers' ``kv_idx > q_idx - sliding_window``). The window is a per-call argument
rather than a field of the metadata, because every layer of a forward shares one metadata
object while the window is a property of the layer (Gemma alternates local and global layers).

Layers with attention logit soft-capping (Gemma 2) pass ``softcap`` (0 = off): each scaled
score s becomes ``softcap * tanh(s / softcap)`` before the mask and the softmax, in
transformers' op order. SDPA has no soft-cap, so those calls score with two matmuls and a
float32 softmax (transformers' "eager" attention, the only one it runs Gemma 2 with).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from ferrum_kernels.transfer import ints_to_device

__all__ = [
    "AttentionMetadata",
    "DecodeAttentionFn",
    "DecodeBatch",
    "OutputRows",
    "check_softcap",
    "check_window",
    "decode_attention_reference",
    "paged_attention",
    "reference_decode_attention",
    "write_kv",
]


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """How the flat token dimension T of a unified batch splits into B items.

    The four leading fields are the contract with the engine; the ``init=False`` fields are
    derived once in ``__post_init__`` so every layer of a forward pass reuses them.
    """

    query_start: list[int]  # host, len B+1, cumulative q-token offsets into T
    context_lens: list[int]  # host, len B: KV length per item AFTER this step's tokens are written
    block_tables: torch.Tensor  # [B, max_blocks] int64 on the model device, unused entries 0
    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * block_size + offset) per new token

    # Items with exactly one query row, attended together in one batched call.
    decode_items: tuple[int, ...] = field(init=False)
    # Items with more than one query row, attended one by one.
    prefill_items: tuple[int, ...] = field(init=False)
    # [D] int64 on the model device: query row of each decode item.
    decode_rows: torch.Tensor = field(init=False)
    # [D] int64 on the model device: KV length of each decode item.
    decode_context_lens: torch.Tensor = field(init=False)
    # [D, max_blocks] int64 on the model device: block-table rows of the decode items.
    decode_block_tables: torch.Tensor = field(init=False)
    max_decode_context: int = field(init=False)
    max_context: int = field(init=False)

    def __post_init__(self) -> None:
        qs, cl = self.query_start, self.context_lens
        num_items = len(cl)
        if len(qs) != num_items + 1:
            raise ValueError(
                f"query_start must have len(context_lens) + 1 = {num_items + 1} entries, "
                f"got {len(qs)}"
            )
        if qs and qs[0] != 0:
            raise ValueError(f"query_start must begin at 0, got {qs[0]}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != num_items:
            raise ValueError(
                f"block_tables must be [B={num_items}, max_blocks], "
                f"got {tuple(self.block_tables.shape)}"
            )
        total = qs[-1] if qs else 0
        if self.slot_mapping.shape != (total,):
            raise ValueError(
                f"slot_mapping must be [T={total}], got {tuple(self.slot_mapping.shape)}"
            )
        decodes: list[int] = []
        prefills: list[int] = []
        for i in range(num_items):
            n = qs[i + 1] - qs[i]
            if n < 1:
                raise ValueError(f"item {i} has {n} query rows; every item needs at least one")
            if cl[i] < n:
                raise ValueError(
                    f"item {i}: context_len {cl[i]} is smaller than its {n} new tokens"
                )
            (decodes if n == 1 else prefills).append(i)

        # One copy that never waits for the device (`to_device`): rows, lengths, item indices.
        d = len(decodes)
        per_decode = ints_to_device(
            [*(qs[i] for i in decodes), *(cl[i] for i in decodes), *decodes],
            self.block_tables.device,
        )
        set_ = object.__setattr__  # frozen dataclass: derived fields are set once, here
        set_(self, "decode_items", tuple(decodes))
        set_(self, "prefill_items", tuple(prefills))
        set_(self, "decode_rows", per_decode[:d])
        set_(self, "decode_context_lens", per_decode[d : 2 * d])
        set_(self, "decode_block_tables", self.block_tables[per_decode[2 * d :]])
        set_(self, "max_decode_context", max((cl[i] for i in decodes), default=0))
        set_(self, "max_context", max(cl, default=0))

    @classmethod
    def build(
        cls,
        query_start: list[int],
        context_lens: list[int],
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> AttentionMetadata:
        """Same as the constructor; kept as the named entry point the engine calls."""
        return cls(
            query_start=list(query_start),
            context_lens=list(context_lens),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
        )

    @property
    def num_items(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1] if self.query_start else 0


@dataclass(frozen=True, slots=True)
class OutputRows:
    """The query rows of a forward whose final hidden states are used (the rows that go through
    the LM head): each item's last ``counts[i]`` rows, in item order.

    A model runs its last layer past the KV write only for these rows: no other row's output
    after that write reaches anything (a later step reads the K/V, never the hidden states).
    ``meta`` describes the attention of these rows alone: every item with at least one of them,
    its context as before, its queries only its kept trailing rows (so their positions are
    unchanged). It is None when no row is kept.
    """

    rows: torch.Tensor  # [R] int64 on the model device: flat rows into T
    meta: AttentionMetadata | None

    @property
    def count(self) -> int:
        return int(self.rows.shape[0])

    @classmethod
    def select(
        cls, meta: AttentionMetadata, counts: list[int], rows: torch.Tensor | None = None
    ) -> OutputRows:
        """Each item's last ``counts[i]`` query rows of ``meta`` (``rows``: those flat rows on
        the device, when the caller has them already)."""
        qs = meta.query_start
        if len(counts) != meta.num_items:
            raise ValueError(f"counts has {len(counts)} entries for {meta.num_items} items")
        for i, n in enumerate(counts):
            if not 0 <= n <= qs[i + 1] - qs[i]:
                raise ValueError(f"item {i} keeps {n} of its {qs[i + 1] - qs[i]} query rows")
        kept = [i for i, n in enumerate(counts) if n]  # items with at least one row kept
        device = meta.block_tables.device
        if rows is None:
            flat = [row for i in kept for row in range(qs[i + 1] - counts[i], qs[i + 1])]
            rows = ints_to_device(flat, device)
        elif rows.shape != (sum(counts),):
            raise ValueError(f"rows must be [R={sum(counts)}], got {tuple(rows.shape)}")
        if not kept:
            return cls(rows, None)
        sub = AttentionMetadata.build(
            [0, *itertools.accumulate(counts[i] for i in kept)],
            [meta.context_lens[i] for i in kept],
            meta.block_tables[ints_to_device(kept, device)],
            meta.slot_mapping[rows],
        )
        return cls(rows, sub)


def write_kv(
    kv_layer: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's K/V rows into their pool slots, in place.

    kv_layer:     [2, num_blocks, block_size, num_kv_heads, head_dim] (must be contiguous)
    key, value:   [T, num_kv_heads, head_dim]
    slot_mapping: [T] int64, every entry a valid slot (no padding sentinel)
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    # A view (not a copy) so the scatter lands in the engine's pool.
    flat = kv_layer.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_layer.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_layer.dtype))


def _gather_blocks(
    kv_layer: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """kv_layer [2, NB, BS, Hkv, D], block_ids [..., nb] -> [2, ..., nb * BS, Hkv, D] in dtype."""
    gathered = kv_layer[:, block_ids]  # [2, ..., nb, BS, Hkv, D]
    shape = gathered.shape
    flat = gathered.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])
    # Cast only the gathered copy: the pool may be stored narrower than the compute dtype.
    return flat.to(dtype)


def check_window(window: int) -> None:
    """Raise for a window no layer can have (0 means global attention)."""
    if window < 0:
        raise ValueError(f"sliding window must be >= 0 (0 = global attention), got {window}")


def check_softcap(softcap: float) -> None:
    """Raise for a soft-cap no layer can have (0 means none)."""
    if not softcap >= 0.0 or math.isinf(softcap):
        raise ValueError(f"attention softcap must be finite and >= 0 (0 = off), got {softcap}")


def _attend(
    q: torch.Tensor,  # [..., n, D]
    k: torch.Tensor,  # [..., S, D]
    v: torch.Tensor,  # [..., S, D]
    mask: torch.Tensor,  # broadcastable to [..., n, S], True = visible
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Masked attention -> [..., n, D]: SDPA, or transformers' eager order with a soft-cap."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., n, S]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def paged_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each item's query rows over its own paged KV history.

    query:    [T, num_heads, head_dim]
    kv_layer: [2, num_blocks, block_size, num_kv_heads, head_dim], already holding this step's K/V
    window:   0 for global attention, else a query at position p sees keys in (p - window, p]
    softcap:  0 for none, else scores s become softcap * tanh(s / softcap) before the softmax
    returns   [T, num_heads, head_dim] in query's dtype
    """
    check_window(window)
    check_softcap(softcap)
    num_tokens, num_heads = query.shape[0], query.shape[1]
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if num_tokens != meta.num_tokens:
        raise ValueError(f"query has {num_tokens} rows but metadata describes {meta.num_tokens}")
    needed_blocks = math.ceil(meta.max_context / block_size)
    if needed_blocks > meta.block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {meta.block_tables.shape[1]} columns but a context of "
            f"{meta.max_context} needs {needed_blocks} blocks of {block_size}"
        )
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if meta.decode_items:
        out[meta.decode_rows] = _decode_attention(
            query, kv_layer, meta, scale, group, window, softcap
        )
    for i in meta.prefill_items:
        start, end = meta.query_start[i], meta.query_start[i + 1]
        out[start:end] = _chunk_attention(
            query[start:end],
            kv_layer,
            meta.block_tables[i],
            meta.context_lens[i],
            scale,
            group,
            window,
            softcap,
        )
    return out


def _decode_attention(
    query: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    group: int,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """All single-token items in one padded, masked SDPA call -> [D, num_heads, head_dim]."""
    block_size, num_kv_heads, head_dim = kv.shape[2], kv.shape[3], kv.shape[4]
    num_decodes = len(meta.decode_items)
    nb = math.ceil(meta.max_decode_context / block_size)
    # [2, D, S, Hkv, Dh] with S = nb * block_size >= every decode item's context
    keys_values = _gather_blocks(kv, meta.decode_block_tables[:, :nb], query.dtype)
    k = keys_values[0].transpose(1, 2)  # [D, Hkv, S, Dh]
    v = keys_values[1].transpose(1, 2)  # [D, Hkv, S, Dh]
    # The G query heads sharing one KV head become G "query rows" of that KV head, so GQA needs
    # no K/V repetition and every head sees the same per-item length mask.
    q = query[meta.decode_rows]  # [D, H, Dh]
    q = q.reshape(num_decodes, num_kv_heads, group, head_dim)  # [D, Hkv, G, Dh]
    positions = torch.arange(k.shape[2], device=kv.device)  # [S]
    mask = positions[None, :] < meta.decode_context_lens[:, None]  # [D, S]
    if window:
        # The query sits at position context_len - 1 and sees (context_len - 1 - window, ...].
        mask &= positions[None, :] >= meta.decode_context_lens[:, None] - window
    o = _attend(q, k, v, mask[:, None, None, :], scale, softcap)  # [D, Hkv, G, Dh]
    return o.reshape(num_decodes, num_kv_heads * group, head_dim)  # [D, H, Dh]


def _chunk_attention(
    query: torch.Tensor,
    kv: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    group: int,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """One item's n query rows over its first context_len cached positions -> [n, H, Dh]."""
    n, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv.shape[2], kv.shape[3]
    nb = math.ceil(context_len / block_size)
    keys_values = _gather_blocks(kv, block_table[:nb], query.dtype)  # [2, nb*BS, Hkv, Dh]
    keys_values = keys_values[:, :context_len]  # [2, ctx, Hkv, Dh]
    k = keys_values[0].transpose(0, 1)  # [Hkv, ctx, Dh]
    v = keys_values[1].transpose(0, 1)  # [Hkv, ctx, Dh]
    # Row r = j * G + g holds query token j, head g of its KV group.
    q = query.reshape(n, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)  # [Hkv, n, G, Dh]
    q = q.reshape(num_kv_heads, n * group, head_dim)  # [Hkv, n*G, Dh]
    # Token j sits at absolute position context_len - n + j and sees positions up to it.
    last_visible = torch.arange(context_len - n, context_len, device=kv.device)  # [n]
    positions = torch.arange(context_len, device=kv.device)  # [ctx]
    mask = positions[None, :] <= last_visible[:, None]  # [n, ctx]
    if window:
        mask &= positions[None, :] > last_visible[:, None] - window
    mask = mask.repeat_interleave(group, dim=0)  # [n*G, ctx]
    o = _attend(q, k, v, mask, scale, softcap)  # [Hkv, n*G, Dh]
    o = o.view(num_kv_heads, n, group, head_dim).permute(1, 0, 2, 3)  # [n, Hkv, G, Dh]
    return o.reshape(n, num_heads, head_dim)


# ----------------------------------------------------------------------------------------------
# Decode-only batches described by device tensors alone (CUDA-graph safe)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """A decode-only batch (one query row per item) held entirely in device tensors.

    Kernels launched over it read no host values, so their launches can be captured in a CUDA
    graph once and replayed with new contents: the shapes are fixed, the values are not.
    """

    block_tables: torch.Tensor  # [B, W] int64; entries past an item's context are never read
    context_lens: torch.Tensor  # [B] int32: KV length per item, this step's token included (>= 1)
    block_size: int

    def __post_init__(self) -> None:
        if self.block_tables.dim() != 2 or self.block_tables.stride(-1) != 1:
            raise ValueError("block_tables must be [B, W] and contiguous in its last dimension")
        if self.context_lens.shape != (self.block_tables.shape[0],):
            raise ValueError(
                f"context_lens must be [B={self.block_tables.shape[0]}], "
                f"got {tuple(self.context_lens.shape)}"
            )
        if self.context_lens.dtype != torch.int32:
            raise ValueError(f"context_lens must be int32, got {self.context_lens.dtype}")

    @property
    def max_context(self) -> int:
        """The longest context the tables can describe: fixes every launch shape."""
        return int(self.block_tables.shape[1]) * self.block_size


class DecodeAttentionFn(Protocol):
    """(query [B, H, D], kv_layer [2, NB, BS, Hkv, D], scale, window=0, softcap=0.0) -> [B, H, D];
    window and softcap as in ``paged_attention`` (0 = global / none)."""

    def __call__(
        self,
        query: torch.Tensor,
        kv_layer: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor: ...


def decode_attention_reference(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Torch reference of graph-safe decode attention: every item over its whole table width.

    The gather covers all W blocks of every row (the widest context the graph allows), so its
    cost grows with the model's maximum sequence length rather than the live contexts: fine for
    tests and tiny models, too slow for production graphs (the Triton path reads in place).

    query:   [B, num_heads, head_dim], one row per item
    window, softcap: as in ``paged_attention`` (0 = global / none)
    returns  [B, num_heads, head_dim] in query's dtype
    """
    check_window(window)
    check_softcap(softcap)
    num_items, num_heads, head_dim = query.shape
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    keys_values = _gather_blocks(kv_layer, batch.block_tables, query.dtype)  # [2, B, S, Hkv, Dh]
    k = keys_values[0].transpose(1, 2)  # [B, Hkv, S, Dh]
    v = keys_values[1].transpose(1, 2)  # [B, Hkv, S, Dh]
    q = query.reshape(num_items, num_kv_heads, group, head_dim)  # [B, Hkv, G, Dh]
    positions = torch.arange(k.shape[2], device=kv_layer.device)  # [S]
    # A tensor comparison, not a Python branch on lengths: no host sync inside a graph.
    mask = positions[None, :] < batch.context_lens[:, None]  # [B, S]
    if window:
        mask &= positions[None, :] >= batch.context_lens[:, None] - window
    o = _attend(q, k, v, mask[:, None, None, :], scale, softcap)  # [B, Hkv, G, Dh]
    return o.reshape(num_items, num_heads, head_dim)  # [B, H, Dh]


def reference_decode_attention(
    batch: DecodeBatch, num_heads: int, num_kv_heads: int
) -> DecodeAttentionFn:
    """Bind ``decode_attention_reference`` to one batch (the factory form backends expose)."""
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")

    def attend(
        query: torch.Tensor,
        kv_layer: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        return decode_attention_reference(query, kv_layer, batch, scale, window, softcap)

    return attend

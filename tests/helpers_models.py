"""Test helpers: a toy block allocator and a paged runner that drives a model step by step.

Test modules import this after putting ``tests/`` on ``sys.path`` (see ``import_helpers``
boilerplate at the top of each test file).
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field

import torch
from ferrum_kernels.attention import AttentionMetadata
from ferrum_server.models.config import ModelConfig
from ferrum_server.models.llama import LlamaForCausalLM


class BlockAllocator:
    """Hands out block ids from a free list, in order or shuffled (to get non-contiguous tables)."""

    def __init__(self, num_blocks: int, *, shuffle: bool = False, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        if shuffle:
            random.Random(seed).shuffle(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {n}, have {len(self.free)}")
        out, self.free = self.free[:n], self.free[n:]
        return out


@dataclass
class SeqState:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens already written to the cache


def build_meta(
    block_lists: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for items whose newest query_lens[i] tokens end at context_lens[i]."""
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    max_blocks = max((len(b) for b in block_lists), default=0)
    table = torch.zeros(len(block_lists), max(max_blocks, 1), dtype=torch.int64)
    for i, blocks in enumerate(block_lists):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    slots: list[int] = []
    for blocks, n, ctx in zip(block_lists, query_lens, context_lens, strict=True):
        for pos in range(ctx - n, ctx):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    return AttentionMetadata.build(
        query_start,
        context_lens,
        table.to(device),
        torch.tensor(slots, dtype=torch.int64, device=device),
    )


class PagedRunner:
    """Owns a KV pool and a set of sequences; ``step`` runs one unified forward pass."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.model, self.config, self.block_size = model, config, block_size
        weight = model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.kv_cache = torch.zeros(
            config.num_layers,
            2,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.allocator = BlockAllocator(num_blocks, shuffle=shuffle, seed=seed)
        self.seqs: dict[int, SeqState] = {}

    @torch.no_grad()
    def step(self, items: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Feed tokens to sequences (created on first use); per-item logits [n_i, vocab]."""
        ids: list[int] = []
        positions: list[int] = []
        block_lists, query_lens, context_lens = [], [], []
        for seq_id, tokens in items:
            seq = self.seqs.setdefault(seq_id, SeqState())
            new_len = seq.length + len(tokens)
            need = math.ceil(new_len / self.block_size) - len(seq.blocks)
            if need > 0:
                seq.blocks += self.allocator.allocate(need)
            ids += tokens
            positions += range(seq.length, new_len)
            block_lists.append(list(seq.blocks))
            query_lens.append(len(tokens))
            context_lens.append(new_len)
            seq.length = new_len
        meta = build_meta(block_lists, query_lens, context_lens, self.block_size, self.device)
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_cache,
            meta,
        )
        logits = self.model.compute_logits(hidden)  # [T, vocab]
        return [logits[meta.query_start[i] : meta.query_start[i + 1]] for i in range(len(items))]

    def snapshot(self) -> tuple[torch.Tensor, dict[int, SeqState], list[int]]:
        return self.kv_cache.clone(), copy.deepcopy(self.seqs), list(self.allocator.free)

    def restore(self, snap: tuple[torch.Tensor, dict[int, SeqState], list[int]]) -> None:
        self.kv_cache.copy_(snap[0])
        self.seqs = copy.deepcopy(snap[1])
        self.allocator.free = list(snap[2])

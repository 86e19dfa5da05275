"""Skip markers for tests of the native GEMMs (what this CPU's build of them has), and the
paged decode cases the native attention tests share."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch
from ferrum_kernels import native
from ferrum_kernels.attention import AttentionMetadata, paged_attention

_module = native.load()
needs_native_gemm = pytest.mark.skipif(
    _module is None or not _module.gemm_isa()[0], reason="native GEMM not built (needs AVX2)"
)
needs_avx512_float32_gemm = pytest.mark.skipif(
    _module is None or not _module.gemm_isa()[1],
    reason="native AVX-512 float32 GEMM not built (needs AVX-512F)",
)
needs_bf16_gemm = pytest.mark.skipif(
    _module is None or not _module.gemm_bf16_available(),
    reason="native bfloat16 GEMM not built (needs AVX-512F)",
)
needs_amx_gemm = pytest.mark.skipif(
    _module is None or not _module.amx_available(),
    reason="no AMX tiles here (needs a CPU with AMX-BF16 and Linux granting them)",
)


def scattered_tables(
    contexts: Sequence[int], block: int, rng: random.Random, spare: int = 3
) -> tuple[list[list[int]], int]:
    """Block tables for sequences of `contexts` tokens, their blocks drawn in shuffled order
    from a pool of just enough plus `spare`: (tables, the pool's blocks)."""
    num_blocks = sum(math.ceil(c / block) for c in contexts) + spare
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for c in contexts:
        n = math.ceil(c / block)
        tables.append(free[:n])
        free = free[n:]
    return tables, num_blocks


def paged_decode_reference(
    query: torch.Tensor,
    kv: torch.Tensor,
    tables: Sequence[Sequence[int]],
    contexts: Sequence[int],
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode row per sequence over the paged `kv` ([2, blocks, block, Hkv, D]): the block
    tables padded into one tensor, and the torch reference's attention (scale D^-0.5)."""
    width = max(len(t) for t in tables)
    table = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables])
    slots = torch.tensor([t[(c - 1) // block] * block + (c - 1) % block for t, c in
                          zip(tables, contexts, strict=True)])  # fmt: skip
    meta = AttentionMetadata.build(list(range(len(contexts) + 1)), list(contexts), table, slots)
    return table, paged_attention(query, kv, meta, query.shape[-1] ** -0.5)

"""A native CPU kernel for the decode half of paged attention, built on first use.

Decode attention is memory-bound: each decode reads its whole K/V history once. With torch ops
alone that history must first be gathered out of the paged pool into a dense buffer (a copy as
large as what is read), then read again by the matmuls, and padded to the longest item of its
group. This kernel walks each item's block table and reads K/V rows straight from the pool:
one pass over the history, no padding, no temporaries. With AVX-512 each item is one unit of
work (handed to threads dynamically, since lengths differ), read a whole token row at a time;
the scores of 16 tokens come out of one transpose-reduce rather than 16 horizontal sums, and
bfloat16 dot products use vdpbf16ps where the CPU has it (the V sum too, two tokens at a
time, with probabilities rounded to bfloat16 as the torch reference rounds them). Scores and
softmax are float32 whatever the pool dtype.

The C++ source is ``csrc/decode_attention.cpp``, built by ``ferrum_kernels.native``. When it
cannot be built, or ``FERRUM_CPU_NATIVE=0``, ``decode_attention`` returns None and callers keep
the torch path.
"""

from __future__ import annotations

import torch

from ferrum_kernels import native

__all__ = ["SUPPORTED_HEAD_DIMS", "decode_attention", "native_available"]

SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # the head dims the kernel is built for


def native_available() -> bool:
    return native.available()


def decode_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [N, W] int64
    context_lens: torch.Tensor,  # [N] int64
    rows: torch.Tensor,  # [N] int64: query row of each decode item
    scale: float,
) -> torch.Tensor | None:
    """Attention of N single-token items over their paged history -> [N, H, D], or None when
    the native kernel is unavailable for this input (the caller then uses the torch path)."""
    if (
        query.device.type != "cpu"
        or query.dtype not in (torch.float32, torch.bfloat16)
        or kv_layer.dtype != query.dtype
        or query.shape[2] not in SUPPORTED_HEAD_DIMS
        or not kv_layer.is_contiguous()
    ):
        return None
    module = native.load()
    if module is None:
        return None
    out: torch.Tensor = module.decode_attention(
        # Rows may be strided (a view of the fused qkv projection): the kernel takes a row stride.
        query if query.stride(2) == 1 and query.stride(1) == query.shape[2] else query.contiguous(),
        kv_layer[0],
        kv_layer[1],
        block_tables,
        context_lens,
        rows,
        kv_layer.shape[2],
        kv_layer.shape[3],
        scale,
    )
    return out

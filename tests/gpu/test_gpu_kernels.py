"""Compiled Triton kernels on a real CUDA device: production shapes, exactness, timing sanity.

Run with ``pytest tests/gpu -m gpu`` (or benchmarks/run_gpu_checks.sh). Must run in a process
that did not import the interpreter-mode unit tests (tests/unit/test_triton_kernels.py sets
TRITON_INTERPRET=1 for the whole process); the module skips itself in that case.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pytest
import torch
from helpers_gpu import require_cuda_and_triton

pytestmark = pytest.mark.gpu

require_cuda_and_triton()

from ferrum_kernels.attention import AttentionMetadata, paged_attention, write_kv  # noqa: E402
from ferrum_kernels.backend import select_backend  # noqa: E402
from ferrum_kernels.layers import apply_rotary, rms_norm  # noqa: E402
from ferrum_kernels.sampling import _gumbel_noise, build_sampling_tensors, sample  # noqa: E402
from ferrum_kernels.triton_attention import (  # noqa: E402
    paged_attention_triton,
    triton_write_kv,
)
from ferrum_kernels.triton_norm import rms_norm_residual_triton, rotary_triton  # noqa: E402
from ferrum_kernels.triton_sampling import gumbel_noise_triton, sample_triton  # noqa: E402

DEV = torch.device("cuda")


def _meta(
    items: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int = 0
) -> AttentionMetadata:
    """items: (history, new); blocks drawn at random from the pool (non-contiguous tables)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(math.ceil((h + n) / block_size) for h, n in items)
    query_start, context_lens, tables, slots = [0], [], [], []
    for hist, n in items:
        ctx = hist + n
        blocks = [perm.pop() for _ in range(math.ceil(ctx / block_size))]
        tables.append(blocks + [0] * (width - len(blocks)))
        query_start.append(query_start[-1] + n)
        context_lens.append(ctx)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(hist, ctx)]
    return AttentionMetadata.build(
        query_start,
        context_lens,
        torch.tensor(tables, device=DEV),
        torch.tensor(slots, device=DEV),
    )


def _pool(items: list[tuple[int, int]], block_size: int, hkv: int, d: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    num_blocks = sum(math.ceil((h + n) / block_size) for h, n in items) + 8
    kv = torch.randn(2, num_blocks, block_size, hkv, d, device=DEV).to(dtype)
    return kv, _meta(items, block_size, num_blocks)


_MIXED = [(1000, 300), (0, 257), (2047, 1), (15, 1), (511, 1), (64, 64), (0, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_attention_llama_shapes(dtype: torch.dtype, block_size: int) -> None:
    kv, meta = _pool(_MIXED, block_size, 8, 128, dtype)
    q = torch.randn(meta.num_tokens, 32, 128, device=DEV).to(dtype)
    want = paged_attention(q, kv, meta, 128**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for splits in (1, None, 7):
        got = paged_attention_triton(q, kv, meta, 128**-0.5, num_splits=splits)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_attention_long_context_split_heuristic() -> None:
    kv, meta = _pool([(16383, 1), (9000, 1)], 16, 8, 128, torch.bfloat16)
    q = torch.randn(2, 32, 128, device=DEV, dtype=torch.bfloat16)
    want = paged_attention(q, kv, meta, 0.088)
    got = paged_attention_triton(q, kv, meta, 0.088)  # heuristic splits here
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [256, 4096])
def test_sliding_window_attention_llama_shapes(dtype: torch.dtype, window: int) -> None:
    # Chunks crossing the window edge, decodes far past it (Mistral's 4096 and a short one).
    items = [(5000, 300), (0, 257), (9000, 1), (15, 1), (4100, 1), (200, 64)]
    kv, meta = _pool(items, 16, 8, 128, dtype)
    q = torch.randn(meta.num_tokens, 32, 128, device=DEV).to(dtype)
    want = paged_attention(q, kv, meta, 128**-0.5, window)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for splits in (1, None, 7):
        got = paged_attention_triton(q, kv, meta, 128**-0.5, window, num_splits=splits)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_write_kv_exact() -> None:
    kv = torch.zeros(2, 64, 16, 8, 128, device=DEV, dtype=torch.bfloat16)
    qkv = torch.randn(300, 48 * 128, device=DEV, dtype=torch.bfloat16)
    k = qkv[:, 32 * 128 : 40 * 128].view(300, 8, 128)
    v = qkv[:, 40 * 128 :].view(300, 8, 128)
    slots = torch.randperm(64 * 16, device=DEV)[:300]
    want = kv.clone()
    write_kv(want, k, v, slots)
    triton_write_kv(kv, k, v, slots)
    assert torch.equal(kv, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_and_rotary_exact_in_half_precision(dtype: torch.dtype) -> None:
    x = torch.randn(257, 4096, device=DEV).to(dtype)
    res = torch.randn(257, 4096, device=DEV).to(dtype)
    w = (torch.rand(4096, device=DEV) + 0.5).to(dtype)
    normed, new_res = rms_norm_residual_triton(x, res, w, 1e-5)
    assert torch.equal(new_res, res + x)
    torch.testing.assert_close(normed, rms_norm(res + x, w, 1e-5), atol=2e-2, rtol=2e-2)

    qkv = torch.randn(257, 48 * 128, device=DEV).to(dtype)
    q = qkv[:, : 32 * 128].view(257, 32, 128)
    k = qkv[:, 32 * 128 : 40 * 128].view(257, 8, 128)
    angles = torch.rand(257, 64, device=DEV) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    rotary_triton(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def _params(n: int, vocab: int, *, temperature: float, top_p: float, top_k: int):  # type: ignore[no-untyped-def]
    return build_sampling_tensors(
        temperature=[temperature if i % 4 else 0.0 for i in range(n)],
        top_k=[top_k] * n,
        top_p=[top_p] * n,
        seeds=list(range(n)),
        offsets=[i * 3 for i in range(n)],
        repetition_penalty=[1.2 if i % 3 == 0 else 1.0 for i in range(n)],
        penalty_ids=[list(range(i, i + 50)) for i in range(n)],
        token_mask_bits=None,
        num_logprobs=5,
        vocab_size=vocab,
        device=DEV,
    )


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(0.0, 1.0, 0), (0.8, 1.0, 0), (0.8, 0.9, 0), (1.0, 1.0, 40)]
)
def test_sampling_full_vocab(temperature: float, top_p: float, top_k: int) -> None:
    n, vocab = 64, 128256
    logits = torch.randn(n, vocab, device=DEV) * 4
    params = _params(n, vocab, temperature=temperature, top_p=top_p, top_k=top_k)
    got, want = sample_triton(logits, params), sample(logits, params)
    mismatches = (got.token_ids != want.token_ids).sum().item()
    if top_p < 1.0:
        # The nucleus boundary sums probabilities in a different order than torch.cumsum; a
        # token sitting exactly on it may flip. Anything beyond a rare flip is a bug.
        assert mismatches <= 1
    else:
        assert mismatches == 0
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs)


def test_gumbel_noise_bit_identical() -> None:
    seeds = torch.tensor([0, 1, -7, 2**62 + 5], device=DEV)
    offsets = torch.tensor([0, 3, 1 << 33, 511], device=DEV)
    got = gumbel_noise_triton(seeds, offsets, 128256)
    want = _gumbel_noise(seeds, offsets, torch.arange(128256, device=DEV))
    assert torch.equal(got, want), (got - want).abs().max()


def _time(fn: Callable[[], object], iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def test_timing_sanity() -> None:
    """Loose bounds: the fused kernels must beat the gather-based reference where they should."""
    items = [(2047, 1)] * 64
    kv, meta = _pool(items, 16, 8, 128, torch.bfloat16)
    q = torch.randn(64, 32, 128, device=DEV, dtype=torch.bfloat16)
    ref_s = _time(lambda: paged_attention(q, kv, meta, 0.088))
    tri_s = _time(lambda: paged_attention_triton(q, kv, meta, 0.088))
    assert tri_s < ref_s, (
        f"triton decode attention {tri_s * 1e6:.0f}us vs torch {ref_s * 1e6:.0f}us"
    )
    # Decode attention reads 64 * 2048 * 8 * 128 * 2 * 2 bytes of KV: at least 300 GB/s.
    kv_bytes = 64 * 2048 * 8 * 128 * 2 * 2
    assert kv_bytes / tri_s > 300e9, f"{kv_bytes / tri_s / 1e9:.0f} GB/s"

    logits = torch.randn(256, 128256, device=DEV)
    params = _params(256, 128256, temperature=0.0, top_p=1.0, top_k=0)
    assert _time(lambda: sample_triton(logits, params)) < _time(lambda: sample(logits, params))


def test_select_backend_on_cuda() -> None:
    assert select_backend(DEV).name == "triton"
    assert select_backend(DEV, prefer="torch").name == "torch"

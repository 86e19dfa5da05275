# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
# (@triton.jit kernels take untyped pointer/scalar arguments by design; triton ships no stubs.
# The Python wrappers below are fully annotated.)
"""Fused mixture-of-experts as Triton grouped GEMMs: ``fused_moe_triton`` has the contract of
``moe.fused_moe_reference``.

The (token, choice) pairs are sorted by expert once, and each expert's run is padded to a
multiple of ``BLOCK_M`` rows (``align_by_expert``), so every row tile of the sorted list belongs
to one expert. One kernel (``_moe_gemm_kernel``) then multiplies each tile by its expert's
weight, gathering the input rows through the sorted pair ids and scattering the results back to
pair order:

1. gate/up: ``x[pair // top_k] @ W_gate_up[e]^T`` -> ``[T*K, 2I]`` in the activation dtype;
2. SwiGLU (torch) -> ``[T*K, I]``;
3. down: ``h[pair] @ W_down[e]^T``, multiplied by the pair's float32 routing weight in the
   float32 accumulator -> ``[T*K, H]`` float32, summed over the K choices and rounded once.

Nothing reads a device value on the host: the padded length is a device scalar that tiles past it
check and leave, and the grid is sized for the worst case (``T*K`` rows plus ``BLOCK_M - 1`` of
padding for each expert that can be active), so the whole layer can be captured in a CUDA graph.

Under ``TRITON_INTERPRET=1`` the dots are computed in float32 (the interpreter's ``tl.dot`` is
wrong for bfloat16 operands); float32 inputs always use IEEE float32 dots, as torch's default
matmul does (no TF32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ferrum_kernels.layers import silu_and_mul
from ferrum_kernels.moe import ExpertWeights

__all__ = ["align_by_expert", "fused_moe_triton", "moe_block_m"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows of A, K]: x (first GEMM) or the SwiGLU output (second)
    b_ptr,  # [E, N, K]: stacked expert weights
    c_ptr,  # [T*K, N]: output, one row per (token, choice) pair
    weight_ptr,  # [T*K] float32 routing weights (MUL_WEIGHT)
    sorted_ids_ptr,  # [padded] int32: pair ids grouped by expert, padding = num_pairs
    block_expert_ptr,  # [padded / BLOCK_M] int32: the expert of each row tile
    num_padded_ptr,  # [1] int32: rows of sorted_ids in use
    num_pairs,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    ROW_DIV: tl.constexpr,  # A's row of a pair: pair // ROW_DIV (top_k for x, 1 for pairs)
    MUL_WEIGHT: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a tile of the worst-case grid that this step does not use
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)  # [BM]
    row_ok = pair < num_pairs  # padding rows hold num_pairs
    a_row = (pair // ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pair, mask=row_ok, other=0.0)  # [BM] float32
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: 16 when experts see a few rows each (decode), up to 64 for long prefills."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, K] -> (sorted_ids [P] int32, block_expert [P / block_m] int32, num_padded [1]
    int32): the pair ids (t * K + k) grouped by expert, each expert's run padded with the
    out-of-range id T*K to a multiple of block_m; the expert of each row tile; the padded
    length in use. P is the worst case, so no device value is read on the host."""
    flat = ids.reshape(-1)  # [S]
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] (bincount would size on the host)
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # [S] pair ids by expert
    expert_of = flat[order]  # [S]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank  # [S] slot of each sorted pair
    active = min(num_experts, num_pairs)
    capacity = -(-(num_pairs + active * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_start = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, padded_end[-1:].to(torch.int32)


def _grouped_gemm(
    a: torch.Tensor,  # [rows, K], row-contiguous
    b: torch.Tensor,  # [E, N, K] contiguous
    out: torch.Tensor,  # [S, N]
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    row_div: int,
    weights: torch.Tensor | None,  # [S] float32, or None
) -> None:
    sorted_ids, block_expert, num_padded = routing
    n, k = b.shape[1], b.shape[2]
    fp32 = a.dtype == torch.float32
    interpret = _interpreting()
    block_n = 32 if interpret else 64
    block_k = 32 if fp32 or interpret else 64
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        b,
        out,
        out if weights is None else weights,  # unread without MUL_WEIGHT
        sorted_ids,
        block_expert,
        num_padded,
        out.shape[0],
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        ROW_DIV=row_div,
        MUL_WEIGHT=weights is not None,
        DOT_F32=fp32 or interpret,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def fused_moe_triton(
    x: torch.Tensor,  # [T, H]
    experts: ExpertWeights,
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] int64
) -> torch.Tensor:
    """[T, H] in x's dtype: sum over k of weights[:, k] * expert_{ids[:, k]}(x)."""
    t, top_k = ids.shape
    hidden = x.shape[1]
    if t == 0:
        return x.new_empty(0, hidden)
    num_pairs = t * top_k
    block_m = moe_block_m(num_pairs, experts.num_experts)
    routing = align_by_expert(ids, experts.num_experts, block_m)
    x = x.contiguous()
    gate_up = experts.gate_up_stack()  # [E, 2I, H]
    inter = x.new_empty(num_pairs, gate_up.shape[1])  # [T*K, 2I]
    _grouped_gemm(x, gate_up, inter, routing, block_m, top_k, None)
    act = silu_and_mul(inter).contiguous()  # [T*K, I]
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, experts.down_stack(), out, routing, block_m, 1, flat_weights)
    return out.view(t, top_k, hidden).sum(dim=1).to(x.dtype)  # [T, H]

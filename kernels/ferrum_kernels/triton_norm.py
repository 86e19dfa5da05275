# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
# (@triton.jit kernels take untyped pointer/scalar arguments by design; triton ships no stubs.
# The Python wrappers below are fully annotated.)
"""Fused RMSNorm (+ residual add) and in-place rotary embedding as Triton kernels.

Numerics follow ``ferrum_kernels.layers`` (the Hugging Face order of casts):

* ``rms_norm_residual``: ``new_residual = x + residual`` rounded to the activation dtype (as the
  unfused model does when it adds two bf16 tensors), statistics in float32, the normalised value
  cast back to the activation dtype *before* the weight multiply. Only the float32 reduction order
  differs from torch, so results agree to within rounding of the variance.
* ``rotary_triton``: rounds after every product and sum exactly like eager torch does on bf16/fp16
  tensors, so half-precision results are bit-identical to ``apply_rotary``.

Constraints: the normalised dimension must fit one program (hidden sizes up to 65536); rotary
needs an even head_dim with the cos/sin half tables ``[T, head_dim // 2]`` in the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm_residual_triton", "rms_norm_triton", "rotary_triton"]

_MAX_NORM_DIM = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [R, N]
    res_ptr,  # [R, N] (HAS_RESIDUAL)
    w_ptr,  # [N]
    out_ptr,  # [R, N]
    res_out_ptr,  # [R, N] (HAS_RESIDUAL)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)  # [BLOCK]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        # Round the sum to the activation dtype: that is the tensor the unfused path normalises.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / n_cols
    y = (xf * tl.rsqrt(variance + eps)).to(x.dtype)  # HF casts before applying the weight
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)  # [BLOCK]
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [R, N] with a unit last stride (a view when possible)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm_residual_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); with ``residual=None`` it is (rms_norm(x), x).

    x, residual: [..., N] same dtype; weight: [N]. Returns fresh tensors (inputs untouched), the
    normed one in promote_types(weight, x) like ``weight * y`` in the reference.
    """
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"weight must be [{n_cols}], got {tuple(weight.shape)}")
    if n_cols > _MAX_NORM_DIM:
        raise ValueError(f"normalised dim {n_cols} > {_MAX_NORM_DIM} is not supported")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must match x in shape and dtype")
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, n_cols)
    if residual is not None:
        r2 = _rows(residual)
        new_res = torch.empty_like(x, memory_format=torch.contiguous_format)
        nr2 = new_res.view(-1, n_cols)
    else:
        r2, new_res, nr2 = x2, x, x2  # placeholders: HAS_RESIDUAL prunes their use
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out, new_res
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(num_rows,)](
        x2,
        r2,
        weight,
        out2,
        nr2,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        nr2.stride(0),
        n_cols,
        eps,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, new_res


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Drop-in for ``layers.rms_norm`` (also per-head q/k norms on [T, H, D])."""
    return rms_norm_residual_triton(x, None, weight, eps)[0]


@triton.jit
def _rotate_heads(
    x_ptr,  # [T, heads, D] (row t of it)
    c,  # [1, HALF_PAD] cos of this token
    s,  # [1, HALF_PAD] sin of this token
    t,
    stride_t,
    stride_h,
    num_heads,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS_PAD)  # [Hp]
    offs_d = tl.arange(0, HALF_PAD)  # [Dh]
    mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]  # [Hp, Dh]
    ptr1 = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]  # [Hp, Dh]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    # Each product and sum is rounded to the activation dtype, as eager torch does; a float32
    # product of two half-precision values is exact, so these match torch bit for bit (with fp
    # fusion off at launch: see rotary_triton).
    a = (x1.to(tl.float32) * c).to(dt).to(tl.float32)
    b = (x2.to(tl.float32) * s).to(dt).to(tl.float32)
    o1 = (a - b).to(dt)
    a2 = (x2.to(tl.float32) * c).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s).to(dt).to(tl.float32)
    o2 = (a2 + b2).to(dt)
    tl.store(ptr1, o1, mask=mask)
    tl.store(ptr1 + HALF, o2, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, Hkv, D]
    cos_ptr,  # [T, D/2]
    sin_ptr,  # [T, D/2]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)  # [Dh]
    d_ok = offs_d < HALF
    # cos/sin are loaded once per token and shared by every q and k head.
    c = tl.load(cos_ptr + t * stride_ct + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, c, s, t, stride_qt, stride_qh, num_q_heads, HALF, HEADS_PAD, HALF_PAD)
    _rotate_heads(k_ptr, c, s, t, stride_kt, stride_kh, num_k_heads, HALF, HEADS_PAD, HALF_PAD)


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX ("rotate_half") rotary on q and k, IN PLACE; returns (q, k) for symmetry with torch.

    q:   [T, H, D], k: [T, Hkv, D] (strided views of a fused qkv are fine; last dim contiguous)
    cos: [T, D // 2], sin: [T, D // 2], in q's dtype (the half tables of ``layers.apply_rotary``)
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} does not match q {tuple(q.shape)}")
    half = head_dim // 2
    if head_dim % 2 or cos.shape != (num_tokens, half) or sin.shape != (num_tokens, half):
        raise ValueError(f"cos/sin must be [{num_tokens}, {half}] for head_dim {head_dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary works in place: q and k need a contiguous last dimension")
    if num_tokens == 0:
        return q, k
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_q_heads,
        k.shape[1],
        HALF=half,
        HEADS_PAD=triton.next_power_of_2(max(num_q_heads, k.shape[1])),
        HALF_PAD=triton.next_power_of_2(half),
        # Fusion on, the first H200 run differed from eager torch by one ulp in bf16 and fp16.
        # The likely cause (not yet confirmed on a GPU): LLVM narrows each rounded float32
        # product to a native half-precision multiply, then contracts multiply and subtract
        # into one fma, skipping the product's rounding that eager torch does. (The interpreter
        # drops this compile option; it never fuses.)
        enable_fp_fusion=False,
    )
    return q, k

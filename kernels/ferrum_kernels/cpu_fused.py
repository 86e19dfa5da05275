"""Fused elementwise layers for the CPU path: RMSNorm with the residual add, SwiGLU, rotary.

Each function has the contract of its torch reference in ``layers`` / ``backend`` (the same
roundings, so results agree with transformers as closely as the reference does) and falls back to
that reference when the native module (``csrc/fused_ops.cpp``) is unavailable or the input is not
a float32/bfloat16 CPU tensor of the expected layout. On a W1 prefill step in bfloat16 the chains
of ATen ops they replace cost about a third of the non-GEMM time.
"""

from __future__ import annotations

import torch

from ferrum_kernels import native
from ferrum_kernels.layers import apply_rotary, rms_norm, silu_and_mul

__all__ = ["rms_norm_residual_cpu", "rotary_cpu", "silu_and_mul_cpu"]

_DTYPES = (torch.float32, torch.bfloat16)


def _native_for(*tensors: torch.Tensor) -> object | None:
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _DTYPES:
        return None
    if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        return None
    module: object | None = native.load()
    return module


def rms_norm_residual_cpu(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor | None,  # [T, N] (updated in place when given)
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); with residual None, (rms_norm(x), x).

    The sum is written into ``residual`` in place: the decoder owns its residual stream.
    """
    module = _native_for(x, weight) if residual is None else _native_for(x, residual, weight)
    if module is None or x.dim() != 2 or not x.is_contiguous():
        hidden = x if residual is None else residual + x
        return rms_norm(hidden, weight, eps), hidden
    if residual is None:
        return module.rms_norm(x, weight, eps), x  # type: ignore[attr-defined]
    if not residual.is_contiguous() or residual.shape != x.shape:
        hidden = residual + x
        return rms_norm(hidden, weight, eps), hidden
    return module.add_rms_norm_(residual, x, weight, eps), residual  # type: ignore[attr-defined]


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up [T, I]."""
    module = _native_for(gate_up)
    if module is None or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return silu_and_mul(gate_up)
    out: torch.Tensor = module.silu_and_mul(gate_up)  # type: ignore[attr-defined]
    return out


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """[T, heads, D] with unit-stride heads -> a [T, heads * D] view, else None."""
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        return None
    return x.flatten(1)


def rotary_cpu(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D/2] in q's dtype
    sin: torch.Tensor,  # [T, D/2]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (views into the qkv projection are fine) and returns them."""
    module = _native_for(q, k, cos, sin)
    q_rows, k_rows = _rows(q), _rows(k)
    if module is None or q_rows is None or k_rows is None:
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    cos, sin = cos.contiguous(), sin.contiguous()
    head_dim = q.shape[2]
    if _k_follows_q(q_rows, k_rows):
        # q and k heads side by side in each row (a fused qkv projection): one pass over both.
        heads = q.shape[1] + k.shape[1]
        both = q_rows.as_strided((q_rows.shape[0], heads * head_dim), q_rows.stride())
        module.rotary_(both, cos, sin, heads, head_dim)  # type: ignore[attr-defined]
        return q, k
    module.rotary_(q_rows, cos, sin, q.shape[1], head_dim)  # type: ignore[attr-defined]
    module.rotary_(k_rows, cos, sin, k.shape[1], head_dim)  # type: ignore[attr-defined]
    return q, k


def _k_follows_q(q_rows: torch.Tensor, k_rows: torch.Tensor) -> bool:
    """Whether each row of k starts right where q's ends, in the same storage, with the same
    row stride and rows that do not overlap, so one [T, (Hq + Hkv) * D] span from q's rows
    covers both."""
    if q_rows.stride(0) != k_rows.stride(0) or q_rows.shape[0] != k_rows.shape[0]:
        return False
    if q_rows.untyped_storage().data_ptr() != k_rows.untyped_storage().data_ptr():
        return False  # adjacent by chance: a view of q's storage cannot reach k's
    end = q_rows.data_ptr() + q_rows.shape[1] * q_rows.element_size()
    return k_rows.data_ptr() == end and q_rows.stride(0) >= q_rows.shape[1] + k_rows.shape[1]

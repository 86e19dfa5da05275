"""Small building blocks shared by the model code (torch reference path).

Each function reproduces the Hugging Face Llama-family numerics (dtype casts included), so a model
built from them matches ``transformers`` to floating-point noise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: statistics in float32, weight applied in the input dtype."""
    input_dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    # HF casts back to the input dtype *before* scaling by the weight; keeping that order matters
    # for bit-level agreement in bf16/fp16.
    return weight * (xf * torch.rsqrt(variance + eps)).to(input_dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim: ``x / rms(x) * (1 + weight)``, all in float32 and cast
    back to the input dtype once at the end (transformers' ``Gemma2RMSNorm`` order; Llama's
    casts before the weight, and a precomputed ``1 + weight`` stored in bfloat16 would round)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` in transformers' op order (divide, tanh, multiply)."""
    return torch.tanh(x / cap) * cap


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style ("rotate_half") rotary embedding.

    x:   [T, heads, head_dim]
    cos: [T, head_dim // 2] in x's dtype (the frequency table is duplicated across both halves in
         the HF formulation, so only one half is stored)
    sin: [T, head_dim // 2]
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half]  # [T, heads, head_dim/2]
    x2 = x[..., half:]  # [T, heads, head_dim/2]
    c = cos.unsqueeze(1)  # [T, 1, head_dim/2]
    s = sin.unsqueeze(1)  # [T, 1, head_dim/2]
    # Same products and sums as x * cos + rotate_half(x) * sin, so results are bit-identical.
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # [T, heads, head_dim]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [.., 2 * I] gate/up projection output -> [.., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh-approximated GELU (``gelu_pytorch_tanh``) on a fused [.., 2 * I]
    gate/up projection output -> [.., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class TiedLinear(nn.Module):
    """A bias-free linear over an embedding table's weight: a tied LM head, [.., N] -> [.., V].

    It owns no Parameter (the embedding does), so parameters, ``state_dict`` and weight export are
    the same as without it. ``packed`` is an optional faster equivalent of ``F.linear(x, weight)``
    for CPU inputs that a backend's weight preparation may set (``cpu_linear.prepack_linears``
    does); this module stays the one place the head's GEMM is chosen.
    """

    _embedding: nn.Embedding
    packed: Callable[[torch.Tensor], torch.Tensor] | None

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        # Not registered as a child: the table would then appear twice in state_dict. Looked up
        # at call time, so the head follows the embedding through .to() / to_empty().
        object.__setattr__(self, "_embedding", embedding)
        self.packed = None

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.device.type == "cpu":
            return self.packed(x)
        return F.linear(x, self.weight)

"""The CPU backend's mixture-of-experts: the reference's grouped GEMMs (``moe.grouped_experts``)
over packed expert weights (cpu_linear: oneDNN or the native GEMM), with the native SwiGLU.

Each expert's gate/up and down weights are packed once (``prepack_experts``, part of the CPU
backend's ``prepare_model``), as the dense linears are (``cpu_linear``): at W1-moe's sizes
(hidden 768, 8 experts of intermediate 1024, top-2) float32 packed GEMMs took 0.55-0.83x the
time of ``F.linear`` for 1 to 256 tokens a step, and ``F.grouped_mm`` (one call for every
expert) was no faster than ``F.linear`` (measured on the 2-core development machine). Where
oneDNN cannot pack the dtype (bfloat16 on an AVX2-only CPU) or the weights are not on CPU, this
is the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from ferrum_kernels.cpu_fused import silu_and_mul_cpu
from ferrum_kernels.cpu_linear import PackedWeight, packed_linear
from ferrum_kernels.moe import ExpertWeights, Linear, fused_moe_reference, grouped_experts

__all__ = ["fused_moe_cpu", "prepack_experts"]


def prepack_experts(module: nn.Module) -> int:
    """Pack every expert of every ``ExpertWeights`` below ``module`` not packed yet; return how
    many weights were packed (0 when run again, or where oneDNN cannot pack them)."""
    count = 0
    for child in module.modules():
        # Released experts count as packed: their plain storage is gone, nothing to re-pack.
        if not isinstance(child, ExpertWeights) or child.is_packed():
            continue
        gate_up, down = child.gate_up_stack(), child.down_stack()
        pairs = [(packed_linear(gate_up[e]), packed_linear(down[e])) for e in range(len(gate_up))]
        packed = tuple((g, d) for g, d in pairs if g is not None and d is not None)
        if len(packed) == len(pairs):
            child.packed = packed
            child.packed_from = child.gate_up_proj.data_ptr()
            count += 2 * len(packed)
    return count


def fused_moe_cpu(
    x: torch.Tensor,  # [T, H]
    experts: ExpertWeights,
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] int64
) -> torch.Tensor:
    """``moe.fused_moe_reference`` through the packed experts where they exist."""
    packed = experts.packed
    if experts.released:
        assert packed is not None  # released only once packed
        dtype = _packed_dtype(packed)
        if x.device.type != "cpu" or x.dtype != dtype:
            # The reference would need the freed plain weights.
            raise RuntimeError(
                f"these experts keep only their packed {dtype} weights "
                f"(release_plain_weights); they cannot run {x.dtype} on {x.device.type}"
            )
    else:
        usable = experts.is_packed() and x.device.type == "cpu"
        if packed is None or not usable or x.dtype != experts.gate_up_proj.dtype:
            return fused_moe_reference(x, experts, weights, ids)
    return grouped_experts(
        x,
        weights,
        ids,
        experts.num_experts,
        lambda e, rows: packed[e][0](rows),
        lambda e, rows: packed[e][1](rows),
        silu_and_mul_cpu,
    )


def _packed_dtype(packed: tuple[tuple[Linear, Linear], ...]) -> torch.dtype:
    first = packed[0][0]
    assert isinstance(first, PackedWeight)  # prepack_experts made every pair
    return first.dtype

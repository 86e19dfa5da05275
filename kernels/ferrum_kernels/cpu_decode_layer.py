"""A dense decoder layer's decode step as native calls only: the CPU backend's fast path.

A decode step runs each layer as nine native kernels (two norms, four GEMMs, rotary, the KV
store, attention). Through the generic path (the model's modules, then the backend's functions,
each checking its operands before it picks the native kernel or a fallback) the Python between
those kernels costs about 125 us a layer: 1.5 ms of a W1 bfloat16 decode step of 64 items,
against 32 ms of kernels. `NativeDecodeLayer` makes the same calls with the same operands
(but the rotary and the KV store as one, `rotary_store_kv_`, the same values in one pass over
the rows), checked once when it is built (the layer's parts) and once a call (the step): its
results are bit for bit the generic path's. Anything it does not serve (a prefill chunk in the
step, another dtype, gradients) returns None, and the layer runs the generic path.

``NativeDecodeLayers`` goes further for a model whose layers all have one: the whole step's
layers in one native call (``decode_layers``), the same kernels in the same order, so the
Python between the layers' 120 calls is gone too. Its ``prefill`` does the same for a step of
prompt chunks alone (``prefill_layers``: the prefill attention in place of the decode one), for
every layer but the last, which the model runs for the output rows alone. There the generic
path's Python between the kernels was 3.4-4 ms of a W1 bfloat16 prompt step (50 ms at 2 x 256
tokens, 100 ms at 4 x 256).

It serves a layer whose parts all run natively: plain RMSNorms, four unbiased ``PackedLinear``s
on the native GEMM (the gate/up packed paired, so its GEMM applies the SwiGLU), global attention
without q/k norms or a soft cap, one rank. The model says which of its layers are such
(``DenseLayerParts``); ``NativeDecodeLayer.build`` checks the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ferrum_kernels import native
from ferrum_kernels.attention import AttentionMetadata
from ferrum_kernels.cpu_attention import CpuAttention, CpuAttentionPlan, native_prefill_module
from ferrum_kernels.cpu_decode import SUPPORTED_HEAD_DIMS
from ferrum_kernels.cpu_linear import PackedLinear, PackedWeight

__all__ = ["DenseLayerParts", "LayersFn", "NativeDecodeLayer", "NativeDecodeLayers"]

# Several layers of a step in one function: (embeddings, cos, sin, kv_cache [L, ...], meta) ->
# (output, residual), or None where it does not serve the step (NativeDecodeLayers' entry
# points; backend.DecodeLayersFn and PrefillLayersFn).
LayersFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata],
    tuple[torch.Tensor, torch.Tensor] | None,
]


@dataclass(frozen=True, slots=True)
class DenseLayerParts:
    """What a dense decoder layer is made of, as the model hands it to the backend: the norms'
    weights and epsilons, the four projections (qkv fused: q heads, then k, then v; gate/up
    fused: gate rows, then up), its heads and attention scale. The model hands these only for a
    layer that computes exactly norm, qkv, rotary, attention, o, norm, SwiGLU MLP (no q/k norms,
    no sliding window, no soft cap, one rank)."""

    input_norm_weight: torch.Tensor
    input_norm_eps: float
    post_norm_weight: torch.Tensor
    post_norm_eps: float
    qkv_proj: nn.Module
    o_proj: nn.Module
    gate_up_proj: nn.Module
    down_proj: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


def _native_pack(proj: nn.Module, dtype: torch.dtype, paired: bool) -> PackedWeight | None:
    """proj's packed weight when its forward runs the native GEMM in `dtype` without a bias
    (and, for the gate/up, paired: its GEMM fuses the SwiGLU); else None."""
    if type(proj) is not PackedLinear or proj.bias is not None:
        return None
    pack = proj._pack
    if pack is None or pack.kernel != "native" or pack.bias is not None:
        return None
    if pack.dtype != dtype or pack.compute_dtype != dtype or pack.paired != paired:
        return None
    return pack


class NativeDecodeLayer:
    """``(hidden, residual, cos, sin, kv_layer, meta) -> (output, residual) | None``: one dense
    layer of a decode-only step, as the generic path computes it (see the module docstring)."""

    __slots__ = ("_attention", "_down", "_dtype", "_gate_up", "_o", "_parts", "_q_width", "_qkv")

    def __init__(
        self,
        parts: DenseLayerParts,
        attention: CpuAttention,
        packs: tuple[PackedWeight, PackedWeight, PackedWeight, PackedWeight],
        dtype: torch.dtype,
    ) -> None:
        self._parts = parts
        self._attention = attention
        self._qkv, self._o, self._gate_up, self._down = packs
        self._dtype = dtype
        self._q_width = parts.num_heads * parts.head_dim  # where k starts in a qkv row

    @classmethod
    def build(cls, parts: DenseLayerParts, attention: CpuAttention) -> NativeDecodeLayer | None:
        """The layer's fast path, or None when a part of it does not run natively here."""
        if native.load() is None or parts.head_dim not in SUPPORTED_HEAD_DIMS:
            return None
        dtype = parts.input_norm_weight.dtype
        if dtype not in (torch.float32, torch.bfloat16) or parts.post_norm_weight.dtype != dtype:
            return None
        qkv = _native_pack(parts.qkv_proj, dtype, paired=False)
        o = _native_pack(parts.o_proj, dtype, paired=False)
        gate_up = _native_pack(parts.gate_up_proj, dtype, paired=True)
        down = _native_pack(parts.down_proj, dtype, paired=False)
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        return cls(parts, attention, (qkv, o, gate_up, down), dtype)

    def plan(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> CpuAttentionPlan | None:
        """The step's attention plan where this layer serves the step (``__call__``'s operands),
        else None."""
        # The step: decodes only, one query row each.
        if not self._takes(hidden, residual, cos, kv_layer):
            return None
        plan = self._attention.plan(meta, kv_layer.shape[2])
        if plan.chunks or not plan.decodes_are_rows or plan.num_tokens != hidden.shape[0]:
            return None
        return plan

    def prefill_plan(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> CpuAttentionPlan | None:
        """The step's attention plan where this layer's kernels serve a step of prompt chunks
        alone (no decodes) with the native prefill attention (``prefill_layers``' operands),
        else None."""
        if not self._takes(hidden, None, cos, kv_layer):
            return None
        plan = self._attention.plan(meta, kv_layer.shape[2])
        if not plan.chunks or plan.decode_rows.numel() or plan.num_tokens != hidden.shape[0]:
            return None
        module = native_prefill_module(hidden.dtype, hidden.device, kv_layer, plan)
        return plan if module is not None else None

    def prefill_scratch(self, plan: CpuAttentionPlan, hidden: torch.Tensor) -> torch.Tensor:
        """Room for the prefill kernel's packed K/V of ``plan`` (global attention), in the
        attention's own workspace, as each layer's call takes it (``_native_prefill``)."""
        p = self._parts
        numel = plan.key_slots(0) * p.num_kv_heads * p.head_dim * 2
        return self._attention.workspace.take(2, numel, hidden.dtype, hidden.device)

    def _takes(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        kv_layer: torch.Tensor,
    ) -> bool:
        """Whether the step's operands are this layer's: its dtype, on the CPU, contiguous,
        with no gradient (the generic linears fall back to F.linear under one)."""
        dtype = self._dtype
        if (
            hidden.dtype != dtype
            or cos.dtype != dtype
            or kv_layer.dtype != dtype
            or hidden.device.type != "cpu"
            or not kv_layer.is_contiguous()
            or not hidden.is_contiguous()
            or torch.is_grad_enabled()
        ):
            return False
        return residual is None or (residual.dtype == dtype and residual.is_contiguous())

    def shape(self) -> tuple[object, ...]:
        """What every layer of one ``decode_layers`` call must share: dtype, heads, head size
        and attention scale."""
        p = self._parts
        return (self._dtype, p.num_heads, p.num_kv_heads, p.head_dim, p.scale)

    def epsilons(self) -> list[float]:
        """The two norms' epsilons, in ``decode_layers``' order."""
        return [self._parts.input_norm_eps, self._parts.post_norm_eps]

    def widths(self) -> list[int]:
        """The four projections' output widths (N), in ``decode_layers``' order."""
        return [pack.out_features for pack in (self._qkv, self._o, self._gate_up, self._down)]

    def weights(self) -> list[torch.Tensor]:
        """The layer's norm weights and packed projections, in ``decode_layers``' order."""
        parts = self._parts
        return [
            parts.input_norm_weight,
            parts.post_norm_weight,
            self._qkv.packed(),
            self._o.packed(),
            self._gate_up.packed(),
            self._down.packed(),
        ]

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden], None for the first layer
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,
        kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        plan = self.plan(hidden, residual, cos, kv_layer, meta)
        if plan is None:
            return None
        module = native.load()
        parts = self._parts
        h, hkv, d = parts.num_heads, parts.num_kv_heads, parts.head_dim
        t = hidden.shape[0]
        if residual is None:
            x = module.rms_norm(hidden, parts.input_norm_weight, parts.input_norm_eps)
            residual = hidden
        else:
            x = module.add_rms_norm_(
                residual, hidden, parts.input_norm_weight, parts.input_norm_eps
            )
        qkv = self._qkv
        qkv_out = module.packed_gemm(x, qkv.packed(), None, qkv.out_features)  # [T, (H+2Hkv)D]
        # q and k rotated in place and k, v written into their slots, in one pass over the rows.
        module.rotary_store_kv_(
            qkv_out, cos.contiguous(), sin.contiguous(), h, hkv, d, kv_layer, meta.slot_mapping
        )
        q = qkv_out[:, : self._q_width].view(t, h, d)
        attended = module.decode_attention(
            q,
            kv_layer[0],
            kv_layer[1],
            plan.decode_tables,
            plan.decode_lens,
            plan.decode_rows,
            kv_layer.shape[2],
            kv_layer.shape[3],
            parts.scale,
        )  # [T, H, D]
        o = self._o
        out = module.packed_gemm(attended.view(t, h * d), o.packed(), None, o.out_features)
        x = module.add_rms_norm_(residual, out, parts.post_norm_weight, parts.post_norm_eps)
        gate_up, down = self._gate_up, self._down
        act = module.packed_gemm_halves(x, gate_up.packed(), None, gate_up.out_features, True)
        return module.packed_gemm(act, down.packed(), None, down.out_features), residual


class NativeDecodeLayers:
    """``(hidden, cos, sin, kv_cache, meta) -> (output, residual) | None``: every layer of a
    decode-only step in one native call (``decode_layers``, csrc/decode_layers.cpp), for a
    model whose layers all have a ``NativeDecodeLayer`` of one shape. The same kernels run in
    the same order on the same operands as the layers' own calls, so the results are bit for
    bit theirs; what saves time is the Python between the kernels (about 2 ms of a W1 bfloat16
    decode step of 64 items, docs/cpu-kernels.md). None where the first layer would not serve
    the step: the layers then run one by one."""

    __slots__ = ("_eps", "_layers", "_widths")

    def __init__(self, layers: list[NativeDecodeLayer]) -> None:
        self._layers = layers
        self._eps = [eps for layer in layers for eps in layer.epsilons()]
        self._widths = [n for layer in layers for n in layer.widths()]

    @classmethod
    def build(cls, layers: Sequence[object]) -> NativeDecodeLayers | None:
        """The model's one-call decode step, or None unless every layer is a
        `NativeDecodeLayer` and all share dtype, heads, head size and attention scale."""
        natives = [layer for layer in layers if isinstance(layer, NativeDecodeLayer)]
        if not natives or len(natives) != len(layers):
            return None
        if any(layer.shape() != natives[0].shape() for layer in natives):
            return None
        return cls(natives)

    @classmethod
    def build_prefill(cls, layers: Sequence[object]) -> LayersFn | None:
        """The model's one-call prompt step (``prefill``) where ``build`` would give a
        one-call decode step, else None."""
        built = cls.build(layers)
        return None if built is None else built.prefill

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the embeddings
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._holds(kv_cache):
            return None
        plan = self._layers[0].plan(hidden, None, cos, kv_cache[0], meta)
        if plan is None:
            return None
        out: tuple[torch.Tensor, torch.Tensor] = native.load().decode_layers(
            *self._operands(hidden, cos, sin, kv_cache, meta, len(self._layers)),
            plan.decode_tables,
            plan.decode_lens,
            plan.decode_rows,
        )
        return out

    def _holds(self, kv_cache: torch.Tensor) -> bool:
        """Whether kv_cache is one contiguous pool of every layer's K/V, as the native loop
        takes it."""
        return (
            kv_cache.dim() == 6
            and kv_cache.shape[0] == len(self._layers)
            and kv_cache.is_contiguous()
        )

    def _operands(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        count: int,
    ) -> list[object]:
        """``decode_layers``' and ``prefill_layers``' arguments up to their attention plan's,
        for the first `count` layers."""
        _, heads, kv_heads, head_dim, scale = self._layers[0].shape()
        return [
            hidden,
            cos.contiguous(),
            sin.contiguous(),
            kv_cache,
            [w for layer in self._layers[:count] for w in layer.weights()],
            self._eps[: 2 * count],
            self._widths[: 4 * count],
            heads,
            kv_heads,
            head_dim,
            scale,
            meta.slot_mapping,
        ]

    def prefill(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the embeddings
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer but the last of a step of prompt chunks alone, in one native call
        (``prefill_layers``): -> (output, residual) [T, hidden] for the model's last layer to
        finish, as the layers' own calls would leave them (the same kernels in the same order,
        the prefill attention as ``cpu_attention`` runs it). None where the first layer's
        kernels do not serve the step (a decode in it, another dtype, a model of one layer):
        the layers then run one by one."""
        layers = self._layers
        if len(layers) < 2 or not self._holds(kv_cache):
            return None
        first = layers[0]
        plan = first.prefill_plan(hidden, cos, kv_cache[0], meta)
        if plan is None:
            return None
        out: tuple[torch.Tensor, torch.Tensor] = native.load().prefill_layers(
            *self._operands(hidden, cos, sin, kv_cache, meta, len(layers) - 1),
            plan.chunk_info,
            plan.chunk_tables,
            first.prefill_scratch(plan, hidden),
        )
        return out

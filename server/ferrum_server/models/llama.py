"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3; Mixtral and Qwen3-MoE with sparse
MLP layers, ``models.moe``) over a paged KV cache.

Every projection runs once over the flat token dimension T of a unified batch; only attention
looks at the per-item split carried by ``AttentionMetadata``. q/k/v and gate/up are fused into one
GEMM each; ``weight_map`` records how the fused tensors map onto HF checkpoint names (Phi-3
checkpoints store them fused already, in the same row order).

Attention (with the KV write), norm + residual, rotary and SwiGLU come from the one
``KernelBackend`` the model is bound to (``bind_backend``; the torch reference until then), so
the model code is the same for every device and kernel choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from ferrum_kernels.attention import AttentionMetadata, OutputRows
from ferrum_kernels.backend import (
    DecodeLayerFn,
    DecodeLayersFn,
    DenseLayerParts,
    KernelBackend,
    PrefillLayersFn,
    torch_backend,
)
from ferrum_kernels.layers import TiedLinear, rms_norm
from torch import nn

from ferrum_server.models.causal_lm import CausalLM
from ferrum_server.models.config import Llama3RopeScaling, LongRopeScaling, ModelConfig
from ferrum_server.models.moe import SparseMoeBlock, expert_tensor_names
from ferrum_server.parallel.group import SINGLE_RANK, TensorParallel
from ferrum_server.parallel.layers import (
    ParallelLMHead,
    column_linear,
    row_linear,
    vocab_embedding,
)
from ferrum_server.parallel.sharding import attention_shard, check_tensor_parallel


@dataclass(frozen=True, slots=True)
class WeightEntry:
    """One parameter of ours and the HF tensors concatenated (along dim 0) to fill it."""

    name: str
    hf_names: tuple[str, ...]
    split_sizes: tuple[int, ...]  # rows each HF tensor contributes, same order as hf_names


def weight_map(config: ModelConfig) -> list[WeightEntry]:
    """Our parameter names in a fixed order, with the HF names that back each one."""
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    # Phi-3 checkpoints hold qkv_proj and gate_up_proj as single tensors, rows in our order.
    hf_fused = config.model_type == "phi3"
    entries = [WeightEntry("embed_tokens.weight", ("model.embed_tokens.weight",), (0,))]
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        attn = hf + "self_attn."
        entries.append(
            WeightEntry(ours + "input_layernorm.weight", (hf + "input_layernorm.weight",), (0,))
        )
        qkv = tuple(attn + p for p in ("q_proj", "k_proj", "v_proj"))
        if hf_fused:
            entries.append(WeightEntry(ours + "qkv_proj.weight", (attn + "qkv_proj.weight",), (0,)))
        else:
            entries.append(
                WeightEntry(
                    ours + "qkv_proj.weight",
                    tuple(n + ".weight" for n in qkv),
                    (q_out, kv_out, kv_out),
                )
            )
        if config.attention_bias:
            entries.append(
                WeightEntry(
                    ours + "qkv_proj.bias", tuple(n + ".bias" for n in qkv), (q_out, kv_out, kv_out)
                )
            )
        entries.append(WeightEntry(ours + "o_proj.weight", (attn + "o_proj.weight",), (0,)))
        if config.o_proj_bias:
            entries.append(WeightEntry(ours + "o_proj.bias", (attn + "o_proj.bias",), (0,)))
        if config.qk_norm:
            entries.append(WeightEntry(ours + "q_norm.weight", (attn + "q_norm.weight",), (0,)))
            entries.append(WeightEntry(ours + "k_norm.weight", (attn + "k_norm.weight",), (0,)))
        entries.append(
            WeightEntry(
                ours + "post_attention_layernorm.weight",
                (hf + "post_attention_layernorm.weight",),
                (0,),
            )
        )
        if config.is_sparse_layer(i):
            entries += _expert_entries(config, ours, hf)
            continue
        if hf_fused:
            entries.append(
                WeightEntry(ours + "gate_up_proj.weight", (hf + "mlp.gate_up_proj.weight",), (0,))
            )
        else:
            entries.append(
                WeightEntry(
                    ours + "gate_up_proj.weight",
                    (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                    (inter, inter),
                )
            )
        entries.append(WeightEntry(ours + "down_proj.weight", (hf + "mlp.down_proj.weight",), (0,)))
    entries.append(WeightEntry("norm.weight", ("model.norm.weight",), (0,)))
    if not config.tie_word_embeddings:
        entries.append(WeightEntry("lm_head.weight", ("lm_head.weight",), (0,)))
    return entries


def _expert_entries(config: ModelConfig, ours: str, hf: str) -> list[WeightEntry]:
    """A sparse layer's router and stacked experts (each expert's tensors stacked row-wise)."""
    assert config.moe is not None
    names = expert_tensor_names(config.model_type, hf, config.moe.num_experts)
    inter, h = config.moe.expert_intermediate_size, config.hidden_size
    return [
        WeightEntry(ours + "moe.gate.weight", (names.router,), (0,)),
        WeightEntry(
            ours + "moe.experts.gate_up_proj", names.gate_up, (inter,) * len(names.gate_up)
        ),
        WeightEntry(ours + "moe.experts.down_proj", names.down, (h,) * len(names.down)),
    ]


def hf_tensor_shapes_of(model: LlamaForCausalLM) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name ``model`` needs (build it on the meta device), with its shape."""
    params = dict(model.named_parameters())
    shapes: dict[str, tuple[int, ...]] = {}
    for entry in model.weight_map():
        full = tuple(params[entry.name].shape)
        if len(entry.hf_names) == 1:
            shapes[entry.hf_names[0]] = full
        else:
            for hf_name, rows in zip(entry.hf_names, entry.split_sizes, strict=True):
                shapes[hf_name] = (rows, *full[1:])
    return shapes


def rope_inv_freq(config: ModelConfig, max_sequence_length: int | None = None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, computed exactly as transformers does.
    ``max_sequence_length``: the longest sequence served (default: the model's positions), which
    picks LongRoPE's factors (``LongRopeScaling.long_factors_for``)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float32) / dim
    s = config.rope_scaling
    if isinstance(s, LongRopeScaling):
        longest = max_sequence_length or config.max_position_embeddings
        factors = s.long_factor if s.long_factors_for(longest) else s.short_factor
        ext = torch.tensor(factors, dtype=torch.float32)  # [D/2]
        return 1.0 / (ext * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)  # [D/2]
    if isinstance(s, Llama3RopeScaling):
        inv_freq = _llama3_scale(inv_freq, s)
    return inv_freq


def rope_attention_scaling(config: ModelConfig) -> float:
    """What transformers multiplies the cos/sin tables by (1 but for LongRoPE)."""
    s = config.rope_scaling
    if isinstance(s, LongRopeScaling):
        return s.attention_scaling(config.max_position_embeddings)
    return 1.0


def _llama3_scale(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between them is
    # interpolated smoothly; the op order mirrors transformers so the floats agree.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(
    inv_freq: torch.Tensor, max_positions: int, device: torch.device, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_positions, D/2] float32 tables of one set of inverse frequencies, times
    the attention scaling of a rope variant (LongRoPE's; 1.0 otherwise)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    if scaling != 1.0:  # as transformers scales them: in float32, before any cast
        cos, sin = cos * scaling, sin * scaling
    return cos.to(device), sin.to(device)


# What a model runs with until a backend is bound: transformers' numerics on any device.
_REFERENCE = torch_backend()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    # The model's backend, set by LlamaForCausalLM.bind_backend (a plain attribute, not state).
    backend: KernelBackend
    # The backend's whole-layer decode step for this layer (bind_decode_layer), or None.
    decode_layer: DecodeLayerFn | None
    # The norm every RMSNorm of the layer is built with (Gemma's layers use their (1 + w) kind).
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | None,
        window: int = 0,
        sparse: bool = False,
        tp: TensorParallel = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.backend = _REFERENCE
        self.decode_layer = None
        h, d = config.hidden_size, config.head_dim
        # This rank's heads (all of them on one rank): query heads split evenly, KV heads split
        # or replicated so that every local query head's KV head is local (parallel.sharding).
        heads = attention_shard(config.num_heads, config.num_kv_heads, tp.rank, tp.world_size)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_heads, heads.kv_heads, d
        self.split = tp.is_parallel  # o and the MLP's down projection all-reduce
        inter = config.intermediate_size // tp.world_size
        self.scale = d**-0.5
        # This layer's sliding window (0 = global), handed to every attention call.
        self.window = window
        norm = self.norm_class
        self.input_layernorm = norm(h, config.rms_norm_eps, dtype=dtype, device=device)
        # Column-parallel q/k/v (this rank's heads), row-parallel o: one all-reduce per layer.
        self.qkv_proj = column_linear(
            h,
            (self.num_heads + 2 * self.num_kv_heads) * d,
            bias=config.attention_bias,
            tp=tp,
            dtype=dtype,
            device=device,
        )
        self.o_proj = row_linear(
            self.num_heads * d, h, bias=config.o_proj_bias, tp=tp, dtype=dtype, device=device
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = norm(d, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = norm(d, config.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = norm(h, config.rms_norm_eps, dtype=dtype, device=device)
        # The MLP: a sparse layer's experts (moe), else the dense gate/up and down projections.
        # Both split over the ranks by intermediate columns, each with one all-reduce.
        self.moe: SparseMoeBlock | None = None
        self.gate_up_proj: nn.Module | None = None
        self.down_proj: nn.Module | None = None
        if sparse:
            assert config.moe is not None
            self.moe = SparseMoeBlock(config.moe, h, dtype=dtype, device=device, tp=tp)
        else:
            # Column-parallel gate/up (this rank's gate rows, then its up rows), row-parallel
            # down: SwiGLU runs on the local columns, one all-reduce after down.
            self.gate_up_proj = column_linear(
                h, 2 * inter, bias=False, tp=tp, dtype=dtype, device=device
            )
            self.down_proj = row_linear(inter, h, bias=False, tp=tp, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the previous layer's output (embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream, None for layer 0
        cos: torch.Tensor,  # [T, head_dim/2]
        sin: torch.Tensor,  # [T, head_dim/2]
        kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
        meta: AttentionMetadata,
        outputs: OutputRows | None = None,  # the model's last layer: the rows it must finish
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's output [T, hidden], residual stream [T, hidden]); the layer's
        result is their sum, which the next norm forms (fused with it where a kernel can).
        With ``outputs``, every row's K/V is written as always, and both come back for the
        output rows alone ([R, hidden]): the rest of the layer runs only for them."""
        if self.decode_layer is not None and outputs is None:
            done = self.decode_layer(hidden, residual, cos, sin, kv_layer, meta)
            if done is not None:
                return done
        kernels = self.backend
        norm = self.input_layernorm
        x, residual = kernels.rms_norm_residual(hidden, residual, norm.weight, norm.eps)
        attention = self._attention(x, cos, sin, kv_layer, meta, outputs)
        if outputs is not None:
            residual = residual[outputs.rows]  # [R, hidden]
            if not outputs.count:
                return attention, residual  # [0, hidden] each
        norm = self.post_attention_layernorm
        x, residual = kernels.rms_norm_residual(attention, residual, norm.weight, norm.eps)
        if self.moe is not None:
            return self.moe(x, kernels.fused_moe), residual  # [T, hidden]
        assert self.gate_up_proj is not None and self.down_proj is not None
        # silu(gate) * up [T, I]: one GEMM where the backend fuses it (no [T, 2I] written).
        act = kernels.gate_up_silu(self.gate_up_proj, x)
        mlp_out: torch.Tensor = self.down_proj(act)  # [T, hidden]
        return mlp_out, residual

    def bind_decode_layer(self) -> None:
        """Take the backend's whole-layer decode step where it has one for this layer (after
        the backend prepared the weights): a dense layer computing exactly what `forward`
        does through the backend's functions."""
        parts = self.dense_parts()
        factory = self.backend.decode_layer
        self.decode_layer = factory(parts) if factory is not None and parts is not None else None

    def dense_parts(self) -> DenseLayerParts | None:
        """This layer as `DenseLayerParts` when `forward` is exactly norm, qkv, rotary, global
        attention, o, norm and a SwiGLU MLP, on one rank; else None. Subclasses (other norms,
        activations, soft caps) have none."""
        if (
            type(self) is not DecoderLayer
            or self.split
            or type(self.input_layernorm) is not RMSNorm
            or type(self.post_attention_layernorm) is not RMSNorm
            or self.q_norm is not None
            or self.window
            or self.moe is not None
            or self.gate_up_proj is None
            or self.down_proj is None
        ):
            return None
        return DenseLayerParts(
            input_norm_weight=self.input_layernorm.weight,
            input_norm_eps=self.input_layernorm.eps,
            post_norm_weight=self.post_attention_layernorm.weight,
            post_norm_eps=self.post_attention_layernorm.eps,
            qkv_proj=self.qkv_proj,
            o_proj=self.o_proj,
            gate_up_proj=self.gate_up_proj,
            down_proj=self.down_proj,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scale=self.scale,
        )

    def _attention(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        outputs: OutputRows | None = None,
    ) -> torch.Tensor:
        """-> [T, hidden], or [R, hidden] for the output rows alone (``outputs``), every row's
        K/V written either way."""
        kernels = self.backend
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if outputs is not None and outputs.meta is None:
            # No row is used (prompt chunks, none of them final): only the K/V write is left,
            # so the projection computes its k and v columns alone, never q.
            kv = kernels.output_columns(self.qkv_proj, x, h * d)  # [T, 2Hkv * D]
            k = kv[:, : hkv * d].reshape(t, hkv, d)  # [T, Hkv, D]
            v = kv[:, hkv * d :].reshape(t, hkv, d)
            if self.q_norm is not None and self.k_norm is not None:
                k = self.k_norm(k)
            _, k = kernels.rotary(k[:, :0], k, cos, sin)  # k alone (no query heads)
            kernels.write_kv(kv_layer, k, v, meta.slot_mapping)
            return x[:0]  # [0, hidden]
        qkv = self.qkv_proj(x)  # [T, (H + 2Hkv) * D]
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        q = q.reshape(t, h, d)  # [T, H, D]
        k = k.reshape(t, hkv, d)  # [T, Hkv, D]
        v = v.reshape(t, hkv, d)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = kernels.rotary(q, k, cos, sin)  # may rotate in place (q, k are views of qkv)
        if outputs is not None:
            # Every row's K/V, then attention for the output rows only (their K/V written once
            # more by the call, the same values): no other row's attention output is used.
            kernels.write_kv(kv_layer, k, v, meta.slot_mapping)
            rows = outputs.rows
            assert outputs.meta is not None  # (no output row returned above)
            q, k, v, meta, t = q[rows], k[rows], v[rows], outputs.meta, outputs.count
        o = self._attend(q, k, v, kv_layer, meta)  # [T, H, D]; writes K/V
        out: torch.Tensor = self.o_proj(o.reshape(t, h * d))  # [T, hidden]
        return out

    def _attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The backend's attention (KV write included) with this layer's scale and window."""
        return self.backend.attention(q, k, v, kv_layer, meta, self.scale, window=self.window)


class LlamaForCausalLM(CausalLM):
    # What the layers and the final norm are built from (the Gemma model swaps both).
    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        tp: TensorParallel = SINGLE_RANK,
    ) -> None:
        super().__init__()
        check_tensor_parallel(config, tp.world_size)
        self.config = config
        self.tp = tp
        self.embed_tokens = vocab_embedding(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(
            self.layer_class(
                config,
                dtype=dtype,
                device=device,
                window=config.layer_window(i),
                sparse=config.is_sparse_layer(i),
                tp=tp,
            )
            for i in range(config.num_layers)
        )
        self.kv_heads = attention_shard(
            config.num_heads, config.num_kv_heads, tp.rank, tp.world_size
        ).kv_heads
        self.norm = self.norm_class(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.lm_head: nn.Module | None = None
        self.tied_head: TiedLinear | None = None  # the embedding table as the LM head
        # Every layer's decode-only step in one function (bind_backend), or None.
        self.decode_layers: DecodeLayersFn | None = None
        # Every layer but the last of a prompt-only step in one function (bind_backend), or None.
        self.prefill_layers: PrefillLayersFn | None = None
        if tp.is_parallel:
            # This rank's vocabulary rows (its embedding shard when tied), logits gathered.
            local: nn.Module = (
                TiedLinear(self.embed_tokens)
                if config.tie_word_embeddings
                else nn.Linear(
                    config.hidden_size,
                    self.embed_tokens.num_embeddings,
                    bias=False,
                    dtype=dtype,
                    device=device,
                )
            )
            self.lm_head = ParallelLMHead(local, config.vocab_size, tp)
        elif config.tie_word_embeddings:
            self.tied_head = TiedLinear(self.embed_tokens)
        else:
            self.lm_head = nn.Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device
            )
        # Half-width tables (the HF table repeats them across both halves). Kept in float32:
        # they are cast to the activation dtype at use, as transformers does.
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        # The longest sequence served, which picks LongRoPE's factors (see reset_rope_cache).
        self.max_sequence_length = config.max_position_embeddings
        self.reset_rope_cache(device)
        self._backend = _REFERENCE  # a plain attribute, not registered state

    @property
    def backend(self) -> KernelBackend:
        """The kernels every forward runs with (see bind_backend)."""
        return self._backend

    def bind_backend(self, backend: KernelBackend) -> int:
        """Run every later forward with `backend`, after its ``prepare_model`` step has put the
        weights in the form it wants (the CPU backend pre-packs every linear, the LM head
        included, for oneDNN). Idempotent; returns how many weights this call prepared (0 when
        there was nothing left to do). Binding another backend later leaves prepared weights
        as they are: packed linears compute what ``F.linear`` does (to float rounding) and fall
        back to it off CPU, so no order of bindings runs a model wrongly."""
        self._backend = backend
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.backend = backend
        prepared = backend.prepare_model(self) if backend.prepare_model is not None else 0
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.bind_decode_layer()  # over the weights as prepared
        # Every layer's, in one function: only where each layer has its own (a layer without
        # one, None here, keeps the layers one by one) and `forward` is this class's.
        factory = backend.decode_layers
        fns = [getattr(layer, "decode_layer", None) for layer in self.layers]
        ours = type(self).forward is LlamaForCausalLM.forward
        self.decode_layers = factory(fns) if factory is not None and ours else None
        prefill = backend.prefill_layers
        self.prefill_layers = prefill(fns) if prefill is not None and ours else None
        return prepared

    def reset_rope_cache(
        self, device: torch.device | None = None, max_sequence_length: int | None = None
    ) -> None:
        """(Re)compute the RoPE tables, e.g. after materialising a meta-device model, or for a
        server admitting sequences of at most ``max_sequence_length`` tokens (kept for later
        calls): with LongRoPE that length picks the long or the short factors."""
        if device is None:
            device = self.embed_tokens.weight.device
        if max_sequence_length is not None:
            self.max_sequence_length = max_sequence_length
        # [D/2], always on CPU so every device agrees
        inv_freq = rope_inv_freq(self.config, self.max_sequence_length)
        self.rope_cos, self.rope_sin = rope_tables(
            inv_freq,
            self.config.max_position_embeddings,
            device,
            rope_attention_scaling(self.config),
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        meta: AttentionMetadata,
        outputs: OutputRows | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for every query row of the batch, or
        [R, hidden] for the output rows alone (``outputs``: the last layer then finishes only
        those rows; see ``OutputRows``)."""
        hidden: torch.Tensor = self.embed_tokens(input_ids)  # [T, hidden]
        cos = self.rope_cos[positions].to(hidden.dtype)  # [T, D/2]
        sin = self.rope_sin[positions].to(hidden.dtype)  # [T, D/2]
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        first = 0  # the first layer left to run one by one
        ran = None
        if self.decode_layers is not None and outputs is None:
            # Every layer in one call where the backend has one and it serves this step.
            ran, ran_to = self.decode_layers(hidden, cos, sin, kv_cache, meta), last + 1
        elif self.prefill_layers is not None and outputs is not None:
            # A prompt step: every layer but the last in one call, where it serves the step;
            # the last (below) finishes only the output rows.
            ran, ran_to = self.prefill_layers(hidden, cos, sin, kv_cache, meta), last
        if ran is not None:
            (hidden, residual), first = ran, ran_to
        for i in range(first, last + 1):
            keep = outputs if i == last else None
            hidden, residual = self.layers[i](hidden, residual, cos, sin, kv_cache[i], meta, keep)
        if not hidden.shape[0]:
            return hidden  # no output row
        norm = self.norm
        return self._backend.rms_norm_residual(hidden, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        assert head is not None  # exactly one of the two exists
        return self._backend.float32_logits(head, hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``compute_logits``' argmax and log-probability per row, folded by the LM head's GEMM
        where the backend can (one rank: a split head's logits are gathered first)."""
        if self.tp.is_parallel:
            return None
        head = self.lm_head if self.lm_head is not None else self.tied_head
        assert head is not None  # exactly one of the two exists
        return self._backend.greedy_logits(head, hidden)

    def weight_map(self) -> list[WeightEntry]:
        """Our parameter names with the HF tensors behind each (see ``weight_map``)."""
        return weight_map(self.config)

    @torch.no_grad()
    def load_hf_weights(self, get_tensor: Callable[[str], torch.Tensor]) -> None:
        """Fill every parameter from HF-named tensors (names/shapes validated by the caller).
        A split model reads only its slices instead (``weight_shards.load_shards``)."""
        self._require_whole("load_hf_weights")
        params = dict(self.named_parameters())
        for entry in self.weight_map():
            param = params[entry.name]
            if len(entry.hf_names) == 1:
                param.copy_(get_tensor(entry.hf_names[0]))
                continue
            offset = 0
            for hf_name, rows in zip(entry.hf_names, entry.split_sizes, strict=True):
                param[offset : offset + rows].copy_(get_tensor(hf_name))
                offset += rows

    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under HF names (fused tensors split back), as views of our weights."""
        self._require_whole("hf_state_dict")
        params = dict(self.named_parameters())
        out: dict[str, torch.Tensor] = {}
        for entry in self.weight_map():
            param = params[entry.name].detach()
            if param.numel() == 0:
                raise RuntimeError(
                    f"{entry.name} holds no plain weight: this model was prepared for serving "
                    "(release_plain_weights) and cannot be exported"
                )
            if len(entry.hf_names) == 1:
                out[entry.hf_names[0]] = param
                continue
            parts = torch.split(param, list(entry.split_sizes), dim=0)
            out.update(zip(entry.hf_names, parts, strict=True))
        return out

    def _require_whole(self, what: str) -> None:
        if self.tp.is_parallel:
            raise ValueError(
                f"{what} needs the whole model; this is rank {self.tp.rank} of "
                f"{self.tp.world_size} (load with weight_shards.load_shards)"
            )

"""Gemma 2 and Gemma 3 (text) decoders, built on the Llama-family model (``llama.py``).

What differs from Llama, each in transformers' op order (``Gemma2*`` / ``Gemma3*`` modules):

* every RMSNorm is Gemma's: ``x / rms(x) * (1 + w)`` in float32, cast back once at the end
  (``layers.gemma_rms_norm``, run with torch ops on every backend: the fused norm kernels cast
  before the weight, and a precomputed ``1 + w`` stored in bfloat16 would round);
* embeddings are multiplied by sqrt(hidden), rounded to the activation dtype first;
* each layer adds a norm after attention and one before and one after the MLP, which is a
  GeGLU with the tanh-approximated GELU;
* attention is scaled by ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps the attention
  logits (the backends' ``softcap`` argument) and Gemma 2 (and Gemma 3 when set) the final
  logits;
* sliding-window layers follow ``layer_types``; Gemma 3 has q/k norms and RoPE tables of its
  own for the sliding layers (``rope_local_base_freq``) and the global ones (``rope_theta``,
  with linear scaling where configured).

The LM head is tied to the embeddings unless the config says otherwise (``LlamaForCausalLM``'s
``TiedLinear``), and the layers' linears are plain ``nn.Linear``, so the CPU backend's
``prepare_model`` packs them as it does Llama's.

Split over tensor-parallel ranks (``tp``), everything is split as Llama's is, by the same
``DecoderLayer`` code: heads (KV heads replicated when the ranks outnumber them), the GeGLU's
gate/up rows and down columns, the vocabulary rows of the embedding and of the (tied) head.
What Gemma adds is per element or per head, so it runs unchanged on a rank's part: the
sqrt(hidden) scale multiplies the all-reduced embeddings, the attention soft-cap and the
sliding windows apply per head, the q/k norms are one ``[head_dim]`` weight every head shares
(whole on every rank), the four norms per layer see the whole hidden state, and the final
soft-cap applies to the gathered logits.
"""

from __future__ import annotations

import functools

import torch
from ferrum_kernels.attention import AttentionMetadata, OutputRows
from ferrum_kernels.layers import gelu_tanh_and_mul, gemma_rms_norm, soft_cap

from ferrum_server.models.config import ModelConfig
from ferrum_server.models.gemma_spec import GemmaSpec
from ferrum_server.models.llama import (
    DecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    WeightEntry,
    rope_tables,
    weight_map,
)
from ferrum_server.parallel.group import SINGLE_RANK, TensorParallel

__all__ = ["GemmaDecoderLayer", "GemmaForCausalLM", "GemmaRMSNorm", "gemma_weight_map"]


def _spec(config: ModelConfig) -> GemmaSpec:
    if config.gemma is None:
        raise ValueError(f"{config.architecture} is not a Gemma model")
    return config.gemma


def gemma_weight_map(config: ModelConfig) -> list[WeightEntry]:
    """The Llama-family map plus each layer's pre- and post-feedforward norms."""
    entries = weight_map(config)
    for i in range(config.num_layers):
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            name = f"{norm}.weight"
            entries.append(WeightEntry(f"layers.{i}.{name}", (f"model.layers.{i}.{name}",), (0,)))
    return entries


def linear_rope_inv_freq(head_dim: int, theta: float, factor: float) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies with linear scaling, as transformers computes
    them (``factor`` 1 is plain RoPE)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    return inv_freq / factor if factor != 1.0 else inv_freq


@functools.lru_cache(maxsize=16)
def embedding_normalizer(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) rounded to ``dtype``, as transformers' scaled embedding multiplies by it
    (in bfloat16, sqrt(3072) = 55.43 becomes 55.5)."""
    return float(torch.tensor(hidden_size**0.5, dtype=torch.float32).to(dtype))


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: weight 0 is the identity (it scales by 1 + w)."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | None):
        super().__init__(size, eps, dtype=dtype, device=device)
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


class GemmaDecoderLayer(DecoderLayer):
    norm_class = GemmaRMSNorm

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
        # Heads and MLP columns split over tp's ranks exactly as Llama's (DecoderLayer).
        super().__init__(config, dtype=dtype, device=device, window=window, sparse=sparse, tp=tp)
        spec = _spec(config)
        self.scale = spec.attention_scale
        self.softcap = spec.attn_logit_softcap  # 0 = none
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, device=device)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the previous layer's output (embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream, None for layer 0
        cos: torch.Tensor,  # [T, head_dim/2]: this layer's (local or global) RoPE
        sin: torch.Tensor,  # [T, head_dim/2]
        kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
        meta: AttentionMetadata,
        outputs: OutputRows | None = None,  # the model's last layer: the rows it must finish
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's output [T, hidden], residual stream [T, hidden]), whose sum is the
        layer's result, as in ``DecoderLayer`` (and for the output rows alone with
        ``outputs``)."""
        stream = hidden if residual is None else residual + hidden  # [T, hidden]
        x = self.input_layernorm(stream)
        attention = self._attention(x, cos, sin, kv_layer, meta, outputs)
        if outputs is not None:
            stream = stream[outputs.rows]  # [R, hidden]
            if not outputs.count:
                return attention, stream  # [0, hidden] each
        stream = stream + self.post_attention_layernorm(attention)
        assert self.gate_up_proj is not None and self.down_proj is not None  # never sparse
        gate_up = self.gate_up_proj(self.pre_feedforward_layernorm(stream))  # [T, 2I]
        mlp_out = self.down_proj(gelu_tanh_and_mul(gate_up))  # [T, hidden]
        return self.post_feedforward_layernorm(mlp_out), stream

    def _attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if not self.softcap:
            return super()._attend(q, k, v, kv_layer, meta)
        # Passed only when set, so an attention provider without softcap serves Gemma 3.
        return self.backend.attention(
            q, k, v, kv_layer, meta, self.scale, window=self.window, softcap=self.softcap
        )


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm
    # The sliding layers' RoPE tables (rope_cos / rope_sin serve the global layers).
    rope_local_cos: torch.Tensor
    rope_local_sin: torch.Tensor

    @property
    def spec(self) -> GemmaSpec:
        return _spec(self.config)

    def reset_rope_cache(
        self, device: torch.device | None = None, max_sequence_length: int | None = None
    ) -> None:
        """(Re)compute the global layers' RoPE tables and the sliding layers' own (Gemma's
        rope variants do not depend on the served sequence length)."""
        if max_sequence_length is not None:
            self.max_sequence_length = max_sequence_length
        if device is None:
            device = self.embed_tokens.weight.device
        spec, cfg = self.spec, self.config
        tables = {
            "rope": (cfg.rope_theta, spec.rope_global_factor),
            "rope_local": (spec.rope_local_theta, spec.rope_local_factor),
        }
        built: dict[tuple[float, float], tuple[torch.Tensor, torch.Tensor]] = {}
        for prefix, (theta, factor) in tables.items():
            if (theta, factor) not in built:  # Gemma 2: one pair of tables serves every layer
                inv_freq = linear_rope_inv_freq(cfg.head_dim, theta, factor)  # [D/2] on CPU
                built[theta, factor] = rope_tables(inv_freq, cfg.max_position_embeddings, device)
            cos, sin = built[theta, factor]
            # Registered (again) so .to() moves them; float32, cast to the activations at use.
            self.register_buffer(f"{prefix}_cos", cos, persistent=False)
            self.register_buffer(f"{prefix}_sin", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        meta: AttentionMetadata,
        outputs: OutputRows | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for every query row of the batch, or
        [R, hidden] for the output rows alone (as ``LlamaForCausalLM.forward``)."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        hidden = hidden * embedding_normalizer(self.config.hidden_size, hidden.dtype)
        dtype = hidden.dtype
        global_rope = (self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype))
        local_rope = (
            self.rope_local_cos[positions].to(dtype),
            self.rope_local_sin[positions].to(dtype),
        )  # [T, D/2] each
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            cos, sin = local_rope if self.spec.sliding_layers[i] else global_rope
            keep = outputs if i == last else None
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache[i], meta, keep)
        assert residual is not None  # a model has at least one layer
        final: torch.Tensor = self.norm(residual + hidden)
        return final

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits, soft-capped in the activation dtype as
        transformers does when the config sets final_logit_softcapping."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        assert head is not None  # exactly one of the two exists
        if not self.spec.final_logit_softcap:
            return self.backend.float32_logits(head, hidden)
        logits = soft_cap(head(hidden), self.spec.final_logit_softcap)
        return logits.float()

    def greedy_tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As Llama's, but not over soft-capped logits: their log-normaliser is not the head's
        (the caller then samples ``compute_logits``)."""
        if self.spec.final_logit_softcap:
            return None
        return super().greedy_tokens(hidden)

    def weight_map(self) -> list[WeightEntry]:
        return gemma_weight_map(self.config)

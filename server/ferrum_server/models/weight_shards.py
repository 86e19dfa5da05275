"""Which slices of the HF checkpoint tensors fill one rank's parameters, and the load itself.

A split model (``LlamaForCausalLM(config, tp=...)``, or ``GemmaForCausalLM``, at world size
> 1) reads only its own rows or columns of each checkpoint tensor: through ``read_slice`` a
safetensors file serves them without the whole tensor ever being materialised. Per parameter
of the model's ``weight_map()``:

* ``qkv_proj`` (weight and bias): this rank's query heads' rows of q, its KV heads' rows of k
  and of v, in that order (from the one fused tensor at its q/k/v offsets for Phi-3);
* ``gate_up_proj``: this rank's rows of gate, then the same rows of up;
* ``o_proj`` / ``down_proj`` weights: this rank's input columns (their bias is whole);
* a sparse layer's ``moe.experts.gate_up_proj``: per expert, its rows of that expert's gate
  (w1) then the same rows of its up (w3); ``moe.experts.down_proj``: per expert, its columns of
  that expert's down (w2), stacked;
* ``embed_tokens`` / ``lm_head``: this rank's block of vocabulary rows, the padding rows past
  the real vocabulary left zero;
* everything else (norms, Gemma's four per layer, the per-head q/k norms every head shares, a
  MoE router): whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ferrum_server.models.config import ModelConfig
from ferrum_server.models.llama import LlamaForCausalLM, WeightEntry
from ferrum_server.parallel.group import TensorParallel
from ferrum_server.parallel.sharding import (
    attention_shard,
    check_tensor_parallel,
    even_shard,
    vocab_shard,
)

# (HF name, dim, start, length) -> that slice of the checkpoint tensor; length None: all of it.
ReadSlice = Callable[[str, int, int, int | None], torch.Tensor]


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """``length`` rows (dim 0) or columns (dim 1) of a checkpoint tensor from ``start``
    (length None: the whole tensor)."""

    hf_name: str
    dim: int
    start: int
    length: int | None


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One parameter of a rank and the slices concatenated along dim 0 to fill it (a dim-1
    slice, a row-parallel weight's columns, brings all of its tensor's rows); rows past them
    are vocabulary padding."""

    name: str
    slices: tuple[TensorSlice, ...]


def shard_weight_map(model: LlamaForCausalLM) -> list[ShardEntry]:
    """``model.weight_map()`` as rank ``model.tp.rank`` of ``model.tp.world_size`` reads it
    (a meta-device model serves: only its config, split and parameter names are used)."""
    config, tp = model.config, model.tp
    check_tensor_parallel(config, tp.world_size)
    return [_shard(entry, config, tp) for entry in model.weight_map()]


def _shard(entry: WeightEntry, config: ModelConfig, tp: TensorParallel) -> ShardEntry:
    name, d = entry.name, config.head_dim
    heads = attention_shard(config.num_heads, config.num_kv_heads, tp.rank, tp.world_size)
    inter_start, inter_len = even_shard(config.intermediate_size, tp.rank, tp.world_size)

    def rows(hf_name: str, start: int, length: int) -> TensorSlice:
        return TensorSlice(hf_name, 0, start, length)

    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        q_rows = (heads.q_start * d, heads.q_heads * d)
        kv_rows = (heads.kv_start * d, heads.kv_heads * d)
        if len(entry.hf_names) == 1:  # Phi-3: q, k, v stacked in one tensor
            (fused,) = entry.hf_names
            k_at, v_at = config.num_heads * d, (config.num_heads + config.num_kv_heads) * d
            return ShardEntry(
                name,
                (
                    rows(fused, q_rows[0], q_rows[1]),
                    rows(fused, k_at + kv_rows[0], kv_rows[1]),
                    rows(fused, v_at + kv_rows[0], kv_rows[1]),
                ),
            )
        q, k, v = entry.hf_names
        return ShardEntry(name, (rows(q, *q_rows), rows(k, *kv_rows), rows(v, *kv_rows)))
    if name.endswith("gate_up_proj.weight"):
        if len(entry.hf_names) == 1:  # Phi-3: gate rows then up rows in one tensor
            (fused,) = entry.hf_names
            up_at = config.intermediate_size
            return ShardEntry(
                name,
                (rows(fused, inter_start, inter_len), rows(fused, up_at + inter_start, inter_len)),
            )
        gate, up = entry.hf_names
        return ShardEntry(
            name, (rows(gate, inter_start, inter_len), rows(up, inter_start, inter_len))
        )
    if name.endswith("moe.experts.gate_up_proj"):  # (gate, up) of expert 0, then of 1, ...
        assert config.moe is not None
        start, length = even_shard(config.moe.expert_intermediate_size, tp.rank, tp.world_size)
        return ShardEntry(name, tuple(rows(n, start, length) for n in entry.hf_names))
    if name.endswith("moe.experts.down_proj"):  # each expert's [hidden, I] down: its columns
        assert config.moe is not None
        start, length = even_shard(config.moe.expert_intermediate_size, tp.rank, tp.world_size)
        return ShardEntry(name, tuple(TensorSlice(n, 1, start, length) for n in entry.hf_names))
    (hf_name,) = entry.hf_names
    if name.endswith("o_proj.weight"):
        return ShardEntry(name, (TensorSlice(hf_name, 1, heads.q_start * d, heads.q_heads * d),))
    if name.endswith("down_proj.weight"):
        return ShardEntry(name, (TensorSlice(hf_name, 1, inter_start, inter_len),))
    if name in ("embed_tokens.weight", "lm_head.weight"):
        vocab = vocab_shard(config.vocab_size, tp.rank, tp.world_size)
        real = max(0, min(vocab.rows, config.vocab_size - vocab.start))
        return ShardEntry(name, (rows(hf_name, vocab.start, real),) if real else ())
    return ShardEntry(name, (TensorSlice(hf_name, 0, 0, None),))  # whole on every rank


@torch.no_grad()
def load_shards(model: LlamaForCausalLM, read_slice: ReadSlice) -> None:
    """Fill every parameter of ``model`` (built for its ``tp``) from its checkpoint slices."""
    for entry in shard_weight_map(model):
        param = model.get_parameter(entry.name)
        offset = 0
        for piece in entry.slices:
            tensor = read_slice(piece.hf_name, piece.dim, piece.start, piece.length)
            param[offset : offset + tensor.shape[0]].copy_(tensor)
            offset += tensor.shape[0]
        if offset != param.shape[0]:
            param[offset:].zero_()  # vocabulary padding: never a real token's row

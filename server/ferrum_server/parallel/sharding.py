"""Which part of each split dimension a rank holds, and the check that a model can be split.

Megatron-style tensor parallelism splits the query heads, the KV heads, the MLP's intermediate
size (every expert's, for a mixture-of-experts model) and the (padded) vocabulary over the
ranks; the hidden size, the norms and a MoE router are never split. KV heads are
split when there are at least as many as ranks, and otherwise replicated: with N ranks and K < N
KV heads, KV head j lives on ranks ``j * N/K .. (j+1) * N/K - 1``. Query heads are always split
evenly, in order, which keeps every GQA group intact: rank r's query heads all read the KV
head(s) rank r holds.

``check_tensor_parallel`` refuses a config that cannot be split, in one line naming the
dimension and the numbers, before any weight is read. It reads only the config's fields, so
this module does not import the models package (which imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ferrum_server.models.config import ModelConfig


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """Raise ValueError (one line) unless ``config``'s model can be split over ``world_size``
    ranks; at world size 1 every model can."""
    if world_size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {world_size}")
    if world_size == 1:
        return
    where = f"tensor parallelism over {world_size} ranks"
    if config.num_heads % world_size:
        raise ValueError(
            f"{where}: num_attention_heads ({config.num_heads}) is not divisible by {world_size}"
        )
    kv = config.num_kv_heads
    if kv % world_size and world_size % kv:
        raise ValueError(
            f"{where}: num_key_value_heads ({kv}) neither divides nor is divisible by {world_size}"
        )
    # The dense MLP's columns (a MoE model with no dense layer has none to split).
    dense = any(not config.is_sparse_layer(i) for i in range(config.num_layers))
    if dense and config.intermediate_size % world_size:
        raise ValueError(
            f"{where}: intermediate_size ({config.intermediate_size}) is not divisible by "
            f"{world_size}"
        )
    # Every expert's intermediate columns are split the same way (the router is whole).
    if config.moe is not None and config.moe.expert_intermediate_size % world_size:
        raise ValueError(
            f"{where}: {expert_intermediate_field(config.model_type)} "
            f"({config.moe.expert_intermediate_size}) is not divisible by {world_size}"
        )


def expert_intermediate_field(model_type: str) -> str:
    """The config.json field that sizes a MoE model's experts (Mixtral: ``intermediate_size``,
    Qwen3-MoE: ``moe_intermediate_size``)."""
    return "intermediate_size" if model_type == "mixtral" else "moe_intermediate_size"


@dataclass(frozen=True, slots=True)
class AttentionShard:
    """One rank's heads: query heads [q_start, q_start + q_heads), KV heads
    [kv_start, kv_start + kv_heads), in the model's head numbering."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


def attention_shard(
    num_heads: int, num_kv_heads: int, rank: int, world_size: int
) -> AttentionShard:
    """The heads ``rank`` holds (dimensions already checked by ``check_tensor_parallel``)."""
    q_heads = num_heads // world_size
    if num_kv_heads >= world_size:
        kv_heads = num_kv_heads // world_size
        kv_start = rank * kv_heads
    else:  # each KV head replicated on world_size / num_kv_heads consecutive ranks
        kv_heads = 1
        kv_start = rank // (world_size // num_kv_heads)
    return AttentionShard(rank * q_heads, q_heads, kv_start, kv_heads)


@dataclass(frozen=True, slots=True)
class VocabShard:
    """One rank's rows [start, start + rows) of the vocabulary padded to ``padded`` (a multiple
    of the ranks); rows at or past the real vocabulary size are padding."""

    start: int
    rows: int
    padded: int


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> VocabShard:
    rows = -(-vocab_size // world_size)  # ceil
    return VocabShard(rank * rows, rows, rows * world_size)


def even_shard(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s equal part of a dimension divisible by ``world_size``."""
    length = size // world_size
    return rank * length, length

"""Megatron-style tensor-parallel layers, and the factories the model builds its layers with.

Each parallel linear keeps its shard as a plain ``nn.Linear`` child (``local``), so a backend's
``prepare_model`` (the CPU backend pre-packs every ``nn.Linear`` for oneDNN) prepares shards
exactly as it prepares whole linears; ``weight`` and ``bias`` name the shard's tensors, so
``Module.get_parameter("...o_proj.weight")`` finds a shard where a whole model has its weight.

* ``ColumnParallelLinear``: output rows split; each rank computes its part of the output and
  keeps it (the next layer consumes the split: attention heads, SwiGLU).
* ``RowParallelLinear``: input columns split; each rank multiplies its part of the input and
  one all-reduce sums the partial products; the bias (whole on every rank) is added once,
  after the reduce.
* ``VocabParallelEmbedding``: the vocabulary padded to a multiple of the ranks, each rank
  holding a contiguous block of rows; ids outside a rank's block read zeros and one all-reduce
  assembles the embeddings.
* ``ParallelLMHead``: each rank's logits for its vocabulary rows, all-gathered so that EVERY
  rank holds the full [N, vocab] logits (padding columns dropped): no rank is special here,
  and the sampler may run wherever the serving integration puts it.

At world size 1 the factories (``column_linear``, ``row_linear``, ``vocab_embedding``) return
the plain ``nn.Linear`` / ``nn.Embedding`` a single-device model has always used, so a model
that is not split runs exactly the modules (and speed) it did before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrum_server.parallel.group import TensorParallel
from ferrum_server.parallel.sharding import vocab_shard

__all__ = [
    "ColumnParallelLinear",
    "ParallelLMHead",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "column_linear",
    "row_linear",
    "vocab_embedding",
]


class ColumnParallelLinear(nn.Module):
    """[.., in] -> [.., out_local]: this rank's output rows of a linear (no communication)."""

    def __init__(
        self,
        in_features: int,
        out_features_local: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        self.local = nn.Linear(
            in_features, out_features_local, bias=bias, dtype=dtype, device=device
        )

    @property
    def weight(self) -> torch.Tensor:
        return self.local.weight  # [out_local, in]

    @property
    def bias(self) -> torch.Tensor | None:
        return self.local.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.local(x)
        return out


class RowParallelLinear(nn.Module):
    """[.., in_local] -> [.., out]: this rank's input columns of a linear, summed over ranks."""

    def __init__(
        self,
        in_features_local: int,
        out_features: int,
        *,
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        self.tp = tp
        # The bias lives outside the shard: added to every rank's partial sum it would count
        # world_size times.
        self.local = nn.Linear(
            in_features_local, out_features, bias=False, dtype=dtype, device=device
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )

    @property
    def weight(self) -> torch.Tensor:
        return self.local.weight  # [out, in_local]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tp.all_reduce(self.local(x))  # [.., out], summed in place
        if self.bias is not None:
            out = out + self.bias
        return out


class VocabParallelEmbedding(nn.Embedding):
    """[T] ids -> [T, hidden]; ``weight`` is this rank's [vocab_padded / N, hidden] rows."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        shard = vocab_shard(vocab_size, tp.rank, tp.world_size)
        super().__init__(shard.rows, hidden_size, dtype=dtype, device=device)
        self.tp = tp
        self.vocab_size = vocab_size
        self.row_start = shard.start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.row_start  # [T]
        outside = (local < 0) | (local >= self.num_embeddings)  # [T] another rank's ids
        local = local.masked_fill(outside, 0)
        out = F.embedding(local, self.weight)  # [T, hidden]
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """[N, hidden] -> [N, vocab]: ``local`` computes this rank's vocabulary rows (an
    ``nn.Linear`` or the embedding shard as a ``TiedLinear``); the ranks' logits are
    all-gathered and the padding columns dropped, so every rank returns the full logits."""

    def __init__(self, local: nn.Module, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.local = local
        self.vocab_size = vocab_size
        self.tp = tp

    @property
    def weight(self) -> torch.Tensor:
        weight = self.local.weight
        assert isinstance(weight, torch.Tensor)
        return weight  # [vocab_padded / N, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local: torch.Tensor = self.local(x)  # [N, vocab_padded / N]
        return self.tp.all_gather(local, dim=-1)[..., : self.vocab_size]  # [N, vocab]


def column_linear(
    in_features: int,
    out_features_local: int,
    *,
    bias: bool,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device | None,
) -> nn.Module:
    """A linear whose output rows are split; at world size 1 the plain ``nn.Linear``."""
    if not tp.is_parallel:
        return nn.Linear(in_features, out_features_local, bias=bias, dtype=dtype, device=device)
    return ColumnParallelLinear(
        in_features, out_features_local, bias=bias, dtype=dtype, device=device
    )


def row_linear(
    in_features_local: int,
    out_features: int,
    *,
    bias: bool,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device | None,
) -> nn.Module:
    """A linear whose input columns are split; at world size 1 the plain ``nn.Linear``."""
    if not tp.is_parallel:
        return nn.Linear(in_features_local, out_features, bias=bias, dtype=dtype, device=device)
    return RowParallelLinear(
        in_features_local, out_features, bias=bias, tp=tp, dtype=dtype, device=device
    )


def vocab_embedding(
    vocab_size: int,
    hidden_size: int,
    *,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device | None,
) -> nn.Embedding:
    """The token embedding; split by vocabulary rows over the ranks, whole at world size 1."""
    if not tp.is_parallel:
        return nn.Embedding(vocab_size, hidden_size, dtype=dtype, device=device)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp=tp, dtype=dtype, device=device)

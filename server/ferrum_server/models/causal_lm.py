"""``CausalLM``: what the runner, start-up, CUDA graphs and profiling need from a model.

Every model class (``LlamaForCausalLM`` and the families built on it, ``GemmaForCausalLM``)
derives from it, so the engine side is annotated with this type and never names a family;
``registry.model_class`` picks the class for a config.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from ferrum_kernels.attention import AttentionMetadata, OutputRows
from ferrum_kernels.backend import KernelBackend
from torch import nn

from ferrum_server.models.config import ModelConfig
from ferrum_server.parallel.group import TensorParallel


class CausalLM(nn.Module):
    """A decoder over a paged KV cache (the methods are implemented by each family)."""

    config: ModelConfig
    embed_tokens: nn.Embedding  # its weight's device and dtype are the model's
    tp: TensorParallel  # this process's rank of the group the model is split over
    kv_heads: int  # KV heads per layer in this rank's pool (config.num_kv_heads on one rank)

    @property
    def backend(self) -> KernelBackend:
        """The kernels every forward runs with (see bind_backend)."""
        raise NotImplementedError

    def bind_backend(self, backend: KernelBackend) -> int:
        """Run later forwards with ``backend`` after its ``prepare_model`` step; returns how
        many weights that step prepared (0 when there was nothing left to do)."""
        raise NotImplementedError

    def reset_rope_cache(
        self, device: torch.device | None = None, max_sequence_length: int | None = None
    ) -> None:
        """(Re)compute the derived non-persistent tables, e.g. after ``to_empty``, or for a
        server admitting at most ``max_sequence_length`` tokens (LongRoPE picks its factors
        from it)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        meta: AttentionMetadata,
        outputs: OutputRows | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for every query row of the batch, or
        [R, hidden] for ``outputs``' rows alone, when given: a model may then skip whatever
        only the other rows' hidden states need (never their K/V)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        raise NotImplementedError

    def greedy_tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """[N, hidden] -> each row's argmax token of ``compute_logits(hidden)`` [N] int64 and
        its log-probability [N] float32, without the logits, where the backend folds them from
        the LM head's GEMM; None (the default) where it does not, and the caller samples
        ``compute_logits(hidden)``."""
        return None

    def load_hf_weights(self, get_tensor: Callable[[str], torch.Tensor]) -> None:
        """Fill every parameter from HF-named tensors (names/shapes validated by the caller)."""
        raise NotImplementedError

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under HF names (fused tensors split back)."""
        raise NotImplementedError

"""A sparse (mixture-of-experts) MLP layer and the checkpoint names of its weights.

The layer is the router (a bias-free linear to one logit per expert), ``ferrum_kernels.moe.route``
(softmax, top-k, renormalisation per the model's spec) and the backend's ``fused_moe`` over the
layer's stacked experts, so each device runs its own grouped-GEMM kernel.

Checkpoints store experts one by one, as transformers' ``save_pretrained`` writes them (it
splits its fused 3-D expert tensors back on save) and as Hub checkpoints are published:

    Mixtral    model.layers.{i}.block_sparse_moe.gate.weight                  [E, H]
               model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2.weight  (gate, up, down)
    Qwen3-MoE  model.layers.{i}.mlp.gate.weight                               [E, H]
               model.layers.{i}.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight

``expert_tensor_names`` lists them in the row order of our stacked parameters.

Split over tensor-parallel ranks (Megatron style, as a dense MLP is split), every rank holds
every expert but only its ``I / N`` intermediate columns of each: the rows of gate and up
(w1/w3) and the columns of down (w2). The router is whole on every rank, and since every
rank's input is the same (the attention's all-reduce left the same sum everywhere) every rank
routes each token to the same experts. Each rank's experts then yield a partial sum of the
layer's output, and one all-reduce per layer (not one per expert) adds them up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ferrum_kernels.backend import FusedMoeFn
from ferrum_kernels.moe import ExpertWeights, route
from torch import nn

from ferrum_server.models.moe_config import MoeSpec
from ferrum_server.parallel.group import SINGLE_RANK, TensorParallel

# Per family: the sparse block's name under a layer and its (gate, up, down) expert weights.
_HF_LAYOUT: dict[str, tuple[str, tuple[str, str, str]]] = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


@dataclass(frozen=True, slots=True)
class ExpertTensorNames:
    """One sparse layer's checkpoint tensors, in the order our parameters stack them."""

    router: str
    gate_up: tuple[str, ...]  # expert 0's gate, expert 0's up, expert 1's gate, ...
    down: tuple[str, ...]  # expert 0's down, expert 1's down, ...


def expert_tensor_names(model_type: str, layer_prefix: str, num_experts: int) -> ExpertTensorNames:
    """``layer_prefix`` is the layer's checkpoint prefix, e.g. ``"model.layers.3."``."""
    block, (gate, up, down) = _HF_LAYOUT[model_type]
    experts = [f"{layer_prefix}{block}.experts.{e}." for e in range(num_experts)]
    return ExpertTensorNames(
        router=f"{layer_prefix}{block}.gate.weight",
        gate_up=tuple(f"{p}{name}.weight" for p in experts for name in (gate, up)),
        down=tuple(f"{p}{down}.weight" for p in experts),
    )


class SparseMoeBlock(nn.Module):
    """[T, hidden] -> [T, hidden]: the weighted sum of each token's top-k experts (on rank r
    of N: every expert with its r-th ``I / N`` intermediate columns, summed over the ranks)."""

    def __init__(
        self,
        spec: MoeSpec,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | None,
        tp: TensorParallel = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = spec.num_experts_per_token
        self.normalize = spec.normalize_top_k
        # Whole on every rank (check_tensor_parallel has checked the experts' split).
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False, dtype=dtype, device=device)
        self.experts = ExpertWeights(
            spec.num_experts,
            hidden_size,
            spec.expert_intermediate_size // tp.world_size,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor, fused_moe: FusedMoeFn) -> torch.Tensor:
        router_logits = self.gate(x)  # [T, E] in x's dtype, as transformers computes them
        weights, ids = route(router_logits, self.top_k, self.normalize)  # [T, K] each
        out = fused_moe(x, self.experts, weights, ids)  # [T, hidden]: this rank's columns' part
        return self.tp.all_reduce(out)  # one all-reduce for every expert (a no-op on one rank)

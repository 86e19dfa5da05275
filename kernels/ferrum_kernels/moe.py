"""Mixture-of-experts MLP: the router (softmax, top-k, optional renormalisation) and the
experts as grouped GEMMs (the torch reference every backend's ``fused_moe`` is tested against).

A sparse layer sends each token to ``top_k`` of ``num_experts`` SwiGLU experts and sums their
outputs weighted by the router. Here the (token, choice) pairs are sorted by expert once (one
stable argsort and one bincount), the token rows are gathered in that order, and each active
expert runs one GEMM over its contiguous run of rows: a loop over experts, never over tokens.

Numerics follow transformers 5's default ("grouped_mm") experts path: the router's softmax is
float32, each expert's output is rounded to the activation dtype, multiplied by its float32
routing weight, and the top-k products are summed in float32 before the final rounding. (Qwen3-MoE's
transformers router rounds the weights to the activation dtype first; keeping them float32 is
more accurate, never less, and identical in float32.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ferrum_kernels.layers import silu_and_mul

__all__ = [
    "ExpertFn",
    "ExpertWeights",
    "Linear",
    "fused_moe_reference",
    "group_by_expert",
    "grouped_experts",
    "route",
]

# (expert index, its rows [n, K]) -> [n, N]: one expert's GEMM.
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]
# rows [n, K] -> [n, N]: a prepared form of one expert weight.
Linear = Callable[[torch.Tensor], torch.Tensor]


class ExpertWeights(nn.Module):
    """One layer's experts, stacked. Stored 2-D, as the checkpoint's per-expert tensors stacked
    row-wise (expert e's gate then up rows, then expert e+1's), so loading is a row copy:

        gate_up_proj [E * 2I, H]  viewed per expert as [E, 2I, H]  (gate rows, then up rows)
        down_proj    [E * H, I]   viewed per expert as [E, H, I]

    ``packed``: a backend's per-expert (gate_up, down) callables computing ``F.linear`` with
    those weights (the CPU backend's packed copies), set by its ``prepare_model`` step;
    None until then; ``packed_from`` is the ``gate_up_proj`` storage they were made from, so a
    model moved or cast afterwards is never run with stale copies. The Parameters stay the
    source of truth (export, other backends) until ``released``: a serving model's plain
    tensors are freed once packed (``cpu_linear.release_plain_weights``), the Parameters are
    left empty and ``packed`` is all there is, so anything wanting the plain weights (the
    stacked views, hence the reference and Triton experts; export) raises instead."""

    packed: tuple[tuple[Linear, Linear], ...] | None
    packed_from: int
    released: bool

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e * 2 * i, h, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(e * h, i, dtype=dtype, device=device))
        self.packed = None
        self.packed_from = 0
        self.released = False

    def is_packed(self) -> bool:
        """True when ``packed`` holds copies of the current weights: made from this storage, or
        the only copies left (released), never to be re-made."""
        if self.packed is None:
            return False
        return self.released or self.packed_from == self.gate_up_proj.data_ptr()

    def gate_up_stack(self) -> torch.Tensor:
        """[E, 2I, H] view."""
        self._require_plain()
        return self.gate_up_proj.view(self.num_experts, 2 * self.intermediate_size, -1)

    def down_stack(self) -> torch.Tensor:
        """[E, H, I] view."""
        self._require_plain()
        return self.down_proj.view(self.num_experts, self.hidden_size, -1)

    def _require_plain(self) -> None:
        if self.released:
            raise RuntimeError(
                "these experts keep only their packed weights (release_plain_weights); "
                "their plain weights were freed, so only the CPU backend's packed experts "
                "can run them"
            )


def route(
    router_logits: torch.Tensor,  # [T, E] in the activation dtype
    top_k: int,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [T, top_k] float32, expert ids [T, top_k] int64), as transformers routes:
    a float32 softmax over all experts, ``torch.topk`` (the call transformers makes, so tied
    probabilities pick the same experts on the same device), then, when ``normalize``, the
    chosen weights divided by their sum (Mixtral always; Qwen3-MoE per ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K] each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """ids [T, K] -> (order [T*K]: the flat (token, choice) pair indices sorted by expert,
    stable; ends: ends[e] is one past expert e's last position in ``order``). One host read of
    E counts: the per-expert loop needs them."""
    flat = ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)  # [T*K]
    ends: list[int] = torch.bincount(flat, minlength=num_experts).cumsum(0).tolist()
    return order, ends


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] int64
    num_experts: int,
    gate_up: ExpertFn,  # (e, rows [n, H]) -> [n, 2I]
    down: ExpertFn,  # (e, rows [n, I]) -> [n, H]
    act: Callable[[torch.Tensor], torch.Tensor],  # [n, 2I] -> [n, I]
) -> torch.Tensor:
    """The experts' weighted sum [T, H] in x's dtype, one GEMM pair per active expert."""
    t, k = ids.shape
    order, ends = group_by_expert(ids, num_experts)
    rows = x.index_select(0, order // k)  # [T*K, H], grouped by expert
    out = torch.empty_like(rows)  # [T*K, H]
    start = 0
    for expert, end in enumerate(ends):
        if end > start:
            out[start:end] = down(expert, act(gate_up(expert, rows[start:end])))
        start = end
    weighted = out.float() * weights.reshape(-1)[order].unsqueeze(-1)  # [T*K, H] float32
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted  # back to (token, choice) order
    return unsorted.view(t, k, -1).sum(dim=1).to(x.dtype)  # [T, H]


def fused_moe_reference(
    x: torch.Tensor,  # [T, H]
    experts: ExpertWeights,
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] int64
) -> torch.Tensor:
    """[T, H]: sum over k of weights[:, k] * expert_{ids[:, k]}(x), F.linear per expert."""
    gate_up, down = experts.gate_up_stack(), experts.down_stack()
    return grouped_experts(
        x,
        weights,
        ids,
        experts.num_experts,
        lambda e, rows: F.linear(rows, gate_up[e]),
        lambda e, rows: F.linear(rows, down[e]),
        silu_and_mul,
    )

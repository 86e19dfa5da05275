"""The MoE router and the CPU grouped-GEMM experts against transformers and a dense float64
computation of the same sum (every expert on every token, masked by the routing)."""

from __future__ import annotations

import pytest
import torch
from ferrum_kernels.backend import select_backend
from ferrum_kernels.cpu_linear import (
    PackedWeight,
    mkldnn_linear_available,
    pack_dtype,
    release_plain_weights,
)
from ferrum_kernels.cpu_moe import fused_moe_cpu, prepack_experts
from ferrum_kernels.moe import ExpertWeights, fused_moe_reference, group_by_expert, route

E, H, INTER, TOP_K = 6, 32, 48, 2


def _experts(dtype: torch.dtype = torch.float32, seed: int = 0) -> ExpertWeights:
    experts = ExpertWeights(E, H, INTER, dtype=dtype, device=None)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E * 2 * INTER, H, generator=gen) * 0.2)
        experts.down_proj.copy_(torch.randn(E * H, INTER, generator=gen) * 0.2)
    return experts


def _dense_float64(
    x: torch.Tensor, experts: ExpertWeights, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Every expert over every token in float64, then the routed weighted sum."""
    gate_up = experts.gate_up_stack().double()  # [E, 2I, H]
    down = experts.down_stack().double()  # [E, H, I]
    h = torch.einsum("th,eih->eti", x.double(), gate_up)  # [E, T, 2I]
    gate, up = h.chunk(2, dim=-1)
    out = torch.einsum("eti,ehi->eth", torch.nn.functional.silu(gate) * up, down)  # [E, T, H]
    mix = torch.zeros(x.shape[0], E, dtype=torch.float64)  # [T, E]
    mix.scatter_add_(1, ids, weights.double())
    return torch.einsum("te,eth->th", mix, out)


def _routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(t, E, generator=torch.Generator().manual_seed(seed))
    return route(logits, TOP_K, normalize=True)


# ----------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------

# Router inputs with exact ties: all equal, a three-way tie for first, a tie for second place.
_TIED = torch.tensor(
    [
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [1.0, 3.0, 3.0, 3.0, -1.0, 0.0, 0.5, 0.5],
        [2.0, 0.5, 0.5, -3.0, 0.5, 1.0, 1.0, -2.0],
        [0.25, 0.25, 4.0, 0.25, 0.25, 0.25, 0.25, 0.25],
    ]
)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_route_matches_transformers_with_ties(normalize: bool, top_k: int) -> None:
    """The router's weights and chosen experts are transformers' own, ties included: Mixtral's
    router always renormalises, Qwen3-MoE's per norm_topk_prob."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    num = _TIED.shape[1]
    if normalize:
        config = MixtralConfig(hidden_size=num, num_local_experts=num, num_experts_per_tok=top_k)
        router: torch.nn.Module = MixtralTopKRouter(config)
    else:
        config = Qwen3MoeConfig(
            hidden_size=num, num_experts=num, num_experts_per_tok=top_k, norm_topk_prob=False
        )
        router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num))  # router logits = the rows above
    _, want_weights, want_ids = router(_TIED)
    weights, ids = route(_TIED, top_k, normalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.float(), rtol=0, atol=0)
    assert weights.dtype == torch.float32
    assert all(len(set(row.tolist())) == top_k for row in ids)  # distinct experts per token
    probs = _TIED.softmax(-1)
    chosen = probs.gather(1, ids)
    if normalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(len(_TIED)))
        torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
    else:
        torch.testing.assert_close(weights, chosen)


def test_route_softmax_is_float32_for_bfloat16_logits() -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    weights, ids = route(logits, 2, normalize=False)
    want = torch.softmax(logits.float(), -1).gather(1, ids)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, want, rtol=0, atol=0)


def test_group_by_expert_sorts_pairs_stably() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 5]])
    order, ends = group_by_expert(ids, E)
    assert order.tolist() == [3, 1, 2, 0, 4, 5]  # expert 0: pair 3; 1: pairs 1, 2; 3: 0, 4; 5: 5
    assert ends == [1, 3, 3, 5, 5, 6]


# ----------------------------------------------------------------------------------------------
# Experts
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 3, 40])
def test_reference_matches_dense_float64(t: int) -> None:
    experts = _experts()
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(t))
    weights, ids = _routing(t, seed=t)
    got = fused_moe_reference(x, experts, weights, ids)
    torch.testing.assert_close(got.double(), _dense_float64(x, experts, weights, ids), atol=2e-5,
                               rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 2, 17, 64])
def test_cpu_grouped_gemm_matches_reference(dtype: torch.dtype, t: int) -> None:
    """The CPU backend's experts (packed where the dtype packs here) against the reference:
    float32 to GEMM rounding; bfloat16 within two bf16 ulps of the output scale."""
    experts = _experts(dtype)
    packed = prepack_experts(experts)
    assert packed == (2 * E if pack_dtype(dtype) is not None else 0)
    assert prepack_experts(experts) == 0  # idempotent
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(dtype)
    weights, ids = _routing(t, seed=t + 100)
    got = fused_moe_cpu(x, experts, weights, ids)
    want = fused_moe_reference(x, experts, weights, ids)
    assert got.dtype == dtype and got.shape == (t, H)
    tol = 1e-5 if dtype == torch.float32 else 2 * 2**-8 * want.abs().max().item()
    torch.testing.assert_close(got, want, atol=tol, rtol=0)
    dense = _dense_float64(x, experts, weights, ids)
    assert (got.double() - dense).abs().max() <= (1e-5 if dtype == torch.float32 else 0.05)


def test_cpu_experts_edge_groups() -> None:
    """Every token on the same two experts (the others idle), and one token only."""
    experts = _experts()
    prepack_experts(experts)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(7))
    ids = torch.tensor([[4, 2]] * 9)
    weights = torch.full((9, 2), 0.5)
    got = fused_moe_cpu(x, experts, weights, ids)
    torch.testing.assert_close(got.double(), _dense_float64(x, experts, weights, ids), atol=2e-5,
                               rtol=1e-5)  # fmt: skip


def test_cpu_experts_never_run_stale_packs() -> None:
    """Weights changed in place are re-packed; a model cast after packing falls back to the
    reference instead of running its old packed copies."""
    if not mkldnn_linear_available(torch.float32):
        pytest.skip("oneDNN cannot pack float32 on this CPU")
    experts = _experts()
    prepack_experts(experts)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing(5, seed=2)
    with torch.no_grad():
        experts.down_proj.mul_(2.0)
    torch.testing.assert_close(
        fused_moe_cpu(x, experts, weights, ids), fused_moe_reference(x, experts, weights, ids)
    )
    experts.to(torch.float64)
    assert experts.packed_from != experts.gate_up_proj.data_ptr()
    got = fused_moe_cpu(x.double(), experts, weights, ids)
    torch.testing.assert_close(got, fused_moe_reference(x.double(), experts, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_released_experts_keep_their_outputs_and_free_their_plain_tensors(
    dtype: torch.dtype,
) -> None:
    """A serving model's packed experts drop their plain stacked tensors (every pack's view of
    them too, or the storage would stay alive), run the same packed GEMMs bit for bit, count
    as packed (nothing is re-packed from the freed storage), and refuse whatever needs the plain
    weights. Experts of a dtype nothing packs on this CPU (pack_dtype None) keep theirs."""
    experts = _experts(dtype)
    prepack_experts(experts)
    x = torch.randn(17, H, generator=torch.Generator().manual_seed(9)).to(dtype)
    weights, ids = _routing(17, seed=9)
    before = fused_moe_cpu(x, experts, weights, ids)
    plain = sum(p.numel() * p.element_size() for p in (experts.gate_up_proj, experts.down_proj))
    if pack_dtype(dtype) is None:
        assert release_plain_weights(experts) == 0 and not experts.released
        assert torch.equal(fused_moe_reference(x, experts, weights, ids), before)
        return
    assert release_plain_weights(experts) == plain == E * 3 * H * INTER * dtype.itemsize
    assert experts.released and experts.is_packed()
    assert experts.gate_up_proj.numel() == 0 and experts.down_proj.numel() == 0
    packs = [w for pair in experts.packed or () for w in pair]
    assert all(isinstance(w, PackedWeight) and w.weight.numel() == 0 for w in packs)
    assert release_plain_weights(experts) == 0  # idempotent
    assert prepack_experts(experts) == 0  # still packed: nothing re-made from freed storage
    assert torch.equal(fused_moe_cpu(x, experts, weights, ids), before)
    with pytest.raises(RuntimeError, match="only their packed"):
        fused_moe_reference(x, experts, weights, ids)  # the torch (and Triton) path
    other = torch.float64 if dtype == torch.float32 else torch.float32
    with pytest.raises(RuntimeError, match=r"only their packed .* cannot run"):
        fused_moe_cpu(x.to(other), experts, weights, ids)
    experts.to(other)  # cast after release: the empty Parameters change, the packs do not
    with pytest.raises(RuntimeError, match=r"only their packed .* cannot run"):
        fused_moe_cpu(x.to(other), experts, weights, ids)


def test_every_backend_has_a_fused_moe() -> None:
    experts = _experts()
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(5))
    weights, ids = _routing(6, seed=5)
    want = fused_moe_reference(x, experts, weights, ids)
    for name in ("torch", "cpu"):
        backend = select_backend("cpu", name)
        if backend.prepare_model is not None:
            backend.prepare_model(experts)
        torch.testing.assert_close(backend.fused_moe(x, experts, weights, ids), want)

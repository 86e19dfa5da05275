"""The Triton fused-MoE kernel against the torch reference, on CPU tensors through the Triton
interpreter (small shapes: the interpreter runs each program in numpy). Interpreter caveat: its
float32 -> bfloat16 conversion is not round-to-nearest-even, so bf16 results are compared within
a few bf16 ulps; the dots run in float32 there (``triton_moe`` docstring)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Must precede the first triton import: @triton.jit picks the interpreter at decoration time.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'triton>=3.7')")

from ferrum_kernels.backend import select_backend
from ferrum_kernels.moe import ExpertWeights, fused_moe_reference, route
from ferrum_kernels.triton_moe import align_by_expert, fused_moe_triton, moe_block_m

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_models import PagedRunner
from helpers_moe import mixtral_config, save_moe

E, H, INTER = 5, 32, 48


def _experts(dtype: torch.dtype, seed: int = 0) -> ExpertWeights:
    experts = ExpertWeights(E, H, INTER, dtype=dtype, device=None)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E * 2 * INTER, H, generator=gen) * 0.2)
        experts.down_proj.copy_(torch.randn(E * H, INTER, generator=gen) * 0.2)
    return experts


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("t", [1, 4, 23])
def test_fused_moe_matches_reference_float32(t: int, top_k: int) -> None:
    experts = _experts(torch.float32)
    gen = torch.Generator().manual_seed(t * 10 + top_k)
    x = torch.randn(t, H, generator=gen)
    weights, ids = route(torch.randn(t, E, generator=gen), top_k, normalize=top_k > 1)
    got = fused_moe_triton(x, experts, weights, ids)
    want = fused_moe_reference(x, experts, weights, ids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_fused_moe_bfloat16_and_idle_experts() -> None:
    """bf16 activations and weights; every token on experts 1 and 3 (the others idle, so their
    tiles are skipped), unnormalised weights."""
    experts = _experts(torch.bfloat16, seed=3)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ids = torch.tensor([[3, 1]] * 9)
    weights = torch.tensor([[0.6, 0.3]] * 9)
    got = fused_moe_triton(x, experts, weights, ids)
    want = fused_moe_reference(x, experts, weights, ids)
    assert got.dtype == torch.bfloat16
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=4 * 2**-8 * scale, rtol=0)


def test_align_by_expert_layout() -> None:
    """Each expert's pairs in token order, padded to whole tiles with the out-of-range id;
    every used tile names its expert; the grid covers the worst case."""
    ids = torch.tensor([[1, 0], [1, 3], [0, 1]])  # pairs 0..5
    sorted_ids, block_expert, num_padded = align_by_expert(ids, 4, block_m=4)
    pad = 6
    assert sorted_ids[:12].tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert int(num_padded) == 12
    assert block_expert[:3].tolist() == [0, 1, 3]
    # 6 pairs, at most 4 active experts, 3 padding rows each: 18 rows -> 5 tiles of 4.
    assert sorted_ids.numel() == 20 and block_expert.numel() == 5
    assert moe_block_m(2, 8) == 16 and moe_block_m(4096, 8) == 64


def test_triton_backend_runs_a_mixtral_like_the_torch_backend(tmp_path: Path) -> None:
    """A whole (tiny) Mixtral on the Triton backend, interpreted: prefill in two chunks then
    two decodes give the torch backend's logits."""
    from ferrum_server.models import load_model

    save_moe(tmp_path, mixtral_config(num_hidden_layers=1, vocab_size=64))
    prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(6)).tolist()
    outs = []
    for name in ("torch", "triton"):
        model, config = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
        model.bind_backend(select_backend("cpu", name))
        assert model.backend.fused_moe is (fused_moe_triton if name == "triton" else
                                           fused_moe_reference)  # fmt: skip
        runner = PagedRunner(model, config, num_blocks=16, block_size=4)
        rows = [runner.step([(0, prompt[:3])])[0], runner.step([(0, prompt[3:])])[0]]
        for token in (5, 9):
            rows.append(runner.step([(0, [token])])[0])
        outs.append(torch.cat(rows))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)

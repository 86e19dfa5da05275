"""The compiled Triton fused-MoE kernel on a CUDA device: against the torch reference in float32
and bfloat16, and replayed from a CUDA graph (no host read of a device value).

Run with ``pytest tests/gpu -m gpu`` in its own process (see test_gpu_kernels.py for why).
"""

from __future__ import annotations

import pytest
import torch
from helpers_gpu import require_cuda_and_triton

pytestmark = pytest.mark.gpu

require_cuda_and_triton()

from ferrum_kernels.moe import ExpertWeights, fused_moe_reference, route  # noqa: E402
from ferrum_kernels.triton_moe import fused_moe_triton  # noqa: E402

E, H, INTER, TOP_K = 8, 768, 1024, 2  # W1-moe's layer


def _experts(dtype: torch.dtype) -> ExpertWeights:
    experts = ExpertWeights(E, H, INTER, dtype=dtype, device=torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E * 2 * INTER, H, generator=gen, device="cuda"))
        experts.down_proj.copy_(torch.randn(E * H, INTER, generator=gen, device="cuda"))
        experts.gate_up_proj.mul_(0.02)
        experts.down_proj.mul_(0.02)
    return experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 7, 64, 700])
def test_compiled_fused_moe_matches_reference(dtype: torch.dtype, t: int) -> None:
    experts = _experts(dtype)
    gen = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, H, generator=gen, device="cuda").to(dtype)
    weights, ids = route(torch.randn(t, E, generator=gen, device="cuda"), TOP_K, True)
    got = fused_moe_triton(x, experts, weights, ids)
    want = fused_moe_reference(x, experts, weights, ids)
    tol = 1e-4 if dtype == torch.float32 else 2 * 2**-8 * want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


def test_fused_moe_replays_from_a_cuda_graph() -> None:
    experts = _experts(torch.bfloat16)
    t = 16
    x = torch.zeros(t, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.zeros(t, E, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        fused_moe_triton(x, experts, *route(logits, TOP_K, True))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, experts, *route(logits, TOP_K, True))
    for seed in (1, 2):  # new inputs, new routing: the same graph
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(t, H, generator=gen, device="cuda"))
        logits.copy_(torch.randn(t, E, generator=gen, device="cuda"))
        graph.replay()
        want = fused_moe_reference(x, experts, *route(logits, TOP_K, True))
        tol = 2 * 2**-8 * want.float().abs().max().item()
        torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=0)

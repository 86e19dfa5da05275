"""Kernel backends as the model sees them: selection, the attention contract (KV write
included) of the torch reference and the CPU fast path, the CPU plan built once per forward,
and binding a backend to a model (weight packing included, tied heads too)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ferrum_kernels import cpu_attention, native
from ferrum_kernels.attention import AttentionMetadata
from ferrum_kernels.backend import KernelBackend, cpu_backend, select_backend, torch_backend
from ferrum_kernels.cpu_attention import CpuAttention, CpuAttentionPlan
from ferrum_kernels.cpu_linear import mkldnn_linear_available
from ferrum_server.models import LlamaForCausalLM, build_tiny, tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_models import PagedRunner, random_paged_batch


def test_select_backend_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_backend("cpu").name == "cpu"
    assert select_backend("cpu", "auto").name == "cpu"
    assert select_backend("cpu", "torch").name == "torch"
    assert select_backend("cpu", "cpu").name == "cpu"
    assert select_backend("meta").name == "torch"  # neither CPU nor CUDA: the reference
    with pytest.raises(RuntimeError, match="CPU kernels requested"):
        select_backend("meta", "cpu")
    # Triton on CPU only under the interpreter (which another test module switches on).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="Triton kernels requested"):
        select_backend("cpu", "triton")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        select_backend("cpu", "nope")


@pytest.mark.parametrize("value", ["torch", "triton", "nope", ""])
def test_select_backend_ignores_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    # The CLI is the one reader of FERRUM_KERNEL_BACKEND (as --kernel-backend's env twin), so
    # an explicit "--kernel-backend auto" is not overridden behind its back.
    monkeypatch.setenv("FERRUM_KERNEL_BACKEND", value)
    assert select_backend("cpu", "auto").name == "cpu"
    assert select_backend(torch.device("cpu")).name == "cpu"


def _pool_without_this_step(kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """A copy of kv_layer whose slots for this step's tokens hold garbage."""
    pool = kv_layer.clone()
    _, num_blocks, block_size, hkv, d = pool.shape
    flat = pool.view(2, num_blocks * block_size, hkv, d)
    flat[:, meta.slot_mapping] = 1e4
    return pool


@pytest.mark.parametrize("make", [torch_backend, cpu_backend], ids=["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_writes_this_steps_kv_then_attends(
    make: Callable[[], KernelBackend], dtype: torch.dtype
) -> None:
    # Prefill from scratch, a chunk on history, decodes (one ending on a block edge).
    items = [(0, 7), (5, 3), (9, 1), (3, 1), (7, 1)]
    batch = random_paged_batch(
        items, block_size=4, num_kv_heads=2, group=2, head_dim=64, dtype=dtype, seed=4
    )
    backend = make()
    pool = _pool_without_this_step(batch.kv_layer, batch.meta)
    query = torch.cat(batch.queries)  # [T, H, D]
    out = backend.attention(query, batch.key, batch.value, pool, batch.meta, batch.scale)
    assert torch.equal(pool, batch.kv_layer)  # the step's K/V landed in their slots
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), batch.reference, atol=tol, rtol=0)


@pytest.mark.parametrize("make", [torch_backend, cpu_backend], ids=["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
def test_soft_capped_layers_between_plain_ones(
    make: Callable[[], KernelBackend], dtype: torch.dtype, window: int
) -> None:
    # Gemma 2's soft-capped layers (the CPU backend routes them to the reference) beside plain
    # ones under one metadata object: each call gets its own scores, the plan stays right.
    items = [(0, 11), (5, 6), (30, 1), (9, 1), (2, 1), (17, 9), (0, 1)]
    kwargs = dict(block_size=4, num_kv_heads=2, group=2, head_dim=64, dtype=dtype, seed=8)
    capped = random_paged_batch(items, **kwargs, window=window, softcap=1.0)  # type: ignore[arg-type]
    plain = random_paged_batch(items, **kwargs, window=window)  # type: ignore[arg-type]
    assert (capped.reference - plain.reference).abs().max().item() > 0.05  # the cap matters
    backend = make()
    query, meta, scale = torch.cat(capped.queries), capped.meta, capped.scale
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for softcap, want in ((1.0, capped.reference), (0.0, plain.reference), (1.0, capped.reference)):
        pool = _pool_without_this_step(capped.kv_layer, meta)
        out = backend.attention(
            query, capped.key, capped.value, pool, meta, scale, window, softcap=softcap
        )
        assert torch.equal(pool, capped.kv_layer)
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=0)


@pytest.mark.parametrize("make", [torch_backend, cpu_backend], ids=["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5])
def test_sliding_window_layers_between_global_ones(
    make: Callable[[], KernelBackend],
    dtype: torch.dtype,
    window: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One forward's metadata serves a windowed layer and a global one (as in Gemma's alternating
    # layers): each gets its own mask, and the CPU plan built by the first is still right for
    # the second. Chunks cross the window edge (one spans two query blocks of the CPU chunk
    # path); decodes sit far past it, and a window may start mid-block.
    items = [(0, 11), (5, 6), (30, 1), (9, 1), (2, 1), (17, 9), (3, 70), (0, 1), (41, 66)]
    kwargs = dict(block_size=4, num_kv_heads=2, group=2, head_dim=64, dtype=dtype, seed=6)
    windowed = random_paged_batch(items, **kwargs, window=window)  # type: ignore[arg-type]
    full = random_paged_batch(items, **kwargs)  # type: ignore[arg-type]
    backend = make()
    if backend.name == "cpu" and native.load() is not None:
        # With the native decode kernel the CPU backend serves windowed layers itself.
        def no_reference(*args: object) -> torch.Tensor:
            raise AssertionError("the windowed CPU path fell back to the reference")

        monkeypatch.setattr(cpu_attention, "paged_attention", no_reference)
    query = torch.cat(windowed.queries)  # [T, H, D]
    meta, scale = windowed.meta, windowed.scale
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    runs = ((window, windowed.reference), (0, full.reference), (window, windowed.reference))
    for window, want in runs:
        pool = _pool_without_this_step(windowed.kv_layer, meta)
        out = backend.attention(query, windowed.key, windowed.value, pool, meta, scale, window)
        assert torch.equal(pool, windowed.kv_layer)
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=0)


def test_cpu_and_torch_backends_agree_on_a_forward() -> None:
    config = tiny_config()
    runners = []
    for backend in (torch_backend(), cpu_backend()):
        model = build_tiny(torch.float32, "cpu")
        model.bind_backend(backend)
        runners.append(PagedRunner(model, config, num_blocks=64, block_size=4))
    for step in ([(0, list(range(9))), (1, list(range(5, 18)))], [(0, [3]), (1, [4])]):
        want, got = (runner.step(step) for runner in runners)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_cpu_attention_plans_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[AttentionMetadata] = []
    original = CpuAttentionPlan.build

    def build(meta: AttentionMetadata, block_size: int) -> CpuAttentionPlan:
        built.append(meta)
        return original(meta, block_size)

    monkeypatch.setattr(CpuAttentionPlan, "build", staticmethod(build))
    config = tiny_config()
    assert config.num_layers > 1
    model = build_tiny(torch.float32, "cpu")
    backend = cpu_backend()
    model.bind_backend(backend)
    runner = PagedRunner(model, config, num_blocks=32, block_size=4)
    runner.step([(0, [1, 2, 3, 4, 5]), (1, [6, 7])])
    assert len(built) == 1  # shared by every layer
    runner.step([(0, [8]), (1, [9])])
    assert len(built) == 2 and built[0] is not built[1]  # and rebuilt for the next forward
    assert isinstance(backend.attention, CpuAttention)
    assert backend.attention.plan(built[1], 4).meta is built[1]  # the cached one
    assert len(built) == 2


@pytest.mark.skipif(not mkldnn_linear_available(), reason="no oneDNN")
@torch.no_grad()
def test_binding_the_cpu_backend_packs_a_tied_head_once() -> None:
    config = dataclasses.replace(tiny_config(), tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    keys = set(model.state_dict())
    hidden = torch.randn(3, config.hidden_size)
    want = F.linear(hidden, model.embed_tokens.weight)
    assert model.bind_backend(cpu_backend()) == config.num_layers * 4 + 1  # the head included
    assert model.tied_head is not None and model.tied_head.packed is not None
    assert model.bind_backend(cpu_backend()) == 0
    assert set(model.state_dict()) == keys  # the head owns no parameter
    torch.testing.assert_close(model.compute_logits(hidden), want, atol=1e-4, rtol=0)
    # Binding another backend afterwards keeps the model correct (nothing to undo).
    assert model.bind_backend(torch_backend()) == 0
    assert model.backend.name == "torch"
    torch.testing.assert_close(model.compute_logits(hidden), want, atol=1e-4, rtol=0)


def test_the_cpu_engine_runs_the_cpu_backend() -> None:
    from ferrum_server.config import EngineConfig
    from ferrum_server.engine import Engine

    engine = Engine(EngineConfig(block_size=4, kv_cache_bytes=1 << 20))
    try:
        assert engine.runner.kernels.name == "cpu"
        assert engine.model.backend is engine.runner.kernels
    finally:
        engine.shutdown()

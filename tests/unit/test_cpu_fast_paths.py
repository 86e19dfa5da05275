"""The CPU fast paths (pre-packed oneDNN linears, grouped paged attention) against the torch
reference path and transformers, on mixed unified batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from ferrum_kernels.backend import cpu_backend
from ferrum_kernels.cpu_linear import (
    PackedLinear,
    PackedWeight,
    mkldnn_linear_available,
    pack_dtype,
    packed_bytes,
    prepack_linears,
    release_plain_weights,
)
from ferrum_kernels.layers import TiedLinear
from ferrum_server.models import build_tiny, save_hf_folder, tiny_config
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_models import PagedRunner, check_greedy_against_transformers

needs_mkldnn = pytest.mark.skipif(not mkldnn_linear_available(), reason="no oneDNN")


@needs_mkldnn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_packed_linear_matches_f_linear(dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=bias, dtype=dtype)
    holder = torch.nn.Sequential(linear)
    if pack_dtype(dtype) is None:
        # Nothing packs this dtype here: the layer must stay a plain nn.Linear rather than fail
        # at its first forward.
        assert prepack_linears(holder) == 0 and type(holder[0]) is torch.nn.Linear
        return
    assert prepack_linears(holder) == 1
    packed = holder[0]
    assert isinstance(packed, PackedLinear) and packed.weight is linear.weight
    for rows in (1, 7, 300):
        x = torch.randn(rows, 96, dtype=dtype)
        want = torch.nn.functional.linear(x.float(), linear.weight.float(), None)
        if bias:
            want += linear.bias.float()
        tol = 1e-4 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(packed(x).float(), want, atol=tol, rtol=0)
    # An in-place weight update is picked up (re-packed), never served stale.
    linear.weight.mul_(2.0)
    x = torch.randn(3, 96, dtype=dtype)
    want = torch.nn.functional.linear(x, linear.weight, linear.bias)
    torch.testing.assert_close(packed(x).float(), want.float(), atol=0.2, rtol=0.02)


@needs_mkldnn
@torch.no_grad()
def test_bfloat16_packs_widened_where_onednn_packs_only_float32() -> None:
    """On an AVX2 CPU oneDNN packs float32 but not bfloat16: a bfloat16 linear is packed as
    float32 and returns bfloat16, exactly the float32 GEMM of its bfloat16 values rounded once
    (the products are exact in float32), and within one bfloat16 rounding of F.linear's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=True, dtype=torch.bfloat16)
    if mkldnn_linear_available(torch.bfloat16):
        assert pack_dtype(torch.bfloat16) == torch.bfloat16  # packed natively; nothing widens
        return
    assert pack_dtype(torch.bfloat16) == torch.float32
    holder = torch.nn.Sequential(linear)
    assert prepack_linears(holder) == 1
    packed = holder[0]
    assert isinstance(packed, PackedLinear) and packed._pack is not None
    assert packed._pack.packed().dtype == torch.float32
    wide = PackedWeight(linear.weight.float(), linear.bias.float())
    for rows in (1, 7, 300):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        got = packed(x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, wide(x.float()).to(torch.bfloat16))
        want = torch.nn.functional.linear(x, linear.weight, linear.bias).float()
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-7)
    # Served with only its packed copy, it still takes and gives bfloat16 and nothing else.
    x = torch.randn(5, 96).to(torch.bfloat16)
    before = packed(x)
    assert release_plain_weights(holder) == 96 * 200 * 2
    assert torch.equal(packed(x), before)
    with pytest.raises(RuntimeError, match=r"only its packed torch\.bfloat16"):
        packed(x.float())


@needs_mkldnn
def test_packing_keeps_parameter_names() -> None:
    model = build_tiny(torch.float32, "cpu")
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    # qkv, o, gate_up, down per layer + the (tied) LM head
    assert model.bind_backend(cpu_backend()) == 2 * 4 + 1
    assert model.bind_backend(cpu_backend()) == 0  # idempotent
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert set(model.hf_state_dict()) == set(build_tiny(torch.float32, "cpu").hf_state_dict())


@torch.no_grad()
def test_a_bfloat16_models_logits_come_from_the_widening_gemm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compute_logits on the CPU backend runs the LM head's widened GEMM where the native
    bfloat16 GEMM serves it, and returns exactly what the head's bfloat16 output widened holds."""
    from ferrum_kernels import cpu_linear

    model = build_tiny(torch.bfloat16, "cpu")
    model.bind_backend(cpu_backend())
    head = model.lm_head
    assert isinstance(head, PackedLinear)  # the tiny model's head is not tied
    hidden = torch.randn(5, model.config.hidden_size).bfloat16()
    want = head(hidden).float()
    calls: list[int] = []
    widened = cpu_linear.PackedWeight.widened

    def counted(pack: PackedWeight, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return widened(pack, x)

    monkeypatch.setattr(cpu_linear.PackedWeight, "widened", counted)
    got = model.compute_logits(hidden)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    pack = head._pack
    serves = pack is not None and pack.widens(hidden)
    assert calls == ([5] if serves else [])


def _mixed_steps(runner: PagedRunner, vocab: int) -> list[torch.Tensor]:
    """Prefill several prompts in chunks, then mixed decode + chunk steps; all logits."""
    torch.manual_seed(7)
    prompts = {i: torch.randint(0, vocab, (3 + 11 * i,)).tolist() for i in range(5)}
    outputs: list[torch.Tensor] = []
    # step 1: first chunks of 0..3 (item 3 split), step 2: rest of 3 + all of 4
    first = [(i, prompts[i][: 20 if i == 3 else None]) for i in range(4)]
    outputs += runner.step(first)
    outputs += runner.step([(3, prompts[3][20:]), (4, prompts[4][:30])])
    tokens = {i: int(outputs[i][-1].argmax()) for i in range(3)}
    for _ in range(6):
        got = runner.step([(i, [t]) for i, t in tokens.items()] + [(4, prompts[4][30:31])])
        outputs += got
        tokens = {i: int(g[-1].argmax()) for i, g in zip(tokens, got, strict=False)}
        prompts[4] = prompts[4][:30] + prompts[4][31:]
    return outputs


@needs_mkldnn
@torch.no_grad()
def test_released_plain_weights_keep_the_outputs_and_free_their_bytes(tmp_path: Path) -> None:
    model = build_tiny(torch.float32, "cpu")
    model.bind_backend(cpu_backend())
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    plain = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    prompt = [3, 1, 4, 1, 5]
    before = PagedRunner(model, tiny_config(), num_blocks=8, block_size=4).step([(0, prompt)])[0]
    assert release_plain_weights(model) == plain > 0
    assert all(m.weight.numel() == 0 for m in linears)
    assert release_plain_weights(model) == 0  # idempotent
    after = PagedRunner(model, tiny_config(), num_blocks=8, block_size=4).step([(0, prompt)])[0]
    assert torch.equal(before, after)  # the same packed GEMMs ran
    with pytest.raises(RuntimeError, match="cannot be exported"):
        model.hf_state_dict()
    # Saving it is refused before anything is written: no stray config.json.
    with pytest.raises(RuntimeError, match="cannot be exported"):
        save_hf_folder(model, tiny_config(), tmp_path / "export")
    assert not (tmp_path / "export").exists()
    with pytest.raises(RuntimeError, match="only its packed"):
        linears[0](torch.ones(1, linears[0].in_features, dtype=torch.float64))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_served_cpu_model_keeps_no_plain_copy_of_its_packed_linears(dtype: str) -> None:
    """And its memory plan reports the weights it holds: the packed copies (float32 for
    bfloat16 widened on an AVX2 CPU), not the parameters it was loaded with."""
    from ferrum_server.config import EngineConfig
    from ferrum_server.engine import Engine
    from ferrum_server.profiling import model_bytes

    engine = Engine(EngineConfig(block_size=4, kv_cache_bytes=1 << 20, dtype=dtype))
    try:
        model = engine.model
        linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
        if pack_dtype(getattr(torch, dtype)) is not None:
            assert linears and all(m.weight.numel() == 0 for m in linears)
            # Each packed linear's copy, and the tied head's beside its table, at the packed
            # dtype; the parameters left count the rest.
            wide = pack_dtype(getattr(torch, dtype))
            assert wide is not None
            # The native GEMM pads each weight to whole panels: 16 columns in float32, 32
            # columns and an even K in bfloat16 (a paired gate/up: 16 columns of each half).
            packs = [m._pack for m in linears if m._pack is not None]
            packs += [m.packed for m in model.modules() if isinstance(m, TiedLinear) and m.packed]
            elements = 0
            for pack in packs:
                assert isinstance(pack, PackedWeight)
                n, k = pack.out_features, pack.in_features
                if pack.kernel == "onednn":
                    elements += n * k
                elif pack.paired:
                    elements += -(-(n // 2) // 16) * 32 * -(-k // 2) * 2
                elif wide == torch.bfloat16:
                    elements += -(-n // 32) * 32 * -(-k // 2) * 2
                else:
                    elements += -(-n // 16) * 16 * k
            assert packed_bytes(model) == elements * wide.itemsize
        assert engine.memory_plan.weights_bytes == model_bytes(model) + packed_bytes(model)
        assert engine.warmup(16).deferral is None  # and it still runs
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_fast_path_matches_reference_on_mixed_batches(dtype: torch.dtype) -> None:
    config = tiny_config()
    reference = PagedRunner(build_tiny(dtype, "cpu"), config, num_blocks=128, block_size=4)
    fast_model = build_tiny(dtype, "cpu")
    fast_model.bind_backend(cpu_backend())
    fast = PagedRunner(fast_model, config, num_blocks=128, block_size=4, seed=3)
    want = _mixed_steps(reference, config.vocab_size)
    got = _mixed_steps(fast, config.vocab_size)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=tol, rtol=0)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@torch.no_grad()
def test_fast_path_matches_transformers_greedy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.08,
    )
    check_greedy_against_transformers(
        tmp_path, cfg, prompt_len=19, chunk_ends=[19], steps=12, num_blocks=64, block_size=4
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("block", "kv_heads", "head_dim", "heads"),
    # W1's shape (G = 3); a masked bfloat16 tail (80) with block 8; one KV head for all (G = 4)
    # with blocks longer than the 16-token score tile; no grouping at all; G = 2; and a group
    # past the bfloat16 K pass's unrolled ones (G = 5: its run-time loop).
    [
        (16, 2, 64, 6),
        (8, 2, 80, 8),
        (32, 1, 128, 4),
        (16, 4, 32, 4),
        (16, 2, 64, 4),
        (16, 2, 64, 10),
    ],
)
@pytest.mark.parametrize("shared", [False, True])  # items' first blocks shared (a cached prompt)
# A peaked softmax too: scores hundreds apart, so most exponentials meet the kernel's e^-87 floor.
@pytest.mark.parametrize("query_scale", [1.0, 60.0])
def test_native_decode_kernel_matches_reference(
    dtype: torch.dtype,
    block: int,
    kv_heads: int,
    head_dim: int,
    heads: int,
    shared: bool,
    query_scale: float,
) -> None:
    import random

    from ferrum_kernels.cpu_decode import decode_attention, native_available
    from helpers_native import paged_decode_reference, scattered_tables

    if not native_available():
        pytest.skip("no C++ toolchain for the native kernel")
    torch.manual_seed(0)
    rng = random.Random(0)
    contexts = [rng.randint(1, 90) for _ in range(9)] + [1, 16, 17, 33]
    tables, num_blocks = scattered_tables(contexts, block, rng)
    kv = torch.randn(2, num_blocks, block, kv_heads, head_dim, dtype=dtype)
    if shared:  # every item of three blocks or more reads the first such item's first two
        first = next(t for t in tables if len(t) >= 3)
        tables = [first[:2] + t[2:] if len(t) >= 3 else t for t in tables]
    query = (torch.randn(len(contexts), heads, head_dim) * query_scale).to(dtype)
    table, want = paged_decode_reference(query, kv, tables, contexts, block)
    got = decode_attention(
        query, kv, table, torch.tensor(contexts), torch.arange(len(contexts)), head_dim**-0.5
    )
    assert got is not None
    # float32 scores hundreds apart carry rounding errors of about 1e-5 of themselves, which
    # move the weights by as much (the kernel before the inline exponential was 4e-5 off too);
    # bfloat16's tolerance covers that already.
    tol = (1e-5 if query_scale == 1.0 else 1e-4) if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("with_prefill", [False, True])
def test_decode_only_step_returns_the_kernels_rows(with_prefill: bool) -> None:
    """A decode-only step's attention is the decode kernel's output itself (item i is row i, so
    nothing is copied); with a prompt chunk in the step, the decodes are placed in their rows.
    Both agree with the reference."""
    from ferrum_kernels.attention import AttentionMetadata, paged_attention
    from ferrum_kernels.cpu_attention import CpuAttentionPlan, Workspace, cpu_paged_attention
    from ferrum_kernels.cpu_decode import native_available

    if not native_available():
        pytest.skip("no C++ toolchain for the native kernel")
    torch.manual_seed(0)
    block, kv_heads, head_dim, heads = 4, 2, 32, 4
    contexts = [5, 9, 3] + ([6] if with_prefill else [])
    chunk = 6 if with_prefill else 0  # the last item: a whole 6-token prompt
    kv = torch.randn(2, 16, block, kv_heads, head_dim)
    table = torch.arange(16).view(4, 4)[: len(contexts)].contiguous()
    ends = [c - 1 for c in contexts[:3]] + list(range(chunk))
    starts = [0, 1, 2, 3] + ([3 + chunk] if with_prefill else [])
    slots = torch.tensor([int(table[i, e // block]) * block + e % block for i, e in
                          zip([0, 1, 2] + [3] * chunk, ends, strict=True)])  # fmt: skip
    meta = AttentionMetadata.build(starts, contexts, table, slots)
    plan = CpuAttentionPlan.build(meta, block)
    assert plan.decodes_are_rows is not with_prefill
    rows = 3 + chunk
    query = torch.randn(rows, heads, head_dim)
    key = torch.randn(rows, kv_heads, head_dim)
    got = cpu_paged_attention(query, key, key, kv, plan, head_dim**-0.5, Workspace())
    want = paged_attention(query, kv, meta, head_dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

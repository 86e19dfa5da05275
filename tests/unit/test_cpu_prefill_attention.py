"""The native CPU prefill attention kernel (csrc/prefill_attention.cpp) through
``cpu_paged_attention`` and ``cpu_windowed_attention``, against a float64 dense causal (or
sliding-window) attention and the torch paths."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ferrum_kernels import cpu_attention, native
from ferrum_kernels.attention import paged_attention
from ferrum_kernels.cpu_attention import (
    CpuAttentionPlan,
    Workspace,
    cpu_paged_attention,
    cpu_windowed_attention,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_models import (
    check_greedy_against_transformers,
    longrope_scaling,
    phi3_config,
    random_paged_batch,
)

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ toolchain")


@dataclass
class Case:
    query: torch.Tensor  # [T, H, D], a row-strided view of a wider "qkv" tensor
    key: torch.Tensor  # [T, Hkv, D] this step's keys (already in the pool)
    value: torch.Tensor  # [T, Hkv, D]
    kv_layer: torch.Tensor  # [2, NB, BS, Hkv, D]
    plan: CpuAttentionPlan
    reference: torch.Tensor  # [T, H, D] float64 dense causal attention
    paged: torch.Tensor  # [T, H, D] ferrum_kernels.attention.paged_attention
    scale: float


def _case(
    items: list[tuple[int, int]],  # (history length, query rows) per item; 1 row = a decode
    *,
    group: int,
    head_dim: int = 64,
    num_kv_heads: int = 2,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    window: int = 0,
) -> Case:
    num_heads = num_kv_heads * group
    # Spare blocks hold NaN: any read of a block the kernel must not touch would show.
    batch = random_paged_batch(
        items,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
        spare_blocks=4,
        spare_fill=float("nan"),
        window=window,
    )
    kv_layer, meta, scale = batch.kv_layer, batch.meta, batch.scale
    q = torch.cat(batch.queries)  # [T, H, D]
    # The model hands attention q as a view of its fused qkv projection: rows are strided.
    qkv = torch.cat(
        [q.flatten(1), torch.zeros(q.shape[0], 2 * num_kv_heads * head_dim, dtype=dtype)], 1
    )
    query = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    assert query.stride(0) > num_heads * head_dim
    return Case(
        query=query,
        key=batch.key,
        value=batch.value,
        kv_layer=kv_layer,
        plan=CpuAttentionPlan.build(meta, block_size),
        reference=batch.reference,
        paged=paged_attention(query, kv_layer, meta, scale, window),
        scale=scale,
    )


def _run(case: Case, native_prefill: bool = True) -> torch.Tensor:
    cpu_attention.NATIVE_PREFILL = native_prefill
    try:
        return cpu_paged_attention(
            case.query, case.key, case.value, case.kv_layer, case.plan, case.scale, Workspace()
        )
    finally:
        cpu_attention.NATIVE_PREFILL = True


@pytest.fixture(autouse=True)
def _kernel_is_used(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a test whose chunks silently fell back to the torch path."""
    calls: list[int] = []
    module = native.load()
    real = module.prefill_attention

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(module, name)

        def prefill_attention(self, *args: object) -> None:
            calls.append(1)
            real(*args)

        def prefill_attention_vectorized(self, bfloat16: bool) -> bool:
            # Where the kernel is not vectorised (bfloat16 without AVX-512, anything without
            # AVX2), production leaves chunks to the torch path (the kernel's portable loops are
            # slower there); these tests check the kernel's results on any CPU.
            return True

    monkeypatch.setattr(cpu_attention.native, "load", lambda: Spy())
    yield
    assert calls, "the native prefill kernel was not called"


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # bfloat16: probabilities and the output are rounded to bfloat16 (as the torch path does).
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


DTYPES = [torch.float32, torch.bfloat16]
# Fresh chunks, continuing chunks with history, decodes between them, lengths off every
# tile (16 keys), unit (48 rows) and block boundary.
MIXED = [(0, 37), (20, 1), (100, 70), (0, 2), (5, 129), (63, 1), (16, 16), (0, 200)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4])
def test_mixed_step_matches_dense(dtype: torch.dtype, group: int) -> None:
    case = _case(MIXED, group=group, dtype=dtype, seed=group)
    got = _run(case)
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.double(), case.reference, **_tolerance(dtype))
    torch.testing.assert_close(got.float(), case.paged.float(), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "block_size"), [(128, 16), (64, 5), (32, 1), (80, 7), (96, 16), (16, 3)]
)
def test_head_dims_and_block_sizes(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    items = [(0, 45), (33, 19), (7, 1), (130, 3)]
    case = _case(items, group=3, head_dim=head_dim, block_size=block_size, dtype=dtype, seed=5)
    torch.testing.assert_close(_run(case).double(), case.reference, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_w1_shapes_agree_with_the_torch_path(dtype: torch.dtype) -> None:
    # 12 heads over 4 KV heads, a full 512-token prompt, a continuing chunk and a short one.
    case = _case([(0, 512), (256, 256), (336, 64)], group=3, num_kv_heads=4, dtype=dtype, seed=9)
    got = _run(case)
    torch.testing.assert_close(got.double(), case.reference, **_tolerance(dtype))
    # The torch path (bmm + softmax) sees the same inputs; bfloat16 differs by its rounding of
    # the scores to bfloat16 before the softmax.
    old = _run(case, native_prefill=False)
    torch.testing.assert_close(got.float(), old.float(), **_tolerance(dtype))


def test_rejects_a_scratch_that_is_too_small() -> None:
    case = _case([(3, 20)], group=2)
    module = native.load()
    out = torch.empty(case.query.shape)
    with pytest.raises(RuntimeError, match="scratch too small"):
        module.prefill_attention(
            case.query,
            case.kv_layer[0],
            case.kv_layer[1],
            out,
            case.plan.chunk_info,
            case.plan.chunk_tables,
            torch.empty(10),
            case.kv_layer.shape[2],
            case.kv_layer.shape[3],
            case.scale,
            0,
        )
    _run(case)  # the fixture wants one call that went through


def test_leaves_other_rows_alone() -> None:
    # Decode rows belong to the decode kernel: the prefill kernel must write only chunk rows.
    rng = random.Random(0)
    items = [(rng.randint(0, 40), rng.choice([1, 1, 9, 30])) for _ in range(8)]
    case = _case(items, group=2, seed=3)
    module = native.load()
    out = torch.full(case.query.shape, 7.0)
    kv = case.kv_layer
    scratch = torch.empty(case.plan.chunk_key_slots * kv.shape[3] * kv.shape[4] * 2)
    module.prefill_attention(
        case.query, kv[0], kv[1], out, case.plan.chunk_info, case.plan.chunk_tables, scratch,
        kv.shape[2], kv.shape[3], case.scale, 0,
    )  # fmt: skip
    chunk_rows = torch.zeros(case.query.shape[0], dtype=torch.bool)
    for start, end, _ in case.plan.chunk_info.tolist():
        chunk_rows[start:end] = True
    assert bool((out[~chunk_rows] == 7.0).all())
    torch.testing.assert_close(
        out[chunk_rows].double(), case.reference[chunk_rows], atol=1e-5, rtol=1e-5
    )


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@torch.no_grad()
def test_model_with_chunked_prefill_matches_transformers_greedy(tmp_path: Path) -> None:
    # The fast-path parity tests elsewhere use head dims (8) the kernel does not take; this model
    # has head_dim 64 and GQA 3, prefilled in three chunks (two of them continuing).
    from transformers import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=256,
        initializer_range=0.08,
    )
    config = check_greedy_against_transformers(
        tmp_path,
        cfg,
        prompt_len=83,
        chunk_ends=[37, 70, 83],
        steps=6,
        num_blocks=32,
        block_size=16,
    )
    assert config.head_dim == 64


# --- sliding windows (a query at p sees keys in (p - window, p]) ----------------------------------

# Fresh chunks longer than the window, continuing chunks crossing its edge, a chunk (and a
# decode) far past it, one-row-per-tile edges; windows of one key, off every tile (16) and
# word (2) boundary, and wider than every context (the same as global attention).
WINDOWED = [(0, 70), (5, 9), (300, 40), (0, 3), (60, 1), (31, 17), (200, 1), (16, 48)]
WINDOWS = [1, 2, 5, 16, 17, 48, 1000]


def _chunk_rows(case: Case) -> torch.Tensor:
    rows = torch.zeros(case.query.shape[0], dtype=torch.bool)
    for start, end, _ in case.plan.chunk_info.tolist():
        rows[start:end] = True
    return rows


def _call_kernel(case: Case, window: int, out: torch.Tensor, scratch_numel: int) -> None:
    kv = case.kv_layer
    native.load().prefill_attention(
        case.query, kv[0], kv[1], out, case.plan.chunk_info, case.plan.chunk_tables,
        torch.empty(scratch_numel, dtype=case.query.dtype), kv.shape[2], kv.shape[3], case.scale,
        window,
    )  # fmt: skip


def _scratch(case: Case, window: int) -> int:
    kv = case.kv_layer
    return case.plan.key_slots(window) * kv.shape[3] * kv.shape[4] * 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_kernel_matches_dense(dtype: torch.dtype, window: int) -> None:
    """The module called directly: chunk rows against the float64 windowed answer, and the
    other rows left alone."""
    case = _case(WINDOWED, group=3, dtype=dtype, seed=window, window=window)
    out = torch.full(case.query.shape, 7.0, dtype=dtype)
    _call_kernel(case, window, out, _scratch(case, window))
    rows = _chunk_rows(case)
    assert bool((out[~rows] == 7.0).all())
    torch.testing.assert_close(out[rows].double(), case.reference[rows], **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "block_size", "group"), [(64, 16, 1), (32, 5, 4), (128, 3, 2)]
)
def test_windowed_attention_takes_the_kernel(
    dtype: torch.dtype, head_dim: int, block_size: int, group: int
) -> None:
    """cpu_windowed_attention sends a mixed step's chunks to the kernel (the fixture fails the
    test otherwise) and its decodes to the decode kernel: all rows against the dense answer and
    the torch reference."""
    window = 7
    case = _case(
        WINDOWED, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype,
        seed=head_dim, window=window,
    )  # fmt: skip
    got = cpu_windowed_attention(
        case.query, case.key, case.value, case.kv_layer, case.plan, case.scale, window,
        Workspace(),
    )  # fmt: skip
    assert got is not None and got.dtype == dtype
    torch.testing.assert_close(got.double(), case.reference, **_tolerance(dtype))
    torch.testing.assert_close(got.float(), case.paged.float(), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_windowed_kernel_reads_only_the_window(dtype: torch.dtype) -> None:
    """A chunk far past its window: the scratch it needs is its rows plus the window, not its
    context, and pool positions before the chunk's first packed tile are never read (they hold
    NaN here, which any read would spread to the output)."""
    window, history, rows = 9, 500, 20
    case = _case([(history, rows)], group=2, dtype=dtype, seed=11, window=window)
    first_visible = history - window + 1  # the chunk's first query's first key
    # Keys 480 (492 rounded down to a tile) to 520, in whole tiles: 48, of 528 without the window.
    assert case.plan.key_slots(window) == 48 < case.plan.key_slots(0) == 528
    table, block_size = case.plan.chunk_tables[0], case.kv_layer.shape[2]
    for p in range(first_visible // 16 * 16):
        case.kv_layer[:, table[p // block_size], p % block_size] = float("nan")
    out = torch.empty(case.query.shape, dtype=dtype)
    with pytest.raises(RuntimeError, match="scratch too small"):
        _call_kernel(case, window, out, _scratch(case, window) - 1)
    _call_kernel(case, window, out, _scratch(case, window))
    torch.testing.assert_close(out.double(), case.reference, **_tolerance(dtype))
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        _call_kernel(case, -1, out, _scratch(case, 0))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@torch.no_grad()
def test_windowed_model_with_chunked_prefill_matches_transformers_greedy(tmp_path: Path) -> None:
    # A Phi-3 with window 6 on every layer (head_dim 64, GQA 3), its prompt in chunks that cross
    # the window edge and start far past it: every chunk goes through the kernel with the window.
    torch.manual_seed(0)
    cfg = phi3_config(
        hidden_size=192,
        intermediate_size=256,
        num_attention_heads=3,
        num_key_value_heads=1,
        sliding_window=6,
        original_max_position_embeddings=32,
        rope_scaling=longrope_scaling(64),
    )
    config = check_greedy_against_transformers(
        tmp_path, cfg, prompt_len=83, chunk_ends=[4, 37, 70, 83], steps=6, num_blocks=32,
        block_size=16,
    )  # fmt: skip
    assert config.head_dim == 64 and config.sliding_windows == (6, 6)


_amx = native.load()
needs_amx = pytest.mark.skipif(
    _amx is None or not _amx.amx_available(),
    reason="no AMX tiles here (needs a CPU with AMX-BF16 and Linux granting them)",
)


@needs_amx
@pytest.mark.parametrize(
    ("head_dim", "group", "window"),
    [(64, 3, 0), (32, 4, 0), (96, 1, 0), (128, 2, 0), (64, 3, 17), (128, 2, 5), (80, 3, 0)],
)
def test_amx_tiles_agree_with_the_register_tiles(head_dim: int, group: int, window: int) -> None:
    """bfloat16 on AMX tiles (head_dim a multiple of 32; 80 keeps the register tiles): the
    dense answer, and within a bfloat16 ulp or two of the register tiles, whose float32 sums of
    the same products run in another order; chunks off every 16-row tile, 32-row group and
    32-key step, with history, over NaN spare blocks (a read past the packed keys would show)."""
    assert _amx is not None
    items = [(0, 45), (33, 19), (7, 1), (130, 3), (0, 97), (16, 32)]
    case = _case(
        items, group=group, head_dim=head_dim, block_size=16, dtype=torch.bfloat16,
        seed=head_dim + group, window=window,
    )  # fmt: skip
    rows = _chunk_rows(case)
    out = torch.full(case.query.shape, 7.0, dtype=torch.bfloat16)
    _call_kernel(case, window, out, _scratch(case, window))
    _amx.set_amx(False)
    try:
        registers = torch.full(case.query.shape, 7.0, dtype=torch.bfloat16)
        _call_kernel(case, window, registers, _scratch(case, window))
    finally:
        _amx.set_amx(True)
    assert bool((out[~rows] == 7.0).all())
    torch.testing.assert_close(
        out[rows].double(), case.reference[rows], **_tolerance(torch.bfloat16)
    )
    torch.testing.assert_close(out.float(), registers.float(), atol=2e-3, rtol=2**-7)
    _run(case)  # the fixture wants one call through cpu_paged_attention

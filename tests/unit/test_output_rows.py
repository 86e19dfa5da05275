"""A forward that finishes only its output rows (``OutputRows``): the last layer writes every
row's K/V, then runs attention, o, the norms and the MLP for the rows whose logits are used.
The pool must come out bit for bit as a full forward leaves it and the kept rows' hidden states
as the full forward's same rows (to float rounding: a final chunk's last row is then attended
as a single query), on every model family and backend; the skipped work must really be
skipped; and malformed selections are refused."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from ferrum_kernels.attention import AttentionMetadata, OutputRows
from ferrum_kernels.backend import cpu_backend, torch_backend
from ferrum_server.models import build_tiny, load_model
from ferrum_server.parallel.plan import output_counts
from helpers_models import BlockAllocator, build_meta, save_gemma
from helpers_moe import mixtral_config, save_moe

BLOCK = 4


def _meta(query_lens: list[int], context_lens: list[int]) -> AttentionMetadata:
    allocator = BlockAllocator(64, shuffle=True, seed=3)
    blocks = [allocator.allocate(math.ceil(c / BLOCK)) for c in context_lens]
    return build_meta(blocks, query_lens, context_lens, BLOCK)


def test_select_keeps_each_items_trailing_rows() -> None:
    # Items: a 5-row chunk keeping none, a 4-row final chunk keeping its last row, a decode,
    # a 3-row verify keeping all three.
    meta = _meta([5, 4, 1, 3], [9, 12, 7, 10])
    outputs = OutputRows.select(meta, [0, 1, 1, 3])
    assert outputs.rows.tolist() == [8, 9, 10, 11, 12]
    sub = outputs.meta
    assert sub is not None and outputs.count == 5
    assert sub.query_start == [0, 1, 2, 5]
    assert sub.context_lens == [12, 7, 10]
    assert torch.equal(sub.block_tables, meta.block_tables[[1, 2, 3]])
    assert torch.equal(sub.slot_mapping, meta.slot_mapping[8:13])
    assert sub.decode_items == (0, 1) and sub.prefill_items == (2,)


def test_select_with_no_row_kept_has_no_attention() -> None:
    meta = _meta([5, 3], [5, 8])
    outputs = OutputRows.select(meta, [0, 0])
    assert outputs.count == 0 and outputs.meta is None


@pytest.mark.parametrize(
    ("counts", "rows", "message"),
    [
        ([0, 1, 1], None, "counts has 3 entries for 2 items"),
        ([0, 4], None, "item 1 keeps 4 of its 3 query rows"),
        ([-1, 1], None, "item 0 keeps -1"),
        ([1, 1], torch.tensor([7]), r"rows must be \[R=2\]"),
    ],
)
def test_select_refuses_a_malformed_selection(
    counts: list[int], rows: torch.Tensor | None, message: str
) -> None:
    meta = _meta([5, 3], [5, 8])
    with pytest.raises(ValueError, match=message):
        OutputRows.select(meta, counts, rows)


def test_followers_recover_the_counts_from_the_rows() -> None:
    # As a follower of a tensor-parallel group does from the rows it receives.
    assert output_counts([0, 5, 9, 10, 13], [8, 9, 10, 11, 12]) == [0, 1, 1, 3]
    assert output_counts([0, 5, 8], []) == [0, 0]
    assert output_counts([0, 1, 2], [0, 1]) == [1, 1]


def _llama(backend: str, dtype: torch.dtype, tmp_path: Path) -> Any:
    model = build_tiny(dtype, "cpu")
    model.bind_backend(cpu_backend() if backend == "cpu" else torch_backend())
    return model


def _gemma(backend: str, dtype: torch.dtype, tmp_path: Path) -> Any:
    save_gemma(tmp_path, "gemma2")
    model, _ = load_model(str(tmp_path), dtype=dtype, device=torch.device("cpu"))
    model.bind_backend(cpu_backend() if backend == "cpu" else torch_backend())
    return model


def _mixtral(backend: str, dtype: torch.dtype, tmp_path: Path) -> Any:
    save_moe(tmp_path, mixtral_config())
    model, _ = load_model(str(tmp_path), dtype=dtype, device=torch.device("cpu"))
    model.bind_backend(cpu_backend() if backend == "cpu" else torch_backend())
    return model


def _step(model: Any, history: list[int]) -> tuple[Any, torch.Tensor, torch.Tensor, list[int]]:
    """A mixed step over items with `history` tokens cached: a chunk that is not its prompt's
    last, a final chunk, two decodes and a verify. -> (meta, ids, positions, counts)."""
    query_lens = [6, 5, 1, 1, 3]
    counts = [0, 1, 1, 1, 3]
    context_lens = [h + n for h, n in zip(history, query_lens, strict=True)]
    meta = _meta(query_lens, context_lens)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (sum(query_lens),), generator=gen)
    positions = torch.cat(
        [torch.arange(c - n, c) for n, c in zip(query_lens, context_lens, strict=True)]
    )
    return meta, ids, positions, counts


def _pool(model: Any, dtype: torch.dtype) -> torch.Tensor:
    config = model.config
    gen = torch.Generator().manual_seed(5)
    shape = (config.num_layers, 2, 64, BLOCK, model.kv_heads, config.head_dim)
    return torch.randn(shape, generator=gen).to(dtype)  # histories: random K/V


@pytest.mark.parametrize(
    ("family", "backend", "dtype"),
    [
        ("llama", "cpu", torch.float32),
        ("llama", "cpu", torch.bfloat16),
        ("llama", "torch", torch.float32),
        ("gemma2", "torch", torch.float32),
        ("mixtral", "cpu", torch.float32),
    ],
)
@torch.no_grad()
def test_the_output_rows_alone_match_a_full_forward(
    family: str, backend: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    make = {"llama": _llama, "gemma2": _gemma, "mixtral": _mixtral}[family]
    model = make(backend, dtype, tmp_path)
    meta, ids, positions, counts = _step(model, [0, 7, 9, 12, 4])
    full_pool, kept_pool = _pool(model, dtype), _pool(model, dtype)
    full = model(ids, positions, full_pool, meta)  # [T, hidden]
    outputs = OutputRows.select(meta, counts)
    kept = model(ids, positions, kept_pool, meta, outputs)  # [R, hidden]
    assert torch.equal(kept_pool, full_pool)  # every row's K/V, every layer
    assert kept.shape == (outputs.count, model.config.hidden_size)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(kept, full[outputs.rows], atol=tol, rtol=tol)
    logits = model.compute_logits(kept)
    torch.testing.assert_close(
        logits, model.compute_logits(full[outputs.rows]), atol=5 * tol, rtol=tol
    )


@torch.no_grad()
def test_the_last_layer_runs_its_mlp_for_the_output_rows_only() -> None:
    model = build_tiny(torch.float32, "cpu")
    model.bind_backend(cpu_backend())
    meta, ids, positions, counts = _step(model, [0, 7, 9, 12, 4])
    seen: list[tuple[int, int]] = []  # (layer, rows into its down projection)
    for index, layer in enumerate(model.layers):
        layer.down_proj.register_forward_hook(
            lambda module, args, out, index=index: seen.append((index, args[0].shape[0]))
        )
    outputs = OutputRows.select(meta, counts)
    model(ids, positions, _pool(model, torch.float32), meta, outputs)
    last = len(model.layers) - 1
    assert seen == [*((i, 16) for i in range(last)), (last, 6)]

    # A step with no output row (prefill chunks only) stops the last layer at its KV write,
    # and its qkv projection computes k and v alone (the trailing columns), never q.
    projected: list[int] = []  # layers whose whole qkv projection ran
    for index, layer in enumerate(model.layers):
        layer.qkv_proj.register_forward_hook(
            lambda module, args, out, index=index: projected.append(index)
        )
    seen.clear()
    prefill = _meta([6, 5], [6, 12])
    none = OutputRows.select(prefill, [0, 0])
    pool = _pool(model, torch.float32)
    reference = pool.clone()
    hidden = model(ids[:11], positions[:11], pool, prefill, none)
    assert hidden.shape == (0, model.config.hidden_size)
    assert seen == [(i, 11) for i in range(last)]
    assert projected == list(range(last))
    full = model(ids[:11], positions[:11], reference, prefill)
    assert full.shape[0] == 11
    assert torch.equal(pool, reference)  # the same K/V in every layer, the last included

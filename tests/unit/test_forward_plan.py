"""ForwardPlan.inputs: the decode-only host path against the general torch path."""

from __future__ import annotations

import random

import pytest
import torch
from ferrum_server.kv.block_table import padded_block_table
from ferrum_server.parallel.plan import ForwardPlan


def _plan(counts: list[int], offsets: list[int], block_size: int, seed: int) -> ForwardPlan:
    """A plan whose item i has counts[i] new rows from offsets[i], its blocks scattered."""
    rng = random.Random(seed)
    ends = [offset + count for offset, count in zip(offsets, counts, strict=True)]
    rows = [rng.sample(range(1000), -(-end // block_size)) for end in ends]
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    return ForwardPlan(
        token_ids=torch.tensor([rng.randrange(32000) for _ in range(starts[-1])]),
        query_start=starts,
        offsets=offsets,
        context_lens=ends,
        block_tables=padded_block_table(rows, max(map(len, rows))),
        output_rows=torch.tensor([start - 1 for start in starts[1:]]),
        output_counts=[1] * len(counts),
    )


def _assert_same(plan: ForwardPlan, block_size: int) -> None:
    ids, positions, meta = plan.inputs(block_size)
    want_ids, want_positions, want = plan._general_inputs(block_size)
    assert torch.equal(ids, want_ids)
    assert positions.dtype == want_positions.dtype == torch.int64
    assert torch.equal(positions, want_positions)
    assert meta.slot_mapping.dtype == torch.int64
    assert torch.equal(meta.slot_mapping, want.slot_mapping)
    assert meta.query_start == want.query_start
    assert meta.context_lens == want.context_lens
    assert meta.decode_items == want.decode_items
    assert torch.equal(meta.decode_block_tables, want.decode_block_tables)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("seed", range(4))
def test_decode_only_inputs_equal_the_general_path(block_size: int, seed: int) -> None:
    rng = random.Random(seed)
    items = rng.randint(1, 70)
    # Offsets on and around block edges as well as inside blocks.
    edges = (0, block_size - 1, block_size)
    offsets = [rng.choice([*edges, rng.randrange(600)]) for _ in range(items)]
    plan = _plan([1] * items, offsets, block_size, seed)
    _, positions, meta = plan.inputs(block_size)
    assert positions.tolist() == offsets
    # Slot of a row: its position's block in the item's table, then the offset within it.
    table = plan.block_tables.tolist()
    assert meta.slot_mapping.tolist() == [
        table[i][p // block_size] * block_size + p % block_size for i, p in enumerate(offsets)
    ]
    _assert_same(plan, block_size)


def test_plans_with_prompt_chunks_take_the_general_path() -> None:
    plan = _plan([1, 5, 1, 17], [40, 0, 3, 16], 16, seed=7)
    _assert_same(plan, 16)
    assert plan.inputs(16)[1].tolist() == [40, 0, 1, 2, 3, 4, 3, *range(16, 33)]


def test_a_position_past_its_block_table_is_refused_on_both_paths() -> None:
    plan = _plan([1, 1], [5, 20], 16, seed=3)
    short = ForwardPlan(
        token_ids=plan.token_ids,
        query_start=plan.query_start,
        offsets=[5, 20 + 16 * plan.block_tables.shape[1]],  # a block the table does not hold
        context_lens=plan.context_lens,
        block_tables=plan.block_tables,
        output_rows=plan.output_rows,
        output_counts=plan.output_counts,
    )
    with pytest.raises(IndexError):
        short.inputs(16)
    with pytest.raises(IndexError):
        short._general_inputs(16)

"""padded_block_table: a step's block id lists as one padded int64 tensor."""

from __future__ import annotations

import random

import pytest
import torch
from ferrum_server.kv.block_table import padded_block_table


def _reference(rows: list[list[int]], width: int, fill: int) -> torch.Tensor:
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=torch.int64)


def test_rows_of_every_length_are_placed_in_order_and_padded() -> None:
    rng = random.Random(0)
    for _ in range(50):
        rows = [
            [rng.randrange(1 << 40) for _ in range(rng.randrange(0, 9))]
            for _ in range(rng.randrange(1, 12))
        ]
        width = max(map(len, rows)) + rng.randrange(0, 3)
        fill = rng.choice([0, 7, -1])
        table = padded_block_table(rows, width, fill)
        assert table.dtype == torch.int64 and table.shape == (len(rows), width)
        assert torch.equal(table, _reference(rows, width, fill))


def test_empty_step_and_zero_width() -> None:
    assert padded_block_table([], 4).shape == (0, 4)
    assert padded_block_table([[], []], 0).shape == (2, 0)


def test_a_row_wider_than_the_table_is_refused() -> None:
    with pytest.raises(ValueError, match="wider"):
        padded_block_table([[1, 2, 3]], 2)

"""A step's results as the columnar BatchResults the wire carries (convert.results_to_pb)."""

from __future__ import annotations

from ferrum_server.convert import results_to_pb
from ferrum_server.domain import ItemResult, ItemStatus


def test_top_logprobs_columns_hold_only_the_rows_that_asked() -> None:
    """Each token result holds one top-n list (empty when none was asked for); the flat top
    columns carry the non-empty ones in item order, and num_top_logprobs says how to split."""
    results = [
        ItemResult(ItemStatus.TOKEN, "a", 9, [5], [-0.5], [[5, 7]], [[-0.5, -1.5]]),
        ItemResult(ItemStatus.TOKEN, "b", 4, [3], [-0.1], [[]], [[]]),
        ItemResult(ItemStatus.INTERMEDIATE, "c", 8, completed_num_tokens=8),
        ItemResult(ItemStatus.TOKEN, "d", 2, [1], [-2.0], [[1, 0, 4]], [[-2.0, -2.5, -3.0]]),
    ]
    out = results_to_pb(results)
    assert list(out.num_top_logprobs) == [2, 0, 0, 3]
    assert list(out.top_token_ids) == [5, 7, 1, 0, 4]
    assert list(out.top_logprobs) == [-0.5, -1.5, -2.0, -2.5, -3.0]
    assert list(out.token_ids) == [5, 3, 0, 1]
    assert list(out.cache_ids) == ["a", "b", "c", "d"]

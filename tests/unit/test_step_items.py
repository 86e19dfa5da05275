"""Step items as validation resolves them."""

from __future__ import annotations

import dataclasses

from ferrum_server.domain import ItemKind, OutputPolicy, PromptIdentity, Sampling, StepItem


def test_with_tokens_carries_every_other_field() -> None:
    """with_tokens builds the item field by field (dataclasses.replace cost twice as much on
    the per-step path): no field may be left behind, including one added later."""
    values = {
        "kind": ItemKind.PREFILL_CHUNK,
        "request_id": "r1",
        "cache_id": "c1",
        "token_ids": [4, 5],
        "position": 16,
        "total_prompt_tokens": 40,
        "max_sequence_tokens": 64,
        "sampling": Sampling(temperature=0.5, num_logprobs=2, policy=OutputPolicy.TOKEN),
        "allow_narrowing": True,
        "prompt": PromptIdentity(digest=b"d", prefix_digest=b"p", prefix_tail=[1]),
        "continuation": True,
    }
    assert set(values) == {f.name for f in dataclasses.fields(StepItem)}, "a new field: add it"
    item = StepItem(**values)  # type: ignore[arg-type]
    resolved = item.with_tokens([9])
    assert resolved == dataclasses.replace(item, token_ids=[9])
    assert item.token_ids == [4, 5]  # the original is untouched

"""Driving an Engine directly (no server): batched greedy generation for engine-level tests."""

from __future__ import annotations

from ferrum_server.domain import ItemKind, Step, StepItem
from ferrum_server.engine import Engine


def greedy_decode(engine: Engine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill every prompt in one step, then decode them together for `steps` steps; returns
    each request's greedy tokens (steps + 1 each) and releases the caches."""
    first = engine.execute(
        Step(
            [
                StepItem(ItemKind.PREFILL_CHUNK, f"r{r}", "", p, 0, len(p))
                for r, p in enumerate(prompts)
            ]
        )
    )
    caches = [res.cache_id for res in first.results]
    tokens = [[res.token_ids[0]] for res in first.results]
    for _ in range(steps):
        items = [
            StepItem(
                ItemKind.DECODE, f"r{r}", caches[r], [tokens[r][-1]], len(p) + len(tokens[r]) - 1
            )
            for r, p in enumerate(prompts)
        ]
        for r, res in enumerate(engine.execute(Step(items)).results):
            tokens[r].append(res.token_ids[0])
    for cache in caches:
        engine.release(cache)
    return tokens

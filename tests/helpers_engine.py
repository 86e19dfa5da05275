"""Driving an Engine directly (no server): batched generation for engine-level tests."""

from __future__ import annotations

import time

from ferrum_server.domain import ItemKind, ItemStatus, OutputPolicy, Sampling, Step, StepItem
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


def decode_with(
    engine: Engine, prompts: list[list[int]], settings: list[Sampling], steps: int
) -> list[tuple[list[int], list[float]]]:
    """Prefill every prompt in one step (greedy), then `steps` decode steps of them all, item i
    sampled as settings[i], on the engine's thread; returns each item's decoded tokens and
    log-probs (none for an item whose policy is LOGITS: it is fed token 7 each step)."""
    out: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]

    def run() -> None:
        items = [
            StepItem(ItemKind.PREFILL_CHUNK, f"r{i}", "", p, 0, len(p))
            for i, p in enumerate(prompts)
        ]
        results = engine.execute(Step(items), time.perf_counter_ns()).results
        caches = [r.cache_id for r in results]
        tokens = [r.token_ids[0] for r in results]
        for step in range(steps):
            items = [
                StepItem(ItemKind.DECODE, f"r{i}", caches[i], [tokens[i]], len(p) + step,
                         sampling=settings[i])
                for i, p in enumerate(prompts)
            ]  # fmt: skip
            results = engine.execute(Step(items), time.perf_counter_ns()).results
            for i, result in enumerate(results):
                if settings[i].policy == OutputPolicy.LOGITS:
                    assert result.status == ItemStatus.LOGITS
                    tokens[i] = 7
                    continue
                assert result.status == ItemStatus.TOKEN
                tokens[i] = result.token_ids[0]
                out[i][0].append(result.token_ids[0])
                out[i][1].append(result.logprobs[0])

    engine.call_sync(run)
    return out

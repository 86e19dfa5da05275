"""Engine.launch / Engine.finish: a step launched while the one before it is still in flight.

A continuation decode launched before the step that selected its token has finished reads that
token on the device and commits a placeholder that the earlier step's finish resolves. Every
test here compares against the same requests run one step at a time with explicit tokens
(`Engine.execute`): the tokens, the caches' committed tokens and their block hashes must match.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from ferrum_kernels.attention import reference_decode_attention
from ferrum_kernels.backend import torch_backend
from ferrum_server import startup
from ferrum_server.config import EngineConfig
from ferrum_server.cuda_graphs import EagerCapturer
from ferrum_server.domain import ItemKind, ItemStatus, Sampling, Step, StepItem
from ferrum_server.engine import Engine, LaunchedStep
from ferrum_server.errors import InvalidArgument
from ferrum_server.kv.manager import KvManager
from ferrum_server.models import tiny_config
from helpers_launch import (
    BLOCK,
    Decoding,
    Request,
    make_requests,
    run_ahead,
    run_sequential,
)


def _engine(**overrides: object) -> Engine:
    config = EngineConfig(
        block_size=BLOCK,
        kv_cache_bytes=256 * tiny_config().kv_bytes_per_token(torch.float32) * BLOCK,
        max_batch_size=16,
        max_batch_tokens=64,
    )
    return Engine(replace(config, **overrides))


@pytest.fixture
def eager_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps 'replay' eager stand-ins of CUDA graphs on CPU (the graph path's inputs)."""
    monkeypatch.setattr(startup, "graph_capturer_for", lambda device: EagerCapturer())
    monkeypatch.setattr(
        startup,
        "select_backend",
        lambda device, prefer="auto": replace(
            torch_backend(), decode_attention=reference_decode_attention
        ),
    )


def _compare(engine_factory, count: int = 9, budget: int = 24) -> list[int]:
    reference = engine_factory()
    try:
        want = run_sequential(reference, make_requests(count), budget)
    finally:
        reference.shutdown()
    engine = engine_factory()
    seen: list[int] = []
    try:
        got = run_ahead(engine, make_requests(count), budget, seen)
        assert not engine._launched
        assert engine.kv.pool.num_used == 0  # every cache released, nothing leaked
    finally:
        engine.shutdown()
    assert got == want
    return seen


def test_steps_launched_ahead_match_steps_run_one_at_a_time() -> None:
    seen = _compare(_engine)
    assert max(seen) == 2  # the pipeline was full: two steps in flight


@pytest.mark.usefixtures("eager_graphs")
def test_graph_replays_read_continuation_tokens_on_the_device() -> None:
    factory = lambda: _engine(cuda_graph_max_batch=8)  # noqa: E731
    engine = factory()
    try:
        assert engine.graph_batch_sizes  # decode-only steps replay
    finally:
        engine.shutdown()
    _compare(factory, count=7, budget=12)


def test_a_penalised_continuation_waits_for_the_step_before_it() -> None:
    def penalised() -> list[Request]:
        requests = make_requests(4)
        requests[1].sampling = Sampling(repetition_penalty=1.3)
        return requests

    reference = _engine()
    try:
        want = run_sequential(reference, penalised(), 24)
    finally:
        reference.shutdown()
    engine = _engine()
    try:
        got = run_ahead(engine, penalised(), 24, [])
    finally:
        engine.shutdown()
    assert got == want


def _two_in_flight(engine: Engine) -> tuple[LaunchedStep, LaunchedStep, list[str]]:
    decoding = Decoding(engine, [[5, 6, 7, 8, 9], [1, 2, 3]])
    a = engine.launch(decoding.step(0))
    b = engine.launch(decoding.step(1))
    assert list(engine._launched) == [a, b]
    return a, b, decoding.caches


def test_release_of_a_cache_in_flight_finishes_what_holds_it() -> None:
    engine = _engine()
    try:
        a, b, caches = _two_in_flight(engine)
        engine.release(caches[0])
        assert a.outcome is not None and b.outcome is not None and not engine._launched
        assert engine.finish(b) is b.outcome  # answered once, the same outcome after
        # The other cache is whole: its placeholder was resolved to the token step `a` chose.
        cache = engine.kv.caches[caches[1]]
        assert cache.unresolved_position == -1
        assert cache.token_ids[-1] == a.outcome.results[1].token_ids[0]
        assert cache.selected_token == b.outcome.results[1].token_ids[0]
    finally:
        engine.shutdown()


def test_release_of_another_cache_leaves_steps_in_flight() -> None:
    engine = _engine()
    try:
        a, b, _ = _two_in_flight(engine)
        opened = engine.kv.open("loner", 16)
        engine.release(opened.cache_id)
        assert list(engine._launched) == [a, b] and a.outcome is None
        engine.finish(b)  # finishes `a` first
        assert a.outcome is not None and not engine._launched
    finally:
        engine.shutdown()


def test_every_other_engine_call_sees_finished_steps() -> None:
    engine = _engine()
    try:
        a, b, caches = _two_in_flight(engine)
        # Any call through the engine thread: what it reads, b's placeholders are resolved.
        unresolved = engine.call_sync(
            lambda: [c.unresolved_position for c in engine.kv.caches.values()]
        )
        assert a.outcome is not None and b.outcome is not None and not engine._launched
        assert unresolved == [-1, -1]
        truncated, _ = engine.call_sync(engine.truncate, caches[0], 5)
        assert truncated.num_tokens == 5
    finally:
        engine.shutdown()


def test_finish_of_a_step_launched_elsewhere_is_refused() -> None:
    engine, other = _engine(), _engine()
    try:
        _, b, _ = _two_in_flight(other)
        other.finish(b)
        with pytest.raises(InvalidArgument):
            engine.finish(replace(b, outcome=None))
    finally:
        engine.shutdown()
        other.shutdown()


def test_a_deferred_continuation_behind_a_step_in_flight_continues_later() -> None:
    # A pool of 6 blocks: a (5 tokens) and b (8) hold two each, a third cache the other two.
    # a decodes at positions 5 and 6 within its blocks; b at 8 needs a third block.
    engine = _engine(kv_cache_bytes=6 * tiny_config().kv_bytes_per_token(torch.float32) * BLOCK)
    try:
        first = engine.execute(
            Step(
                [
                    StepItem(ItemKind.PREFILL_CHUNK, "a", "", [1, 2, 3, 4, 5], 0, 5),
                    StepItem(ItemKind.PREFILL_CHUNK, "b", "", [9, 8, 7, 6, 5, 4, 3, 2], 0, 8),
                ]
            )
        )
        a_cache, b_cache = (r.cache_id for r in first.results)
        blocker = engine.kv.open("blocker", 16)
        engine.kv.grow(blocker, 8)  # the last two free blocks
        assert engine.kv.pool.num_available == 0
        step_one = engine.launch(
            Step([StepItem(ItemKind.DECODE, "a", a_cache, [], 5, continuation=True)])
        )
        step_two = engine.launch(
            Step(
                [
                    StepItem(ItemKind.DECODE, "a", a_cache, [], 6, continuation=True),
                    StepItem(ItemKind.DECODE, "b", b_cache, [], 8, continuation=True),
                ]
            )
        )
        one = engine.finish(step_one)
        two = engine.finish(step_two)
        assert two.results[1].status == ItemStatus.DEFERRED
        assert two.results[0].status == ItemStatus.TOKEN
        # b's selected token (from the prefill) is still there to continue from.
        engine.release(blocker.cache_id)
        again = engine.execute(
            Step([StepItem(ItemKind.DECODE, "b", b_cache, [], 8, continuation=True)])
        )
        assert again.results[0].status == ItemStatus.TOKEN
        b = engine.kv.caches[b_cache]
        assert b.token_ids[-1] == first.results[1].token_ids[0]
        a = engine.kv.caches[a_cache]
        assert a.token_ids[-2:] == [first.results[0].token_ids[0], one.results[0].token_ids[0]]
    finally:
        engine.shutdown()


def test_an_unresolved_token_is_hashed_once_resolved() -> None:
    direct, later = (KvManager(8, BLOCK, 4, 1, prefix_caching=True) for _ in range(2))
    tokens = [3, 1, 4, 1, 5, 9, 2]
    for kv in (direct, later):
        cache = kv.open("r", 32)
        kv.grow(cache, 8)
        kv.commit(cache, tokens)
    direct.commit(direct.caches[next(iter(direct.caches))], [6])
    cache = later.caches[next(iter(later.caches))]
    later.commit(cache, [0], unresolved=True)
    assert len(cache.block_hashes) == 1  # the second block waits for its last token
    later.check()
    with pytest.raises(RuntimeError):
        later.commit(cache, [7])  # nothing commits past an unresolved token
    with pytest.raises(RuntimeError):
        later.resolve(cache, 6, 6)  # not the unresolved position
    later.resolve(cache, 7, 6)
    want = direct.caches[next(iter(direct.caches))]
    assert cache.token_ids == want.token_ids and cache.block_hashes == want.block_hashes
    assert later.pool.num_cached == direct.pool.num_cached


def test_a_launched_step_whose_caller_left_releases_what_it_opened() -> None:
    engine = _engine()
    try:
        opened = engine.launch(Step([StepItem(ItemKind.PREFILL_CHUNK, "gone", "", [1, 2], 0, 2)]))
        assert engine.stats.running_items == 1
        engine.finish_orphan(opened)
        assert opened.outcome is not None and not engine.kv.caches
        assert engine.stats.running_items == 0
        engine.kv.check()
    finally:
        engine.shutdown()


def test_two_steps_in_flight_count_as_running_until_each_finishes() -> None:
    engine = _engine()
    try:
        a, b, _ = _two_in_flight(engine)
        assert engine.stats.running_items == 4  # two items in each
        assert engine.stats.launched_ahead_steps == 1  # b launched with a in flight
        assert engine.recorder.metrics.steps_launched_ahead._value.get() == 1
        engine.kv.check()  # placeholders committed, their blocks not yet hashed
        engine.finish(a)
        assert engine.stats.running_items == 2
        engine.finish(b)
        assert engine.stats.running_items == 0
        engine.kv.check()
    finally:
        engine.shutdown()

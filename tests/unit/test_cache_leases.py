"""Cache leases, prefix-mark expiry and slotless warmup, below the RPC layer (issue #17).

The KV manager and the capacity manager are driven with explicit clocks; the engine tests use the
tiny model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import structlog
import torch
from ferrum_server.capacity import Admitted, CapacityManager, Deferred
from ferrum_server.config import EngineConfig
from ferrum_server.domain import ItemKind, ShortfallKind, Step, StepItem
from ferrum_server.engine import Engine
from ferrum_server.errors import NotFound
from ferrum_server.kv.epochs import KV_BLOCKS, SEQUENCE_SLOTS
from ferrum_server.kv.manager import KvManager
from ferrum_server.kv.storage import KvStorage
from ferrum_server.recorder import Recorder
from ferrum_server.validate import Limits
from helpers_server import tiny_block_bytes

BLOCK = 4


def _kv(num_blocks: int = 16, max_sequences: int = 4) -> KvManager:
    return KvManager(num_blocks, BLOCK, max_sequences, coordinator_id=1)


def _capacity(kv: KvManager, prefix_pending_s: float = 2.0) -> CapacityManager:
    limits = Limits(
        vocab_size=64,
        max_sequence_length=64,
        max_batch_tokens=64,
        max_batch_size=8,
        max_num_logprobs=0,
        instance_id=1,
    )
    kv_cache = torch.zeros(1, 2, kv.pool.num_blocks, BLOCK, 1, 1)
    return CapacityManager(kv, KvStorage(kv_cache), limits, 0, Recorder(), prefix_pending_s)


def _admit(capacity: CapacityManager, request_id: str, tokens: list[int]) -> Admitted | Deferred:
    decision = capacity.try_admit(request_id, tokens, 0, len(tokens), 0)
    assert isinstance(decision, Admitted | Deferred), decision
    return decision


PREFIX = list(range(1, 13))  # three full blocks


# -- the lease in the KV manager --------------------------------------------------------------


def test_naming_a_cache_renews_it_and_idle_caches_are_the_untouched_ones() -> None:
    kv = _kv()
    old, fresh = kv.open("a", 64), kv.open("b", 64)
    old.touched_s = fresh.touched_s - 100
    now = fresh.touched_s + 1
    assert kv.idle_caches(50, now) == [old]
    kv.lookup(old.cache_id)  # a step, reservation or truncation names it
    assert kv.idle_caches(50, time.monotonic()) == []
    old.touched_s -= 100
    assert kv.renew([old.cache_id, "gone"]) == ["gone"]
    assert kv.idle_caches(50, time.monotonic()) == []
    old.touched_s -= 100
    assert kv.renew_request("a") == 1 and kv.idle_caches(50, time.monotonic()) == []


def test_an_expired_cache_is_not_found_and_says_why() -> None:
    kv = _kv()
    cache = kv.open("a", 64)
    assert kv.release(cache.cache_id, reason="expired").released
    with pytest.raises(NotFound, match="expired"):
        kv.lookup(cache.cache_id)
    assert not kv.release(cache.cache_id).released  # a late CompleteCache is a harmless repeat


# -- prefix marks -----------------------------------------------------------------------------


def test_a_first_chunk_shorter_than_the_prefix_ends_the_wait_for_the_rest() -> None:
    kv = _kv()
    capacity = _capacity(kv)
    owner = _admit(capacity, "owner", [*PREFIX, 50])
    assert isinstance(owner, Admitted)
    waiter = _admit(capacity, "waiter", [*PREFIX, 60])
    assert isinstance(waiter, Deferred)
    assert waiter.shortfalls[0].kind == ShortfallKind.PREFIX_PENDING
    generation = kv.clock.generations[KV_BLOCKS]
    cache = kv.caches[owner.cache_id]
    kv.commit(cache, PREFIX[:BLOCK])  # the first chunk computes one of the three blocks
    assert kv.clock.generations[KV_BLOCKS] > generation  # the waiter is woken
    match = kv.match_prefix([*PREFIX, 60])
    assert (match.num_blocks, match.num_pending) == (1, 0)
    assert isinstance(_admit(capacity, "waiter", [*PREFIX, 60]), Admitted)
    kv.check()


def test_a_first_chunk_of_other_tokens_ends_the_wait() -> None:
    kv = _kv()
    capacity = _capacity(kv)
    owner = _admit(capacity, "owner", [*PREFIX, 50])
    assert isinstance(owner, Admitted)
    kv.commit(kv.caches[owner.cache_id], [40, 41, 42, 43, 44, 45, 46, 47])
    match = kv.match_prefix([*PREFIX, 60])
    assert (match.num_blocks, match.num_pending) == (0, 0)
    kv.check()


def test_prefix_marks_expire_after_the_bound_and_wake_the_waiters() -> None:
    kv = _kv()
    capacity = _capacity(kv, prefix_pending_s=0.5)
    owner = _admit(capacity, "owner", [*PREFIX, 50])
    assert isinstance(owner, Admitted)
    cache = kv.caches[owner.cache_id]
    assert kv.expire_pending(0.5, cache.opened_s + 0.4) == []
    assert kv.match_prefix([*PREFIX, 60]).num_pending == 3
    generation = kv.clock.generations[KV_BLOCKS]
    assert kv.expire_pending(0.5, cache.opened_s + 0.5) == [cache]
    assert kv.clock.generations[KV_BLOCKS] == generation + 1
    assert kv.match_prefix([*PREFIX, 60]).num_pending == 0
    kv.check()


def test_admission_itself_ignores_marks_past_the_bound() -> None:
    kv = _kv()
    capacity = _capacity(kv, prefix_pending_s=0.5)
    owner = _admit(capacity, "owner", [*PREFIX, 50])
    assert isinstance(owner, Admitted)
    assert isinstance(_admit(capacity, "waiter", [*PREFIX, 60]), Deferred)
    kv.caches[owner.cache_id].opened_s -= 1.0  # the owner's first chunk is overdue
    assert isinstance(_admit(capacity, "waiter", [*PREFIX, 60]), Admitted)
    kv.check()


def test_releasing_the_owner_wakes_the_waiters_on_the_kv_source() -> None:
    kv = _kv()
    capacity = _capacity(kv)
    owner = _admit(capacity, "owner", [*PREFIX, 50])
    assert isinstance(owner, Admitted)
    generation = kv.clock.generations[KV_BLOCKS]
    kv.release(owner.cache_id)
    assert kv.clock.generations[KV_BLOCKS] > generation
    assert kv.match_prefix([*PREFIX, 60]).num_pending == 0


# -- the engine: sweep and warmup -------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    """Two sequence slots and 16 blocks of 4 tokens; a 60 s lease (the tests move the clock)."""
    engine = Engine(
        EngineConfig(
            block_size=BLOCK,
            kv_cache_bytes=16 * tiny_block_bytes(BLOCK),
            max_batch_tokens=64,
            max_batch_size=2,
            cache_lease_s=60.0,
        )
    )
    yield engine
    engine.shutdown()


def _open(engine: Engine, request_id: str, length: int = 6) -> str:
    tokens = list(range(1, length + 1))
    item = StepItem(ItemKind.PREFILL_CHUNK, request_id, "", tokens, 0, length)
    return engine.execute(Step([item])).results[0].cache_id


def _state(engine: Engine) -> tuple[object, ...]:
    kv = engine.kv
    caches = {c.cache_id: (list(c.block_ids), c.num_tokens) for c in kv.caches.values()}
    return kv.usage(), caches, dict(kv.clock.generations), kv.clock.release_epoch


def test_the_sweep_releases_caches_idle_past_the_lease(engine: Engine) -> None:
    idle, busy = _open(engine, "idle"), _open(engine, "busy")
    now = time.monotonic()
    engine.kv.caches[idle].touched_s = now - 61
    engine.kv.caches[busy].touched_s = now - 59
    expired_before = engine.recorder.metrics.caches_expired._value.get()
    slots = engine.kv.clock.generations[SEQUENCE_SLOTS]
    with structlog.testing.capture_logs() as logs:
        assert engine.sweep(now) == 1
    assert engine.recorder.metrics.caches_expired._value.get() == expired_before + 1
    assert engine.kv.clock.generations[SEQUENCE_SLOTS] == slots + 1  # capacity waiters wake
    (event,) = [e for e in logs if e["event"] == "cache_lease_expired"]
    assert event["request_id"] == "idle" and event["cache_id"] == idle
    assert event["idle_s"] >= 61 and event["blocks_freed"] == 2
    with pytest.raises(NotFound, match="expired"):
        engine.kv.lookup(idle)
    assert list(engine.kv.caches) == [busy]
    engine.kv.check()
    engine.release(busy)


def test_renewed_and_stepped_caches_stay(engine: Engine) -> None:
    renewed, stepped = _open(engine, "renewed"), _open(engine, "stepped")
    for cache_id in (renewed, stepped):
        engine.kv.caches[cache_id].touched_s -= 61
    assert engine.renew_leases([renewed, "unknown"]) == ["unknown"]
    decode = StepItem(ItemKind.DECODE, "stepped", stepped, [7], 6)
    engine.execute(Step([decode]))
    assert engine.sweep() == 0
    assert set(engine.kv.caches) == {renewed, stepped}
    engine.release(renewed)
    engine.release(stepped)


def test_swapped_kv_expires_with_the_lease(engine: Engine) -> None:
    from ferrum_server.capacity import PreemptionMode

    cache_id = _open(engine, "swapped")
    receipt = engine.capacity.preempt("swapped", cache_id, PreemptionMode.SWAP)
    assert receipt.mode == PreemptionMode.SWAP and "swapped" in engine.capacity.swapped
    engine.sweep(time.monotonic() + 30)
    assert "swapped" in engine.capacity.swapped
    engine.sweep(time.monotonic() + 61)
    assert "swapped" not in engine.capacity.swapped


def test_a_zero_lease_never_expires_anything() -> None:
    engine = Engine(
        EngineConfig(block_size=BLOCK, kv_cache_bytes=16 * tiny_block_bytes(BLOCK), cache_lease_s=0)
    )
    try:
        cache_id = _open(engine, "kept")
        assert engine.sweep(time.monotonic() + 10**6) == 0
        assert cache_id in engine.kv.caches
    finally:
        engine.shutdown()


def test_warmup_runs_while_every_sequence_slot_is_taken_and_changes_nothing(
    engine: Engine,
) -> None:
    held = [_open(engine, "a"), _open(engine, "b")]
    assert engine.kv.num_free_sequence_slots == 0
    before = _state(engine)
    outcome = engine.warmup(16)
    assert outcome.deferral is None and outcome.num_tokens == 16 and outcome.forward_ms > 0
    assert _state(engine) == before
    engine.kv.check()
    for cache_id in held:
        engine.release(cache_id)


def test_warmup_runs_in_what_is_available_and_defers_when_nothing_is(engine: Engine) -> None:
    kv = engine.kv
    big = StepItem(ItemKind.PREFILL_CHUNK, "big", "", list(range(1, 57)), 0, 56)
    held = [engine.execute(Step([big])).results[0].cache_id]  # 14 of the 16 blocks
    outcome = engine.warmup(64)
    assert outcome.deferral is None and outcome.num_tokens == 2 * BLOCK
    held.append(_open(engine, "rest", 8))  # the last two blocks
    assert kv.pool.num_available == 0
    before = _state(engine)
    outcome = engine.warmup(16)
    assert outcome.num_tokens == 0 and outcome.deferral is not None
    assert [source for source, _ in outcome.deferral.observed] == [KV_BLOCKS]
    assert _state(engine) == before
    for cache_id in held:
        engine.release(cache_id)
    kv.check()

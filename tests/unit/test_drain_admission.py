"""A draining engine runs the requests it holds and opens no new cache, except for steps that
were already in flight when the drain began (engine level; the RPC edge and the two drain
phases are tested in tests/integration/test_operations.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from ferrum_server.config import EngineConfig
from ferrum_server.domain import DeferralMode, ItemKind, ItemStatus, Step, StepItem
from ferrum_server.engine import Engine
from ferrum_server.errors import Draining, ErrorReason


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    built = Engine(EngineConfig(block_size=4, kv_cache_bytes=1 << 20))
    yield built
    built.shutdown()


def _open(request_id: str) -> StepItem:
    return StepItem(ItemKind.PREFILL_CHUNK, request_id, "", [1, 2, 3, 4, 5], 0, 5)


def test_held_requests_run_and_new_ones_are_refused(engine: Engine) -> None:
    opened = engine.execute(Step([_open("held")]), time.perf_counter_ns()).results[0]
    before_drain = time.perf_counter_ns()
    engine.begin_drain(time.perf_counter_ns())
    try:
        decode = StepItem(ItemKind.DECODE, "held", opened.cache_id, [opened.token_ids[0]], 5)
        step = Step([decode, _open("new")], mode=DeferralMode.PER_ITEM)
        held, new = engine.execute(step, time.perf_counter_ns()).results
        assert held.status == ItemStatus.TOKEN and held.committed_tokens == 6
        assert new.status == ItemStatus.FAILED and new.failure is not None
        assert new.failure.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "draining" in new.failure.message
        assert "new" not in engine.kv.by_request  # nothing was opened for it
        # Outside PER_ITEM the whole step is refused, as the authority checks do.
        with pytest.raises(Draining) as caught:
            engine.execute(
                Step([_open("new")], mode=DeferralMode.ALL_OR_NOTHING), time.perf_counter_ns()
            )
        assert caught.value.reason == ErrorReason.DRAINING
        # A step received before the drain began was in flight: it still opens its cache.
        late = engine.execute(Step([_open("in-flight")]), before_drain).results[0]
        assert late.status == ItemStatus.TOKEN
        engine.release(late.cache_id)
    finally:
        engine.drain_began_ns = 0
        engine.release(opened.cache_id)

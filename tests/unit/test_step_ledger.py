"""The step ledger's bounds (count, bytes, evicted-id memory), per-caller scopes, and what an
evicted id answers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ferrum_client.pb import executor_pb2 as pb
from ferrum_server.dispatch import step_scope
from ferrum_server.errors import (
    AlreadyExists,
    ErrorReason,
    ExecutionFailed,
    InvalidArgument,
    StepResultEvicted,
)
from ferrum_server.security import ANONYMOUS
from ferrum_server.step_ledger import Entry, StepLedger, fingerprint
from ferrum_server.tickets import Ticket

ROW = 1000  # bytes of logits per response row in these tests


def _response(rows: int) -> pb.ForwardVerifyResponse:
    return pb.ForwardVerifyResponse(completed=pb.ForwardVerifyOutput(logits=b"\1" * (ROW * rows)))


def _request(step_id: int, payload: int = 0) -> pb.ForwardVerifyRequest:
    return pb.ForwardVerifyRequest(cache_id="c", token_ids=[payload], step_id=step_id)


class Harness:
    """Drives a ledger the way the dispatcher does, with tasks that finish when told."""

    def __init__(self, ledger: StepLedger) -> None:
        self.ledger = ledger
        self.reported: list[int] = []

    def start(self, step_id: int, scope: str = "a", payload: int = 0) -> asyncio.Future[Any]:
        key = fingerprint("ForwardVerify", _request(step_id, payload))
        assert self.ledger.find(scope, step_id, key) is None
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(done)
        self.ledger.add(scope, step_id, Entry(key, task, Ticket()))
        return done

    async def finish(self, step_id: int, rows: int, scope: str = "a") -> None:
        self.start(step_id, scope).set_result(_response(rows))
        await asyncio.sleep(0)  # the task completes
        await asyncio.sleep(0)  # and its done callbacks run

    def find(self, step_id: int, scope: str = "a", payload: int = 0) -> Entry | None:
        key = fingerprint("ForwardVerify", _request(step_id, payload))
        return self.ledger.find(scope, step_id, key)


def _harness(
    max_entries: int = 100, max_bytes: int = 10 * ROW + 100, max_evicted: int = 100
) -> Harness:
    reported: list[int] = []
    harness = Harness(StepLedger(max_entries, max_bytes, max_evicted, on_bytes=reported.append))
    harness.reported = reported
    return harness


async def test_stored_responses_are_bounded_in_bytes_oldest_first() -> None:
    h = _harness()
    for step_id in range(1, 11):
        await h.finish(step_id, rows=3)  # about 3 kB each; the bound holds 3 of them
        assert h.ledger.num_bytes <= h.ledger.max_bytes
    assert len(h.ledger) == 3
    assert h.reported[-1] == h.ledger.num_bytes
    for newest in (8, 9, 10):
        entry = h.find(newest)
        assert entry is not None and entry.task.result() == _response(3)
    for evicted in range(1, 8):
        with pytest.raises(StepResultEvicted) as caught:
            h.find(evicted)
        assert caught.value.reason == ErrorReason.STEP_RESULT_EVICTED
        assert "no longer held" in caught.value.message
    # The evicted id still refuses another request under it.
    with pytest.raises(AlreadyExists):
        h.find(1, payload=5)


async def test_a_response_larger_than_the_bound_is_not_kept() -> None:
    h = _harness()
    await h.finish(1, rows=1)
    await h.finish(2, rows=11)  # larger than the whole bound
    assert h.ledger.num_bytes < 2 * ROW and len(h.ledger) == 1
    assert h.find(1) is not None
    with pytest.raises(StepResultEvicted):
        h.find(2)


async def test_the_count_bound_evicts_to_the_typed_answer_too() -> None:
    h = _harness(max_entries=2)
    for step_id in (1, 2, 3):
        await h.finish(step_id, rows=0)
    assert len(h.ledger) == 2
    with pytest.raises(StepResultEvicted):
        h.find(1)


async def test_the_evicted_id_memory_is_bounded_and_older_ids_are_unknown() -> None:
    h = _harness(max_entries=1, max_evicted=3)
    for step_id in range(1, 7):
        await h.finish(step_id, rows=0)
    # 1..5 were evicted; only 3..5 are remembered.
    assert h.ledger.num_evicted_remembered == 3
    for remembered in (3, 4, 5):
        with pytest.raises(StepResultEvicted):
            h.find(remembered)
    assert h.find(1) is None and h.find(2) is None  # forgotten entirely: would run again


async def test_a_running_step_evicted_by_count_that_then_runs_nothing_is_forgotten() -> None:
    h = _harness(max_entries=1)
    running = h.start(1)
    await h.finish(2, rows=0)  # evicts 1 while it runs
    running.set_exception(InvalidArgument("refused: nothing ran"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert h.find(1) is None  # a corrected retry may run


async def test_internal_failures_are_kept_and_counted() -> None:
    h = _harness()
    h.start(1).set_exception(ExecutionFailed("boom"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    entry = h.find(1)
    assert entry is not None and isinstance(entry.task.exception(), ExecutionFailed)
    assert h.ledger.num_bytes == len("boom")


async def test_step_ids_of_different_scopes_are_different_steps() -> None:
    h = _harness()
    await h.finish(1, rows=1, scope="token:aaaa")
    assert h.find(1, scope="token:bbbb") is None
    assert h.find(1, scope="session:x") is None
    assert h.find(1, scope="token:aaaa") is not None
    # Another caller may use the id for another request: no ALREADY_EXISTS across scopes.
    assert h.find(1, scope="token:bbbb", payload=7) is None


async def test_an_answered_entry_keeps_only_the_response() -> None:
    """The work's ticket keeps the domain result (logits included) for its orphan hook; once
    answered, the ledger holds a bare ticket instead, so it holds one copy of the bytes."""
    h = _harness()
    key = fingerprint("ForwardVerify", _request(1))
    work: Ticket[Any] = Ticket()
    work.value = b"domain copy of the logits"
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    h.ledger.add("a", 1, Entry(key, asyncio.ensure_future(done), work))
    done.set_result(_response(1))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    entry = h.find(1)
    assert entry is not None and entry.ticket is not work and entry.ticket.value is None
    assert entry.ticket.join(None)  # retries still join it
    assert not entry.ticket.leave()  # and leaving never runs an orphan hook


def test_step_scope_is_the_caller_refined_by_its_session() -> None:
    assert step_scope(()) == ANONYMOUS
    assert step_scope((("ferrum-session", "s1"),)) == "session:s1"
    token = step_scope((("authorization", "Bearer t0k"),))
    assert token.startswith("token:") and "t0k" not in token
    both = step_scope((("authorization", "Bearer t0k"), ("ferrum-session", "s1")))
    assert both == token + " session:s1"
    for metadata in (
        (("ferrum-session", "s" * 257),),
        (("authorization", "Bearer t0k"), ("ferrum-session", "s" * 257)),
    ):
        with pytest.raises(InvalidArgument, match="256 bytes"):
            step_scope(metadata)


def test_the_ledger_bounds_are_validated() -> None:
    from ferrum_server.config import ServerConfig

    assert ServerConfig().step_ledger_max_bytes == 64 * 1024**2
    assert ServerConfig().step_ledger_evicted_ids == 65536
    ServerConfig(step_ledger_max_bytes=0)  # keep no response: every retry after the answer is typed
    for bad in ({"step_ledger_max_bytes": -1}, {"step_ledger_evicted_ids": 0}):
        with pytest.raises(ValueError, match="step ledger"):
            ServerConfig(**bad)  # type: ignore[arg-type]

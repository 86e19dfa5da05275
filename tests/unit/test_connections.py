"""ConnectionPool's slot accounting, without a server (channels are created, never used)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from ferrum_client.connections import ConnectionPool
from ferrum_client.errors import ClientClosedError, DeadlineExceededError


def _pool(calls: int, connections: int) -> ConnectionPool:
    return ConnectionPool(lambda: grpc.aio.insecure_channel("127.0.0.1:9"), calls, connections)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_short_calls_keep_a_quarter_and_queues_are_first_come_first_served() -> None:
    pool = _pool(2, 2)  # 4 slots, 3 for long-lived calls
    assert pool.long_lived_limit == 3
    longs = [await pool.acquire(long_lived=True) for _ in range(3)]
    assert len(pool.lanes) == 2  # the second connection opened when the first was full
    late_long = asyncio.ensure_future(pool.acquire(long_lived=True))
    await _settle()
    assert pool.queued == 1
    short = await pool.acquire()  # the reserved slot: no waiting behind the long call
    queued_short = asyncio.ensure_future(pool.acquire())
    await _settle()
    assert pool.queued == 2 and pool.in_flight == 4
    pool.release(longs[0])  # the first in line that can start is the long call
    await _settle()
    assert late_long.done() and not queued_short.done()
    pool.release(short)
    await _settle()
    assert queued_short.done()
    for slot in (*longs[1:], late_long.result(), queued_short.result()):
        pool.release(slot)
    assert pool.in_flight == 0 and pool.long_lived == 0 and pool.queued == 0
    await pool.close()


async def test_a_slot_granted_to_a_call_cancelled_meanwhile_goes_to_the_next() -> None:
    pool = _pool(1, 1)
    held = await pool.acquire()
    first = asyncio.ensure_future(pool.acquire())
    second = asyncio.ensure_future(pool.acquire())
    await _settle()
    pool.release(held)  # granted to `first` ...
    first.cancel()  # ... which is cancelled before it runs: it passes the slot on
    await _settle()
    assert first.cancelled()
    assert second.done() and pool.in_flight == 1
    pool.release(second.result())
    assert pool.in_flight == 0 and pool.queued == 0
    await pool.close()


async def test_a_queued_call_times_out_and_close_fails_the_rest() -> None:
    pool = _pool(1, 1)
    held = await pool.acquire()
    with pytest.raises(DeadlineExceededError):
        await pool.acquire(0.05)
    assert pool.queued == 0
    queued = asyncio.ensure_future(pool.acquire())
    await _settle()
    await pool.close()
    with pytest.raises(ClientClosedError):
        await queued
    with pytest.raises(ClientClosedError):
        await pool.acquire()
    pool.release(held)
    assert pool.in_flight == 0


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        ConnectionPool(lambda: None, 0, 1)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match=">= 1"):
        ConnectionPool(lambda: None, 1, 0)  # type: ignore[arg-type,return-value]

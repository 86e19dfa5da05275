"""The connections of one `AsyncExecutorClient`: up to `max_connections` HTTP/2 connections to
one executor, each carrying at most `calls_per_connection` calls at once; a call beyond every
bound waits here, first come first served, until one ends (or is cancelled).

Why the client bounds its own calls: an HTTP/2 server admits at most SETTINGS_MAX_CONCURRENT_
STREAMS streams per connection (the executor's --max-concurrent-streams, 256 by default). grpc
core queues the client's streams beyond the number the server advertises, but it counts a
stream as over once it has received the trailers (or sent a cancel), while the server counts it
until its call object is freed, a moment later, and refuses streams in between with RST_STREAM
REFUSED_STREAM, which the caller sees as UNAVAILABLE. A burst of calls that end together
(capacity waits woken by one release, reads cancelled at once) lets grpc start as many queued
streams inside that gap: 400 waits on one connection had 45 to 94 refused, 600 had 317. With at
most half the server's limit in flight on a connection, a whole burst of ends and restarts stays
within the limit. Calls beyond a connection's bound go to a further connection while there are
fewer than `max_connections`, so many long waits do not hold back short calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc

from ferrum_client.errors import ClientClosedError, DeadlineExceededError
from ferrum_client.pb import executor_pb2_grpc as pb_grpc

# Half the executor's default SETTINGS_MAX_CONCURRENT_STREAMS (256): see the module docstring.
CALLS_PER_CONNECTION = 128
MAX_CONNECTIONS = 4
# Share of all slots (128 of 512 by default) that long-lived calls may not take.
SHORT_CALL_SHARE = 0.25


@dataclass(eq=False, slots=True)
class Lane:
    """One connection (a channel that shares its connection with no other channel) and the
    number of calls it carries now."""

    channel: grpc.aio.Channel
    stub: pb_grpc.ExecutorServiceAsyncStub
    health: health_pb2_grpc.HealthStub
    in_flight: int = 0


@dataclass(eq=False, slots=True)
class Slot:
    """The right to run one call on `lane`; give it back with `ConnectionPool.release`."""

    lane: Lane
    long_lived: bool


@dataclass(eq=False, slots=True)
class _Waiter:
    long_lived: bool
    granted: asyncio.Future[Slot]


class ConnectionPool:
    """Hands out call slots on the lanes, opening a lane when every open one is full.

    Long-lived calls (capacity waits, capacity watches, step streams: they end when something
    else happens) may hold at most `long_lived_limit` slots, three quarters of all; the rest
    stay free for short calls, so a release or an admission never queues behind waits that
    only it can end.
    """

    def __init__(
        self,
        open_channel: Callable[[], grpc.aio.Channel],
        calls_per_connection: int = CALLS_PER_CONNECTION,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if calls_per_connection < 1 or max_connections < 1:
            raise ValueError(
                "calls_per_connection and max_connections must be >= 1, got "
                f"{calls_per_connection} and {max_connections}"
            )
        self.calls_per_connection = calls_per_connection
        self.max_connections = max_connections
        total = calls_per_connection * max_connections
        self.long_lived_limit = max(1, total - int(total * SHORT_CALL_SHARE))
        self._open_channel = open_channel
        self.lanes = [self._open()]  # the first connection is made up front, as a channel is
        self.long_lived = 0
        self._waiters: deque[_Waiter] = deque()
        self._closed = False

    def _open(self) -> Lane:
        channel = self._open_channel()
        return Lane(
            channel, pb_grpc.ExecutorServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        )

    @property
    def in_flight(self) -> int:
        return sum(lane.in_flight for lane in self.lanes)

    @property
    def queued(self) -> int:
        return sum(1 for waiter in self._waiters if not waiter.granted.done())

    @contextlib.asynccontextmanager
    async def slot(
        self, timeout_s: float | None = None, *, long_lived: bool = False
    ) -> AsyncIterator[Lane]:
        """A call slot for the body's duration, released however the body ends."""
        slot = await self.acquire(timeout_s, long_lived=long_lived)
        try:
            yield slot.lane
        finally:
            self.release(slot)

    async def acquire(self, timeout_s: float | None = None, *, long_lived: bool = False) -> Slot:
        """A call slot; waits (at most `timeout_s`, None = no limit) while none is free.
        Every acquire that returns must be paired with one `release`."""
        if self._closed:
            raise ClientClosedError("the client is closed")
        # Every queued call is one that could not start (each release re-offers the freed slot
        # to the queue in order), so a call that can start now overtakes none of its kind.
        slot = self._grant(long_lived)
        if slot is not None:
            return slot
        waiter = _Waiter(long_lived, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter.granted
        except BaseException as exc:
            granted = waiter.granted
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                self.release(granted.result())  # the slot came as we gave up: pass it on
            else:
                granted.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise DeadlineExceededError(
                    f"no call slot freed within {timeout_s:.3g} s: {self.in_flight} calls in "
                    f"flight on {len(self.lanes)} connections"
                ) from None
            raise

    def release(self, slot: Slot) -> None:
        slot.lane.in_flight -= 1
        self.long_lived -= slot.long_lived
        for waiter in list(self._waiters):  # the first queued calls that can start now, start
            if waiter.granted.done():
                self._waiters.remove(waiter)
                continue
            granted = self._grant(waiter.long_lived)
            if granted is None:
                if not waiter.long_lived:
                    break  # no lane has room: nothing else can start either
                continue
            self._waiters.remove(waiter)
            waiter.granted.set_result(granted)

    def _grant(self, long_lived: bool) -> Slot | None:
        if long_lived and self.long_lived >= self.long_lived_limit:
            return None
        lane = self._free_lane()
        if lane is None:
            return None
        lane.in_flight += 1
        self.long_lived += long_lived
        return Slot(lane, long_lived)

    def _free_lane(self) -> Lane | None:
        for lane in self.lanes:  # fill the first connections first: open as few as needed
            if lane.in_flight < self.calls_per_connection:
                return lane
        if len(self.lanes) < self.max_connections:
            self.lanes.append(self._open())
            return self.lanes[-1]
        return None

    async def close(self) -> None:
        """Fail queued calls (ClientClosedError) and close every connection."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.granted.done():
                waiter.granted.set_exception(ClientClosedError("the client was closed"))
        for lane in self.lanes:
            await lane.channel.close(None)

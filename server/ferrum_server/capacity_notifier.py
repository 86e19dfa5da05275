"""Waiting for capacity without polling.

The engine thread bumps epochs; a listener forwards each new state to the event loop, which
wakes parked waiters and feeds watch streams. A wait subscribes, then re-checks the condition
against the current generations, then parks: a release between the caller's probe and the park
is never missed because the wake-up is delivered after the subscription.

A watch holds only the newest state its subscriber has not read yet: changes coalesce, so a
subscriber that reads slowly (or stops) costs one state, however many changes pass. A drain
ends every wait and watch at once (`end_waits`), with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ferrum_server.errors import InvalidArgument, StaleInstance, Unavailable
from ferrum_server.kv.epochs import Epochs, Source, SourceKey
from ferrum_server.kv.manager import KvManager


@dataclass(frozen=True, slots=True)
class CapacityState:
    epochs: Epochs
    generations: dict[SourceKey, int]
    total_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    # Held past the committed tokens (admitted, not yet written).
    reserved_blocks: int = 0


@dataclass(frozen=True, slots=True)
class WaitResult:
    changed: bool
    state: CapacityState
    sources: list[tuple[SourceKey, int]]


class Watch:
    """One subscriber's pending change: the newest state it has not read, or none."""

    def __init__(self) -> None:
        self._newest: CapacityState | None = None
        self._ended = ""  # why the watch ended (a drain), or "" while open
        self._changed = asyncio.Event()

    @property
    def pending(self) -> int:
        """States waiting for the subscriber: 0 or 1, however many changes passed."""
        return int(self._newest is not None)

    def offer(self, state: CapacityState) -> None:
        self._newest = state  # replaces an unread older state
        self._changed.set()

    def end(self, reason: str) -> None:
        self._ended = reason
        self._changed.set()

    async def next(self) -> CapacityState:
        """The newest state since the last read (waits for a change); Unavailable once ended."""
        while self._newest is None or self._ended:
            if self._ended:
                raise Unavailable(self._ended)
            self._changed.clear()
            await self._changed.wait()
        state, self._newest = self._newest, None
        return state


def _state_of(kv: KvManager) -> CapacityState:
    pool = kv.pool
    return CapacityState(
        kv.clock.snapshot(),
        dict(kv.clock.generations),
        pool.num_blocks,
        pool.num_free,
        pool.num_cached,
        pool.num_used,
        kv.num_reserved_blocks,
    )


class CapacityNotifier:
    def __init__(self, kv: KvManager, loop: asyncio.AbstractEventLoop) -> None:
        self._kv = kv
        self._loop = loop
        self.state = _state_of(kv)
        self._waiters: set[asyncio.Future[None]] = set()
        self._watchers: set[Watch] = set()
        self._ended = ""  # set by end_waits: why every wait and watch fails now
        self.num_wakeups = 0
        kv.clock.listeners.append(self._on_bump)

    def close(self) -> None:
        """Stop listening (the loop may be about to close)."""
        if self._on_bump in self._kv.clock.listeners:
            self._kv.clock.listeners.remove(self._on_bump)

    def _on_bump(self) -> None:
        """Engine thread: snapshot now, publish on the loop."""
        state = _state_of(self._kv)
        self._loop.call_soon_threadsafe(self._publish, state)

    def _publish(self, state: CapacityState) -> None:
        self.state = state
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        for watch in self._watchers:
            watch.offer(state)

    def end_waits(self, reason: str) -> None:
        """End every wait and watch, now and later, with Unavailable(reason) (a drain)."""
        self._ended = reason
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        for watch in self._watchers:
            watch.end(reason)

    def _check(self, coordinator_id: int, observed: list[tuple[SourceKey, int]]) -> bool:
        if coordinator_id != self.state.epochs.coordinator_id:
            raise StaleInstance(
                f"wait condition names coordinator {coordinator_id}; this executor is "
                f"{self.state.epochs.coordinator_id}"
            )
        changed = False
        for source, generation in observed:
            current = self.state.generations[source]
            if generation > current:
                raise StaleInstance(
                    f"observed generation {generation} of {source[0].name} is ahead of the "
                    f"executor's {current} (epochs never go backwards)"
                )
            changed |= current > generation
        return changed

    async def wait(
        self, coordinator_id: int, observed: list[tuple[SourceKey, int]], timeout_s: float | None
    ) -> WaitResult:
        validate_condition(observed, self.state.generations)
        deadline = None if timeout_s is None else self._loop.time() + timeout_s
        while True:
            if self._ended:
                raise Unavailable(self._ended)
            waiter: asyncio.Future[None] = self._loop.create_future()
            self._waiters.add(waiter)  # subscribe first ...
            if self._check(coordinator_id, observed):  # ... then re-check ...
                self._waiters.discard(waiter)
                return self._result(True, observed)
            remaining = None if deadline is None else deadline - self._loop.time()
            if remaining is not None and remaining <= 0:
                self._waiters.discard(waiter)
                return self._result(False, observed)
            try:
                await asyncio.wait_for(waiter, remaining)  # ... then park
            except TimeoutError:
                return self._result(False, observed)
            finally:
                # Also when the caller goes away (cancelled): a parked waiter must not outlive
                # its call, or cancelled waits would pile up until the next capacity change.
                self._waiters.discard(waiter)
            self.num_wakeups += 1

    def _result(self, changed: bool, observed: list[tuple[SourceKey, int]]) -> WaitResult:
        sources = [(source, self.state.generations[source]) for source, _ in observed]
        return WaitResult(changed, self.state, sources)

    @property
    def num_parked(self) -> int:
        """Waits parked now (each a live WaitForCapacityChange call)."""
        return len(self._waiters)

    def watch(self) -> Watch:
        watch = Watch()
        if self._ended:
            watch.end(self._ended)
        self._watchers.add(watch)
        return watch

    def unwatch(self, watch: Watch) -> None:
        self._watchers.discard(watch)


def validate_condition(
    observed: list[tuple[SourceKey, int]], generations: dict[SourceKey, int]
) -> None:
    if not observed:
        raise InvalidArgument("a wait condition needs at least one observed source")
    keys = [source for source, _ in observed]
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise InvalidArgument("observed sources must be sorted and unique")
    for source, generation in observed:
        if source not in generations:
            raise InvalidArgument(f"unknown capacity source {source}")
        if generation == 0:
            raise InvalidArgument("observed generations are never 0")


def source_key(source: int, domain: int) -> SourceKey:
    try:
        return (Source(source), domain)
    except ValueError:
        raise InvalidArgument(f"unknown capacity source {source}") from None

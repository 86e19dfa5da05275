"""The execution-event feed (the seed's execution event sink): steps completed, preemptions,
releases and completions, each stamped with the epochs after it.

Events are made on the engine thread and handed to the event loop in batches: `publish` appends
to a bounded hand-off queue under a lock and schedules at most one loop callback until that
callback has run, so a busy step loop costs one append per event, not one loop wake-up. Nothing
is made while nobody subscribes.

On the loop, every subscription keeps its own ring of at most `ring_capacity` events. A reader
that falls behind loses the oldest events of its ring and is told so by a typed `Dropped` marker
(how many) before the events that follow: a slow reader costs bounded memory and never holds up
the engine or other readers. The hand-off queue is bounded too (HANDOFF_CAPACITY events); when
the loop itself falls that far behind, every subscription gets the marker.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ferrum_server.domain import CompletionWork
from ferrum_server.errors import CapacityExhausted
from ferrum_server.kv.epochs import Epochs, SourceKey

# Events a subscription holds before its reader must catch up (the oldest are dropped past it).
RING_CAPACITY = 1024
# Events between the engine thread and the loop (only reached if the loop stalls).
HANDOFF_CAPACITY = 4096
# Most concurrent subscriptions (each holds at most RING_CAPACITY events).
MAX_SUBSCRIBERS = 64


@dataclass(frozen=True, slots=True)
class StepCompleted:
    num_items: int
    ran_items: int
    deferred_items: int
    failed_items: int
    prefill_tokens: int
    decode_tokens: int
    elapsed_ns: int


@dataclass(frozen=True, slots=True)
class CachePreempted:
    request_id: str
    cache_id: str
    pending_admission: bool
    mode: int  # capacity.PreemptionMode value
    blocks_freed: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class CacheReleased:
    request_id: str
    cache_id: str
    reason: str  # a KvManager release reason: released, expired, cancelled, abandoned, ...
    blocks_freed: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class CacheCompleted:
    request_id: str
    cache_id: str
    input_tokens: int
    output_tokens: int
    blocks_freed: int
    num_tokens: int
    work: CompletionWork


Payload = StepCompleted | CachePreempted | CacheReleased | CacheCompleted


@dataclass(frozen=True, slots=True)
class Event:
    sequence: int
    unix_ns: int
    epochs: Epochs
    sources: list[tuple[SourceKey, int]]
    payload: Payload


@dataclass(frozen=True, slots=True)
class Dropped:
    """A reader missed `count` events just before the next one it gets."""

    count: int


class Subscription:
    """One reader's bounded ring (event loop only)."""

    def __init__(
        self, capacity: int, next_sequence: int, on_drop: Callable[[int], None] | None = None
    ) -> None:
        self.capacity = capacity
        self._on_drop = on_drop
        self.next_sequence = next_sequence  # sequence of the first event it can get
        self._ring: deque[Event] = deque()
        self._dropped = 0
        self._ready = asyncio.Event()

    def push(self, events: list[Event], lost: int) -> None:
        dropped = lost
        for event in events:
            if event.sequence < self.next_sequence:
                continue  # published before this subscription began
            if len(self._ring) >= self.capacity:
                self._ring.popleft()
                dropped += 1
            self._ring.append(event)
        if dropped:
            self._dropped += dropped
            if self._on_drop is not None:
                self._on_drop(dropped)
        if self._ring or self._dropped:
            self._ready.set()

    async def take(self) -> list[Event | Dropped]:
        """Everything buffered, oldest first, after a Dropped marker if events were lost."""
        await self._ready.wait()
        self._ready.clear()
        taken: list[Event | Dropped] = [Dropped(self._dropped)] if self._dropped else []
        self._dropped = 0
        taken.extend(self._ring)
        self._ring.clear()
        return taken


class ExecutionEvents:
    """The hub: `publish` on the engine thread, `subscribe` / `unsubscribe` on the loop."""

    def __init__(
        self,
        snapshot: Callable[[], tuple[Epochs, list[tuple[SourceKey, int]]]],
        ring_capacity: int = RING_CAPACITY,
        handoff_capacity: int = HANDOFF_CAPACITY,
        max_subscribers: int = MAX_SUBSCRIBERS,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self._snapshot = snapshot  # engine thread: the epochs and generations right now
        self._on_drop = on_drop  # loop: events a reader lost
        self.ring_capacity = ring_capacity
        self._handoff_capacity = handoff_capacity
        self._max_subscribers = max_subscribers
        self._lock = threading.Lock()
        self._handoff: deque[Event] = deque()
        self._lost = 0  # events dropped from the hand-off queue since the last flush
        self._scheduled = False
        self._sequence = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribers: set[Subscription] = set()

    @property
    def active(self) -> bool:
        """Someone listens (read on the engine thread: no event is made otherwise)."""
        return bool(self._subscribers)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    # -- engine thread --------------------------------------------------------------------

    def publish(self, payload: Payload) -> None:
        if not self._subscribers or self._loop is None:
            return
        epochs, sources = self._snapshot()
        with self._lock:
            self._sequence += 1
            if len(self._handoff) >= self._handoff_capacity:
                self._handoff.popleft()
                self._lost += 1
            self._handoff.append(Event(self._sequence, time.time_ns(), epochs, sources, payload))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop closed (shutdown): nobody is left to read
            with self._lock:
                self._scheduled = False

    # -- event loop -----------------------------------------------------------------------

    def _flush(self) -> None:
        with self._lock:
            events = list(self._handoff)
            self._handoff.clear()
            lost, self._lost = self._lost, 0
            self._scheduled = False
        for subscription in self._subscribers:
            subscription.push(events, lost)

    def subscribe(self) -> Subscription:
        if len(self._subscribers) >= self._max_subscribers:
            raise CapacityExhausted(
                f"{self._max_subscribers} execution-event subscriptions are open; close one first"
            )
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        with self._lock:
            # Events already handed off but not flushed are older than this subscription.
            next_sequence = self._sequence + 1
        subscription = Subscription(self.ring_capacity, next_sequence, self._on_drop)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

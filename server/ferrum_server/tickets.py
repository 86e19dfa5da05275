"""Tickets: the interest of callers in one unit of engine work.

A ticket counts the callers still waiting for its work (one, or more when a retry with the same
step id joins). The engine thread asks the ticket before it starts the work: when every caller
has gone (cancelled, disconnected) or every caller's deadline has passed, the work is dropped and
nothing changes. Work that already started cannot be interrupted (a forward is not cancellable);
if its callers are all gone when it finishes, its `on_orphan` hook runs once, on the engine
thread, to release what nobody can learn about any more (the caches the work opened).

The state is shared by the event loop and the engine thread, hence the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from ferrum_server.errors import Dropped

T = TypeVar("T")


class Ticket(Generic[T]):
    def __init__(self, deadline: float | None = None, caller: str = "") -> None:
        self._lock = threading.Lock()
        # Whose work this is (security.caller_identity): the engine gives callers fair turns.
        self.caller = caller
        self._holders = 1
        # Latest monotonic deadline among the holders; None = at least one has none.
        self._deadline = deadline
        self.started = False
        self.finished = False
        self._cleaned = False
        self.value: T | None = None
        self.on_orphan: Callable[[T], Any] | None = None

    @classmethod
    def finished_work(cls) -> Ticket[Any]:
        """A ticket for work that finished and whose outcome is stored (the step ledger): later
        callers join it for the stored response; it keeps no value and never runs a hook."""
        ticket: Ticket[Any] = cls()
        ticket.started = ticket.finished = ticket._cleaned = True
        return ticket

    def join(self, deadline: float | None) -> bool:
        """Another caller waits for this work; False when it was already abandoned unstarted."""
        with self._lock:
            if self._holders <= 0 and not self.started:
                return False
            self._holders += 1
            if deadline is None or self._deadline is None:
                self._deadline = None
            else:
                self._deadline = max(deadline, self._deadline)
            return True

    def leave(self) -> bool:
        """A caller stopped waiting. True when the caller must run the orphan hook (the work
        finished, nobody else waits, and the engine thread did not run the hook already)."""
        with self._lock:
            self._holders -= 1
            if self._holders > 0 or not self.finished or self._cleaned:
                return False
            self._cleaned = True
            return self.on_orphan is not None

    def execute(self, fn: Callable[..., T], args: Sequence[object]) -> T:
        """Engine thread: run fn(*args) unless every caller is gone; clean up after orphans."""
        with self._lock:
            expired = self._deadline is not None and time.monotonic() >= self._deadline
            if self._holders <= 0 or expired:
                raise Dropped("the call was cancelled or its deadline passed before it ran")
            self.started = True
        value = fn(*args)
        with self._lock:
            self.value = value
            self.finished = True
            orphaned = self._holders <= 0 and not self._cleaned
            self._cleaned |= orphaned
        if orphaned and self.on_orphan is not None:
            self.on_orphan(value)
        return value

    def run_orphan_hook(self) -> None:
        """Engine thread: the hook, for a caller that left after the work finished."""
        if self.on_orphan is not None and self.value is not None:
            self.on_orphan(self.value)

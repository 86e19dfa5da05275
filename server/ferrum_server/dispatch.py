"""How the servicer runs a mutating call: step-id deduplication, dropping work whose caller has
gone, and cleaning up after work whose caller left while it ran.

Each call's work runs in its own task, detached from the RPC handler: a caller that goes away
only stops waiting (its ticket interest ends); it never cancels work the engine already started,
so a finished step's result can still be stored for a retry and its orphaned caches released.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from google.protobuf.message import Message

from ferrum_server import security
from ferrum_server.engine import Engine
from ferrum_server.errors import InvalidArgument
from ferrum_server.step_ledger import Entry, StepLedger, fingerprint
from ferrum_server.tickets import Ticket
from ferrum_server.validate import check_instance

R = TypeVar("R")
Body = Callable[[Ticket[Any]], Awaitable[R]]


def deadline_of(context: Any) -> float | None:
    """The call's deadline on the monotonic clock (None when the caller set none)."""
    remaining: float | None = context.time_remaining()
    if remaining is None:
        return None
    return time.monotonic() + remaining


def caller_of(context: Any) -> str:
    """The calling identity (security.caller_identity) of a call."""
    try:
        return security.caller_identity(context.invocation_metadata())
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def _consume(task: asyncio.Task[Any]) -> None:
    # Orphaned work may fail with nobody awaiting it; fetching the exception keeps asyncio from
    # logging "exception was never retrieved" (the failure was already logged or is expected).
    if not task.cancelled():
        task.exception()


class Dispatcher:
    def __init__(self, engine: Engine, ledger_size: int) -> None:
        self.engine = engine
        self.ledger = StepLedger(ledger_size)
        self._background: set[asyncio.Task[Any]] = set()

    def start(
        self,
        method: str,
        request: Message,
        deadline: float | None,
        body: Body[R],
        caller: str = security.ANONYMOUS,
    ) -> tuple[Ticket[Any], asyncio.Task[R]]:
        """Begin (or join, for a repeated step id) the work of one call."""
        step_id = int(getattr(request, "step_id", 0))
        key = b""
        if step_id:
            # Fence before the ledger: a caller from before a restart must see
            # FAILED_PRECONDITION, not a replay or ALREADY_EXISTS.
            check_instance(int(getattr(request, "executor_instance_id", 0)), self.engine.limits)
            key = fingerprint(method, request)
            entry = self.ledger.find(step_id, key)
            if entry is not None and entry.ticket.join(deadline):
                return entry.ticket, entry.task
        ticket: Ticket[Any] = Ticket(deadline, caller)
        task = asyncio.ensure_future(body(ticket))
        task.add_done_callback(_consume)
        if step_id:
            self.ledger.add(step_id, Entry(key, task, ticket))
        return ticket, task

    async def wait(self, ticket: Ticket[Any], task: asyncio.Task[R]) -> R:
        """Await the work; a caller cancelled here leaves the ticket instead of the work."""
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.leave(ticket)
            raise

    async def mutate(self, method: str, request: Message, context: Any, body: Body[R]) -> R:
        caller = caller_of(context)
        ticket, task = self.start(method, request, deadline_of(context), body, caller)
        return await self.wait(ticket, task)

    def leave(self, ticket: Ticket[Any]) -> None:
        if ticket.leave():
            self.spawn(self.engine.call(ticket.run_orphan_hook))

    def spawn(self, work: Awaitable[Any]) -> None:
        """Run work in the background, keeping a reference until it is done."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_consume)

    async def settle(self) -> None:
        """Wait for background cleanups (tests and drain)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

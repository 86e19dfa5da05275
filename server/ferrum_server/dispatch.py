"""How the servicer runs a mutating call: step-id deduplication (per caller), dropping work
whose caller has gone, and cleaning up after work whose caller left while it ran.

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
from ferrum_server.security import MAX_SESSION_BYTES, SESSION_HEADER, caller_identity
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


def step_scope(metadata: Any) -> str:
    """Whose step ids a call's are: its caller (`security.caller_identity`), refined by the
    `ferrum-session` header under a token too, so schedulers sharing a token can keep their
    ids apart. Callers with neither a token nor a session share one scope. An overlong session
    header is INVALID_ARGUMENT."""
    try:
        scope = caller_identity(metadata)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    if scope.startswith("token:"):
        for key, value in metadata or ():
            if key != SESSION_HEADER or not value:
                continue
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            if len(text.encode()) > MAX_SESSION_BYTES:
                raise InvalidArgument(
                    f"the {SESSION_HEADER} header is longer than {MAX_SESSION_BYTES} bytes"
                )
            scope += " session:" + text
    return scope


def _consume(task: asyncio.Task[Any]) -> None:
    # Orphaned work may fail with nobody awaiting it; fetching the exception keeps asyncio from
    # logging "exception was never retrieved" (the failure was already logged or is expected).
    if not task.cancelled():
        task.exception()


class Dispatcher:
    def __init__(self, engine: Engine, ledger: StepLedger) -> None:
        self.engine = engine
        self.ledger = ledger
        self._background: set[asyncio.Task[Any]] = set()

    def start(
        self,
        method: str,
        request: Message,
        deadline: float | None,
        body: Body[R],
        scope: str = security.ANONYMOUS,
    ) -> tuple[Ticket[Any], asyncio.Task[R]]:
        """Begin (or join, for a step id the same caller (`scope`) repeats) the work of one
        call."""
        step_id = int(getattr(request, "step_id", 0))
        key = b""
        if step_id:
            # Fence before the ledger: a caller from before a restart must see
            # FAILED_PRECONDITION, not a replay or ALREADY_EXISTS.
            check_instance(int(getattr(request, "executor_instance_id", 0)), self.engine.limits)
            key = fingerprint(method, request)
            entry = self.ledger.find(scope, step_id, key)
            if entry is not None and entry.ticket.join(deadline):
                return entry.ticket, entry.task
        # The scope is also whose turn the work takes on the engine (fair turns between callers).
        ticket: Ticket[Any] = Ticket(deadline, scope)
        task = asyncio.ensure_future(body(ticket))
        task.add_done_callback(_consume)
        if step_id:
            self.ledger.add(scope, step_id, Entry(key, task, ticket))
        return ticket, task

    async def wait(self, ticket: Ticket[Any], task: asyncio.Task[R]) -> R:
        """Await the work; a caller cancelled here leaves the ticket instead of the work."""
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.leave(ticket)
            raise

    async def mutate(self, method: str, request: Message, context: Any, body: Body[R]) -> R:
        scope = step_scope(context.invocation_metadata())
        ticket, task = self.start(method, request, deadline_of(context), body, scope)
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

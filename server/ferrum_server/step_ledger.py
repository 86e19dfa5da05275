"""The step ledger: exactly-once execution of mutating calls that carry a step id.

A caller may set `step_id` (any non-zero uint64 of its choice) on a mutating request. Step ids
belong to a scope, the caller (see `dispatch.step_scope`): the same id from another caller is
another step, and never sees this one's result. The ledger remembers, per (scope, step id), a
fingerprint of the request (method name and deterministic bytes) and the task producing its
response. A repeat with the same fingerprint joins the running task or gets the stored
response; the same id with a different request is ALREADY_EXISTS. Ids live only as long as this
executor instance, so a caller must also send `executor_instance_id` to be fenced against
restarts.

Bounds, each evicting the oldest first:
- `max_entries` ids are held (running or answered);
- `max_bytes` of stored responses, counted as their serialized size (`ByteSize()`); a response
  larger than `max_bytes` on its own is not kept at all;
- an id evicted by either bound is remembered by a digest of its key and its fingerprint only
  (two 16-byte digests, about 190 bytes with the dict's overhead), for the last `max_evicted`
  evicted ids. A repeat answers StepResultEvicted (FAILED_PRECONDITION), never a re-execution;
  a different request under it is ALREADY_EXISTS. An id older than even that memory is unknown:
  a repeat runs as a new step.

Failures where nothing ran (bad input, fencing, not serving, dropped) are forgotten, so a
corrected or later retry can run; INTERNAL failures (work may have been submitted) are kept and
replayed as they are, never executed again.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from ferrum_server.errors import AlreadyExists, ExecutorError, StepResultEvicted
from ferrum_server.tickets import Ticket

# (scope, step id): whose id, and the id.
Key = tuple[str, int]


def fingerprint(method: str, request: Message) -> bytes:
    digest = hashlib.blake2b(method.encode(), digest_size=16)
    digest.update(b"\0")
    digest.update(request.SerializeToString(deterministic=True))
    return digest.digest()


def _digest(key: Key) -> bytes:
    scope, step_id = key
    digest = hashlib.blake2b(scope.encode(), digest_size=16)
    digest.update(b"\0")
    digest.update(step_id.to_bytes(8, "little"))
    return digest.digest()


@dataclass(frozen=True, slots=True)
class Entry:
    fingerprint: bytes
    task: asyncio.Task[Any]
    ticket: Ticket[Any]


def _kept(task: asyncio.Task[Any]) -> bool:
    """Whether a finished task's outcome is stored: a response, or a failure after work may
    have been submitted. Refusals where nothing ran are not (a retry may run)."""
    if task.cancelled():
        return False
    exc = task.exception()
    return not isinstance(exc, ExecutorError) or exc.code == grpc.StatusCode.INTERNAL


def _held_bytes(task: asyncio.Task[Any]) -> int:
    exc = task.exception()
    if exc is not None:
        return len(str(exc).encode())
    result = task.result()
    return result.ByteSize() if isinstance(result, Message) else 0


class StepLedger:
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        max_evicted: int,
        on_bytes: Callable[[int], object] | None = None,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_evicted = max_evicted
        self._entries: OrderedDict[Key, Entry] = OrderedDict()
        # Bytes held by each answered entry (running ones hold nothing yet).
        self._sizes: dict[Key, int] = {}
        # digest(key) -> fingerprint of the evicted ids, oldest first.
        self._evicted: OrderedDict[bytes, bytes] = OrderedDict()
        self._on_bytes = on_bytes
        self.num_bytes = 0
        self.num_replays = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_evicted_remembered(self) -> int:
        return len(self._evicted)

    def find(self, scope: str, step_id: int, key: bytes) -> Entry | None:
        """The entry for the caller's step id, or None for an unknown id. AlreadyExists when the
        id was used for another request; StepResultEvicted when its result is no longer held."""
        key_of_id = (scope, step_id)
        entry = self._entries.get(key_of_id)
        held = entry.fingerprint if entry is not None else self._evicted.get(_digest(key_of_id))
        if held is None:
            return None
        if held != key:
            raise AlreadyExists(f"step id {step_id} was already used for a different request")
        if entry is None:
            raise StepResultEvicted(
                f"step id {step_id}: its result is no longer held (evicted from the step "
                "ledger); it is not run again: re-read the state before going on"
            )
        self.num_replays += 1
        return entry

    def add(self, scope: str, step_id: int, entry: Entry) -> None:
        key = (scope, step_id)
        if key in self._entries:  # an entry abandoned before it started, replaced by a retry
            self._drop(key)
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            self._evict(next(iter(self._entries)))
        entry.task.add_done_callback(lambda task: self._settle(key, entry))
        self._report()

    def _settle(self, key: Key, entry: Entry) -> None:
        if self._entries.get(key) is not entry:
            # Evicted (or replaced) while it ran. If nothing ran after all, a retry may run.
            digest = _digest(key)
            if not _kept(entry.task) and self._evicted.get(digest) == entry.fingerprint:
                del self._evicted[digest]
            return
        if not _kept(entry.task):
            self._drop(key)
            self._report()
            return
        size = _held_bytes(entry.task)
        # The work's ticket (and the domain result it keeps for its orphan hook) stays with the
        # callers that waited for it; retries join a bare finished ticket, so the ledger holds
        # only the response.
        self._entries[key] = Entry(entry.fingerprint, entry.task, Ticket.finished_work())
        self._sizes[key] = size
        self.num_bytes += size
        if size > self.max_bytes:
            self._evict(key)
        else:
            self._shrink()
        self._report()

    def _shrink(self) -> None:
        """Evict the oldest answered entries until the stored responses fit max_bytes."""
        excess = self.num_bytes - self.max_bytes
        victims = []
        for key in self._entries:
            if excess <= 0:
                break
            size = self._sizes.get(key)
            if size is not None:
                victims.append(key)
                excess -= size
        for key in victims:
            self._evict(key)

    def _drop(self, key: Key) -> Entry:
        self.num_bytes -= self._sizes.pop(key, 0)
        return self._entries.pop(key)

    def _evict(self, key: Key) -> None:
        entry = self._drop(key)
        self.num_evictions += 1
        digest = _digest(key)
        self._evicted[digest] = entry.fingerprint
        self._evicted.move_to_end(digest)
        while len(self._evicted) > self.max_evicted:
            self._evicted.popitem(last=False)

    def _report(self) -> None:
        if self._on_bytes is not None:
            self._on_bytes(self.num_bytes)

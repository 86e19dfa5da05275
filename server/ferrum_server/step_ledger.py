"""The step ledger: exactly-once execution of mutating calls that carry a step id.

A caller may set `step_id` (any non-zero uint64 of its choice) on a mutating request. The ledger
remembers, per step id, a fingerprint of the request (method name and deterministic bytes) and
the task producing its response. A repeat with the same fingerprint joins the running task or
gets the stored response; the same id with a different request is ALREADY_EXISTS. The last
`capacity` step ids are kept (oldest evicted first); ids live only as long as this executor
instance, so a caller must also send `executor_instance_id` to be fenced against restarts.

Failures where nothing ran (bad input, fencing, not serving, dropped) are forgotten, so a
corrected or later retry can run; INTERNAL failures (work may have been submitted) are kept and
replayed as they are, never executed again.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from ferrum_server.errors import AlreadyExists, ExecutorError
from ferrum_server.tickets import Ticket


def fingerprint(method: str, request: Message) -> bytes:
    digest = hashlib.blake2b(method.encode(), digest_size=16)
    digest.update(b"\0")
    digest.update(request.SerializeToString(deterministic=True))
    return digest.digest()


@dataclass(frozen=True, slots=True)
class Entry:
    fingerprint: bytes
    task: asyncio.Task[Any]
    ticket: Ticket[Any]


class StepLedger:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self.num_replays = 0

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, step_id: int, key: bytes) -> Entry | None:
        """The entry for step_id; AlreadyExists when it was used for another request."""
        entry = self._entries.get(step_id)
        if entry is None:
            return None
        if entry.fingerprint != key:
            raise AlreadyExists(f"step id {step_id} was already used for a different request")
        self.num_replays += 1
        return entry

    def add(self, step_id: int, entry: Entry) -> None:
        self._entries[step_id] = entry
        self._entries.move_to_end(step_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        entry.task.add_done_callback(lambda task: self._settle(step_id, entry))

    def _settle(self, step_id: int, entry: Entry) -> None:
        if self._entries.get(step_id) is not entry:
            return
        if entry.task.cancelled():
            del self._entries[step_id]
            return
        exc = entry.task.exception()
        if isinstance(exc, ExecutorError) and exc.code != grpc.StatusCode.INTERNAL:
            del self._entries[step_id]  # nothing ran: a retry may run it

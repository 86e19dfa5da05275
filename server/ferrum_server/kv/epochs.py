"""Capacity epochs and per-source generations.

Every release bumps the global release epoch and the generation of the exact source it freed.
Waiters name (source, generation) pairs and are woken only when one of them advances.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Source(enum.IntEnum):
    """Capacity sources (values match the proto enum CapacitySource)."""

    DOMAIN = 1
    ACTIVE_SEQUENCE_SLOTS = 2


KV_DOMAIN = 0
SourceKey = tuple[Source, int]
KV_BLOCKS: SourceKey = (Source.DOMAIN, KV_DOMAIN)
SEQUENCE_SLOTS: SourceKey = (Source.ACTIVE_SEQUENCE_SLOTS, 0)


@dataclass(frozen=True, slots=True)
class Epochs:
    coordinator_id: int
    release_epoch: int
    capacity_epoch: int


class EpochClock:
    def __init__(self, coordinator_id: int) -> None:
        self.coordinator_id = coordinator_id
        self.release_epoch = 0
        self.capacity_epoch = 1
        # Generations start at 1: the proto requires observed epochs to be non-zero.
        self.generations: dict[SourceKey, int] = {KV_BLOCKS: 1, SEQUENCE_SLOTS: 1}
        # Called (on the engine thread) after every bump; the server uses it to wake waiters.
        self.listeners: list[Callable[[], None]] = []

    def bump(self, sources: set[SourceKey]) -> None:
        if not sources:
            return
        self.release_epoch += 1
        for source in sources:
            self.generations[source] += 1
        for listener in self.listeners:
            listener()

    def snapshot(self) -> Epochs:
        return Epochs(self.coordinator_id, self.release_epoch, self.capacity_epoch)

    def observed(self, sources: set[SourceKey]) -> list[tuple[SourceKey, int]]:
        return sorted((source, self.generations[source]) for source in sources)

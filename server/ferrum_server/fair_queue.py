"""Fair turns on the engine thread: round-robin by caller over queued execution work.

The engine runs one job at a time on its one thread. Work submitted with a ticket
(`Engine.run`) carries its caller's identity (`security.caller_identity`); instead of strict
submission order the engine thread takes the oldest job of the next caller in turn. A caller
with a backlog (several streams' windows, hundreds of unary calls) then delays another caller's
single step by at most one job per caller with work queued, never by its whole backlog. One
caller's jobs keep their order, so a stream's steps still run in the order they were sent.

Each submission puts one job here and one `run_next` on the engine thread's own queue, so every
job runs exactly once; which job a given `run_next` runs is decided only when the thread gets
to it. The queue is shared by the event loop (put) and the engine thread (take), hence the lock.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Job:
    future: Future[Any]
    work: Callable[[], Any]

    def run(self) -> None:
        """Run the work unless its waiter cancelled first; deliver the outcome."""
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.work()
        except BaseException as exc:  # delivered to the waiter, as ThreadPoolExecutor does
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


class FairQueue:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Callers with queued jobs, in turn order: the next turn is the first caller's.
        self._queues: collections.OrderedDict[str, collections.deque[Job]] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        with self._lock:
            return sum(len(jobs) for jobs in self._queues.values())

    def put(self, caller: str, job: Job) -> None:
        with self._lock:
            jobs = self._queues.get(caller)
            if jobs is None:
                # A caller without queued work joins at the back of the turn order.
                self._queues[caller] = jobs = collections.deque()
            jobs.append(job)

    def take(self) -> Job | None:
        """The oldest job of the caller whose turn it is; that caller goes to the back."""
        with self._lock:
            if not self._queues:
                return None
            caller, jobs = next(iter(self._queues.items()))
            job = jobs.popleft()
            if jobs:
                self._queues.move_to_end(caller)
            else:
                del self._queues[caller]
            return job

    def run_next(self) -> None:
        """Engine thread: run the job whose turn it is."""
        job = self.take()
        if job is not None:
            job.run()

    def abandon(self, error: BaseException) -> int:
        """Fail every queued job with `error` (shutdown); return how many there were."""
        with self._lock:
            jobs = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
        return len(jobs)

"""Fair turns on the engine thread (fair_queue.py): round-robin by caller, each caller's jobs
in order, every job run exactly once, queued jobs failed on shutdown."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from ferrum_server.errors import Unavailable
from ferrum_server.fair_queue import FairQueue, Job


def _job(ran: list[str], name: str) -> Job:
    return Job(Future(), lambda: ran.append(name) or name)


def test_callers_take_turns_and_keep_their_own_order() -> None:
    queue, ran = FairQueue(), []
    for name in ("a1", "a2", "a3"):
        queue.put("a", _job(ran, name))
    queue.put("b", _job(ran, "b1"))
    queue.put("c", _job(ran, "c1"))
    assert len(queue) == 5
    for _ in range(5):
        queue.run_next()
    assert ran == ["a1", "b1", "c1", "a2", "a3"]
    assert len(queue) == 0
    queue.run_next()  # nothing queued: nothing runs
    assert len(ran) == 5


def test_a_cancelled_job_is_skipped_and_errors_reach_the_waiter() -> None:
    queue, ran = FairQueue(), []
    skipped = _job(ran, "skipped")
    skipped.future.cancel()
    queue.put("a", skipped)

    def fail() -> None:
        raise ValueError("boom")

    failing = Job(Future(), fail)
    queue.put("a", failing)
    queue.run_next()
    queue.run_next()
    assert ran == []
    with pytest.raises(ValueError, match="boom"):
        failing.future.result()


def test_abandon_fails_every_queued_job() -> None:
    queue, ran = FairQueue(), []
    jobs = [_job(ran, "x"), _job(ran, "y")]
    queue.put("a", jobs[0])
    queue.put("b", jobs[1])
    assert queue.abandon(Unavailable("stopped")) == 2
    for job in jobs:
        with pytest.raises(Unavailable):
            job.future.result()
    assert ran == [] and len(queue) == 0

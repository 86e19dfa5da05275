"""The serving process's garbage-collector policy: what start-up made is never walked again.

A loaded server tracks about 320,000 Python objects made at start-up: modules, the model's
modules and parameter wrappers, protobuf descriptors, gRPC's and asyncio's objects. CPython's
full collection walks every tracked object: 128 ms on the development machine (2 vCPUs of a
Zen 5), run by whichever thread's allocation crosses the threshold, the engine thread's
included. Now and then a step took that much longer than the others: a 118-150 ms gap in the
decode steps of 7 of 25 W1 runs with decode continuation, the server's full collections one
more than start-up's where it showed.

``freeze_startup_objects`` collects once, then moves every object still alive into the
permanent generation (``gc.freeze``), which no later collection walks: a full collection then
covers only what the server made since. Those objects live as long as the process anyway;
the price is that one of them that later became cyclic garbage would not be collected, and
that is bounded by what start-up made.

Only a process that is a server calls it, once it has warmed up (``cli._serve`` on rank 0,
``parallel.follower.follow`` on the other ranks). ``app.start_server`` does not: a test or an
application that runs a server inside its own process owns that process's heap.
"""

from __future__ import annotations

import gc

from ferrum_server import logs

_LOG = logs.get(__name__)


def freeze_startup_objects() -> int:
    """Collect, then freeze every tracked object; returns how many are frozen (all of them,
    including any frozen before)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    _LOG.info("gc_frozen", objects=frozen)
    return frozen

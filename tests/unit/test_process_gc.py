"""The serving process's collector policy (``process_gc``): start-up's garbage is collected,
then everything alive is frozen, so no later collection walks it."""

from __future__ import annotations

import gc
import weakref

from ferrum_server.process_gc import freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freezing_collects_first_then_leaves_the_survivors_out_of_every_collection() -> None:
    garbage_a, garbage_b = _Node(), _Node()
    garbage_a.other, garbage_b.other = garbage_b, garbage_a  # a cycle: only gc frees it
    dead = weakref.ref(garbage_a)
    del garbage_a, garbage_b
    alive = _Node()
    alive.other = alive
    assert dead() is not None
    try:
        frozen = freeze_startup_objects()
        assert dead() is None  # collected before the freeze, not frozen forever
        # What it froze (objects other tests left may be freed meanwhile: no later equality).
        assert frozen > 0
        tracked = gc.get_objects()
        assert not any(obj is alive for obj in tracked)  # frozen: no generation holds it
        made_after = _Node()
        assert any(obj is made_after for obj in gc.get_objects())
    finally:
        gc.unfreeze()  # the test process's heap is not a server's
    assert any(obj is alive for obj in gc.get_objects())

"""The test-only fault plan: when a rewritten plan counts as new, and when it does not."""

from __future__ import annotations

import io
import json
import os
import pathlib
from typing import Any

import pytest
from ferrum_server import faults
from ferrum_server.errors import Unavailable


def _write(path: pathlib.Path, rules: list[dict[str, Any]], stamp_ns: int) -> None:
    path.write_text(json.dumps({"rules": rules}))
    os.utime(path, ns=(stamp_ns, stamp_ns))


def test_a_rule_limited_to_once_fires_once_and_again_after_a_new_plan(
    tmp_path: pathlib.Path,
) -> None:
    plan = tmp_path / "plan.json"
    injector = faults.FaultInjector(str(plan))
    injector.before_forward(["r0"])  # no plan yet: nothing
    _write(plan, [{"kind": "unavailable", "times": 1}], 1_000_000_000)
    with pytest.raises(Unavailable):
        injector.before_forward(["r0"])
    injector.before_forward(["r0"])  # spent
    _write(plan, [{"kind": "unavailable", "times": 1}], 2_000_000_000)  # a new mtime: a new plan
    with pytest.raises(Unavailable):
        injector.before_forward(["r1"])
    injector.before_forward(["r1"])
    plan.unlink()
    injector.before_forward(["r1"])
    assert injector.rules == []


def test_a_plan_read_while_it_is_rewritten_is_not_taken_for_a_new_one_after(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race behind a flaky fleet test: the engine thread stats the plan just after the test
    truncated it and reads it just after the test wrote it. The rule must fire once, not again
    at the next forward when the stat then shows the written file."""
    plan = tmp_path / "plan.json"
    _write(plan, [{"kind": "unavailable", "times": 1}], 3_000_000_000)
    real_stat = os.stat
    truncated = os.stat_result((0o100644, 0, 0, 1, 0, 0, 0, 0, 2, 2))  # size 0, mtime 2 s
    calls = 0

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        nonlocal calls
        calls += 1
        if calls == 1:  # the stat taken between the truncation and the write
            return truncated
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(faults.os, "stat", stat)
    injector = faults.FaultInjector(str(plan))
    with pytest.raises(Unavailable):
        injector.before_forward(["r0"])
    injector.before_forward(["r0"])  # the same plan: the rule stays spent
    injector.before_forward(["r0"])


def test_a_broken_or_unreadable_plan_injects_nothing(tmp_path: pathlib.Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("{not json")
    injector = faults.FaultInjector(str(plan))
    injector.before_forward(["r0"])
    assert injector.rules == []
    plan.unlink()
    plan.mkdir()  # exists, but cannot be read as a file
    injector.before_forward(["r0"])
    assert injector.rules == []


def test_a_plan_written_while_it_is_read_is_read_again(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of the same race: the stat and the read both catch the truncated file,
    and the write lands before the stat that follows the read. Keeping that later stamp with
    the empty text read would lose the plan for good; the plan is read again instead."""
    plan = tmp_path / "plan.json"
    _write(plan, [{"kind": "unavailable", "times": 1}], 4_000_000_000)
    real_stat, real_open = os.stat, open
    truncated = os.stat_result((0o100644, 0, 0, 1, 0, 0, 0, 0, 2, 2))
    stats = opens = 0

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        nonlocal stats
        stats += 1
        return truncated if stats == 1 else real_stat(path, *args, **kwargs)

    def opened(path: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal opens
        opens += 1
        return io.StringIO("") if opens == 1 else real_open(path, *args, **kwargs)

    monkeypatch.setattr(faults.os, "stat", stat)
    monkeypatch.setattr(faults, "open", opened, raising=False)
    injector = faults.FaultInjector(str(plan))
    with pytest.raises(Unavailable):
        injector.before_forward(["r0"])
    assert opens == 2
    injector.before_forward(["r0"])  # spent, and not read again
    assert opens == 2

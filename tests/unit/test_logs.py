"""JSON log lines reach stdout whole: one write per line, newline included."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from ferrum_server import logs


class _Writes:
    """A stdout that records each write() call separately, as an unbuffered stream
    (PYTHONUNBUFFERED, as in the container) hands each one to the pipe."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@pytest.fixture
def stdout() -> Iterator[_Writes]:
    yield _Writes()
    logs.configure("warning", "console")  # what conftest set for the rest of the run


def test_each_json_line_is_one_write(stdout: _Writes) -> None:
    """Rank 0 and its followers share one stdout: a line written in two calls (the text, then
    its newline) let the other process's line land between them (seen in
    test_tensor_parallel_process)."""
    logs.configure("info", "json", stdout)  # type: ignore[arg-type]
    logs.get("test").info("first_event", rank=0)
    logging.getLogger("library").warning("from stdlib")
    logs.get("test").info("second_event", rank=1)
    assert len(stdout.calls) == 3
    assert all(call.endswith("\n") and call.count("\n") == 1 for call in stdout.calls)
    events = [json.loads(call)["event"] for call in stdout.calls]
    assert events == ["first_event", "from stdlib", "second_event"]

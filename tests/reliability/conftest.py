"""Reliability suite fixtures: a summary line per scenario at the end of the run."""

from __future__ import annotations

from typing import Any

from reliability.harness import SUMMARY


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not SUMMARY:
        return
    terminalreporter.section("reliability summary")
    for line in SUMMARY:
        terminalreporter.write_line(line)

"""Structured logs: JSON lines to stdout (console rendering on a terminal).

Events carry request and cache ids, never tokens, prompts or credentials.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog


def configure(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """fmt: "json", "console", or "auto" (console when the stream is a terminal); stream:
    where lines go (stdout by default)."""
    out = sys.stdout if stream is None else stream
    use_console = fmt == "console" or (fmt == "auto" and out.isatty())
    renderer: Any = (
        structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    )
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write per line, newline included: rank 0 and its spawned followers share one stdout
        # (a container's log pipe, unbuffered there: PYTHONUNBUFFERED), and print()'s separate
        # write of the newline let another process's line land between a line and its end.
        # No stream given: each logger takes sys.stdout as it is when made (loggers are not
        # cached), so a replaced stdout (pytest's capture) still receives the lines.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # Libraries that use stdlib logging go through the same renderer; their `extra=` fields
    # become keys of the line (ferrum_kernels.native logs its reason so).
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


def get(name: str) -> Any:
    return structlog.get_logger(name)

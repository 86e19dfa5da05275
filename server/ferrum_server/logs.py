"""Structured logs: JSON lines to stdout (console rendering on a terminal).

Events carry request and cache ids, never tokens, prompts or credentials.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure(level: str = "info", fmt: str = "auto") -> None:
    """fmt: "json", "console", or "auto" (console when stdout is a terminal)."""
    use_console = fmt == "console" or (fmt == "auto" and sys.stdout.isatty())
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=False,
    )
    # Libraries that use stdlib logging go through the same renderer; their `extra=` fields
    # become keys of the line (ferrum_kernels.native logs its reason so).
    handler = logging.StreamHandler(sys.stdout)
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

"""Shared fixtures: live executors (see helpers_server.py) and test-wide logging."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers_server import LiveServer, start_live_server


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    """A tiny-model executor with a modest pool (block size 4 so tests cross blocks)."""
    yield from start_live_server(
        block_size=4, kv_cache_bytes=4 * 1024**2, max_batch_tokens=512, max_batch_size=32
    )


@pytest.fixture(scope="session")
def small_pool_server() -> Iterator[LiveServer]:
    """A server whose pool holds only 16 blocks of 4 tokens (64 tokens in all)."""
    import torch
    from ferrum_server.models import tiny_config

    block_bytes = tiny_config().kv_bytes_per_token(torch.float32) * 4
    yield from start_live_server(
        block_size=4, kv_cache_bytes=16 * block_bytes, max_batch_tokens=64, max_batch_size=8
    )


@pytest.fixture
def client(live_server: LiveServer) -> Iterator[object]:
    """A blocking client; after the test every cache must be released and the pool whole."""
    from ferrum_client import ExecutorClient

    with ExecutorClient(live_server.target) as c:
        yield c
    engine = live_server.engine
    engine.kv.check()  # type: ignore[attr-defined]
    leaked = list(engine.kv.caches)  # type: ignore[attr-defined]
    assert not leaked, f"test left caches open: {leaked}"
    assert engine.kv.pool.num_available == engine.kv.pool.num_blocks  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    """Keep test output readable: per-request events are debug/info level."""
    from ferrum_server import logs

    logs.configure("warning", "console")

"""Shared fixtures: an in-process executor on 127.0.0.1:0, driven from a background loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass
class LiveServer:
    target: str
    engine: object  # ferrum_server.engine.Engine
    loop: asyncio.AbstractEventLoop
    metrics_url: str = ""

    def run(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)  # type: ignore[arg-type]


def _start(**engine_kwargs: object) -> Iterator[LiveServer]:
    from ferrum_server.app import start_server
    from ferrum_server.config import EngineConfig, ServerConfig

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = EngineConfig(**engine_kwargs)  # type: ignore[arg-type]
    running = asyncio.run_coroutine_threadsafe(
        start_server(
            config, ServerConfig(host="127.0.0.1", port=0, metrics_port=0, metrics_host="127.0.0.1")
        ),
        loop,
    ).result(timeout=120)
    try:
        yield LiveServer(
            f"127.0.0.1:{running.port}",
            running.engine,
            loop,
            f"http://127.0.0.1:{running.metrics_port}/metrics",
        )
    finally:
        asyncio.run_coroutine_threadsafe(running.drain(1.0), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    """A tiny-model executor with a modest pool (block size 4 so tests cross blocks)."""
    yield from _start(
        block_size=4, kv_cache_bytes=4 * 1024**2, max_batch_tokens=512, max_batch_size=32
    )


@pytest.fixture(scope="session")
def small_pool_server() -> Iterator[LiveServer]:
    """A server whose pool holds only 16 blocks of 4 tokens (64 tokens in all)."""
    import torch
    from ferrum_server.models import tiny_config

    block_bytes = tiny_config().kv_bytes_per_token(torch.float32) * 4
    yield from _start(
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
    leaked = list(engine.kv.sequences)  # type: ignore[attr-defined]
    assert not leaked, f"test left caches open: {leaked}"
    assert engine.kv.pool.num_available == engine.kv.pool.num_blocks  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    """Keep test output readable: per-request events are debug/info level."""
    from ferrum_server import logs

    logs.configure("warning", "console")

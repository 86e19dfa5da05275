"""A live in-process executor on 127.0.0.1:0 for tests, driven from a background loop.

Kept out of conftest.py so test modules can import it by a unique name (tests/reliability has
a conftest.py of its own).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class LiveServer:
    target: str
    engine: object  # ferrum_server.engine.Engine
    loop: asyncio.AbstractEventLoop
    metrics_url: str = ""

    def run(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)  # type: ignore[arg-type]


def start_live_server(**engine_kwargs: object) -> Iterator[LiveServer]:
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


TINY_VOCAB = 512


def random_prompts(seed: int, count: int, low: int, high: int) -> list[list[int]]:
    """`count` prompts of tiny-model token ids with lengths uniform in [low, high], seeded."""
    rng = random.Random(seed)
    return [
        [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)
    ]


def tiny_block_bytes(block_size: int) -> int:
    """Bytes of one float32 KV block of the tiny model (to size pools in blocks)."""
    import torch
    from ferrum_server.models import tiny_config

    return tiny_config().kv_bytes_per_token(torch.float32) * block_size


_TINY_FOLDERS: dict[str, str] = {}


def tiny_folder() -> str:
    """The built-in tiny model saved as a Hugging Face folder (once per test process): the same
    weights, loadable by a split model (the built-in one runs on one rank)."""
    if "tiny" not in _TINY_FOLDERS:
        import atexit
        import shutil
        import tempfile

        import torch
        from ferrum_server.models import build_tiny, save_hf_folder, tiny_config

        folder = tempfile.mkdtemp(prefix="ferrum-tiny-")
        atexit.register(shutil.rmtree, folder, True)
        save_hf_folder(build_tiny(torch.float32, "cpu"), tiny_config(), folder)
        _TINY_FOLDERS["tiny"] = folder
    return _TINY_FOLDERS["tiny"]


def tiny_split(tp: int, blocks: int, block_size: int) -> dict[str, object]:
    """start_live_server arguments for the tiny model split over `tp` ranks (1: the built-in
    one) with a pool of `blocks` blocks on every rank (--kv-cache-bytes is per rank)."""
    if tp == 1:
        return {"kv_cache_bytes": blocks * tiny_block_bytes(block_size)}
    return {
        "model": tiny_folder(),
        "tensor_parallel_size": tp,
        # The tiny model's 2 KV heads: one per rank at tp 2, so a block is half the bytes.
        "kv_cache_bytes": blocks * tiny_block_bytes(block_size) // min(tp, 2),
    }

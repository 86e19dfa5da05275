"""A live in-process executor on 127.0.0.1:0 for tests, driven from a background loop.

Kept out of conftest.py so test modules can import it by a unique name (tests/reliability has
a conftest.py of its own).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


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


def assert_quiescent(server: LiveServer) -> None:
    """The server is back where it started: no step in flight, no cache, every KV block free
    (and the KV manager's own invariants hold)."""
    engine = server.engine
    assert not engine._launched  # type: ignore[attr-defined]  # every step finished
    kv = engine.kv  # type: ignore[attr-defined]
    kv.check()
    assert not kv.caches
    assert kv.pool.num_available == kv.pool.num_blocks


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


def logged_metrics_port(log: pathlib.Path, timeout_s: float = 30.0) -> int:
    """The metrics port a `serve` subprocess reported on starting to serve (its JSON log at
    level info, `--metrics-port 0`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "lifecycle" and event.get("state") == "serving":
                return int(event["metrics_port"])
        time.sleep(0.05)
    raise AssertionError(f"no 'serving' line with a metrics port in {log}")


def rpcs_started(metrics_port: int, method: str) -> int:
    """Calls of ExecutorService `method` whose handler a server began, from its /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "grpc_server_started_total"
            and sample.labels.get("grpc_method") == method
        )
    )


async def wait_for_rpcs_started(
    metrics_port: int, method: str, count: int, limit_s: float = 30.0
) -> None:
    """Wait until a server has begun `count` calls of `method` (then they are on the server,
    whatever a loaded machine did to the client), failing loudly after limit_s."""
    deadline = time.monotonic() + limit_s
    while (seen := await asyncio.to_thread(rpcs_started, metrics_port, method)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{seen} of {count} {method} calls reached the server")
        await asyncio.sleep(0.02)

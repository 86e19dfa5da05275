"""Asyncio load/fault harness: in-process or subprocess executors on loopback, a small batching
driver, per-request accounting (exactly one outcome per request id), and leak checks.

Every scenario builds a `Tally`, feeds it one outcome per request, and calls `report`, which
records a summary line (printed at the end of the run by conftest) and asserts nothing was lost
or duplicated.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from ferrum_client import AsyncExecutorClient, BatchBuilder, ExecutorError, item_views, pb

VOCAB = 512  # the tiny model
SUMMARY: list[str] = []


# -- accounting -------------------------------------------------------------------------------


@dataclass
class Tally:
    """Outcomes per request id; a request must end exactly once."""

    name: str
    sent: set[str] = field(default_factory=set)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    blocks_leaked: int = 0
    # Peak RSS growth of the server process over a flood scenario (None when not measured).
    rss_growth_bytes: int | None = None
    started: float = field(default_factory=time.monotonic)
    notes: str = ""

    def send(self, request_id: str) -> None:
        assert request_id not in self.sent, f"request id {request_id} sent twice"
        self.sent.add(request_id)

    def resolve(self, request_id: str, code: str = "OK") -> None:
        self.outcomes[request_id] += 1
        self.codes[code] += 1

    @property
    def completed(self) -> int:
        return self.codes["OK"]

    @property
    def lost(self) -> int:
        return sum(1 for r in self.sent if self.outcomes[r] == 0)

    @property
    def duplicated(self) -> int:
        return sum(n - 1 for n in self.outcomes.values() if n > 1)

    def line(self) -> str:
        failed = {c: n for c, n in sorted(self.codes.items()) if c != "OK"}
        elapsed = time.monotonic() - self.started
        text = (
            f"{self.name}: sent={len(self.sent)} completed={self.completed} failed={failed} "
            f"lost={self.lost} duplicated={self.duplicated} blocks_leaked={self.blocks_leaked} "
            f"({elapsed:.1f}s)"
        )
        if self.rss_growth_bytes is not None:
            text += f" rss_growth={self.rss_growth_bytes / 2**20:.1f}MiB"
        return f"{text} {self.notes}".rstrip()


def report(tally: Tally) -> None:
    """Record the summary line and check the universal post-conditions."""
    SUMMARY.append(tally.line())
    print(tally.line())
    assert tally.lost == 0, tally.line()
    assert tally.duplicated == 0, tally.line()
    assert tally.blocks_leaked == 0, tally.line()


def run_scenario(coro: Any, timeout_s: float = 120.0) -> Any:
    """Run a client-side scenario on its own loop, bounded in time (it stops by itself)."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def code_name(exc: BaseException) -> str:
    if isinstance(exc, ExecutorError):
        return exc.code.name
    if isinstance(exc, grpc.RpcError):
        return exc.code().name  # type: ignore[no-any-return]
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    return type(exc).__name__


async def wait_until(condition: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Poll until `condition()` holds (a state the server reaches), failing loudly after
    limit_s: a fixed sleep instead is a guess that a slow or loaded machine can outlast."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {limit_s:g} s: {what}")
        await asyncio.sleep(0.01)


# -- servers ----------------------------------------------------------------------------------


@dataclass
class InProcessServer:
    running: Any  # ferrum_server.app.RunningServer
    loop: asyncio.AbstractEventLoop

    @property
    def engine(self) -> Any:
        return self.running.engine

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.running.port}"

    def run(self, coro: Any, timeout_s: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    def settle(self) -> None:
        """Wait until background cleanups and every queued engine job are done."""
        self.run(self.running.servicer.dispatch.settle())
        self.run(self.engine.call(lambda: None))

    def hold_engine(self, seconds: float) -> asyncio.Future[Any]:
        """Occupy the engine thread for `seconds`, so that the next calls queue behind it."""
        return asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self.engine.call(time.sleep, seconds), self.loop)
        )

    def hold_engine_until(
        self, release: threading.Event, limit_s: float = 30.0
    ) -> asyncio.Future[Any]:
        """Occupy the engine thread until `release` is set (or `limit_s` passes), so that a
        test decides when the queued calls start instead of racing a timer."""
        return asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self.engine.call(release.wait, limit_s), self.loop)
        )

    def rpcs_started(self, method: str) -> int:
        """Calls of ExecutorService `method` (e.g. "Prefill") whose handler the server began."""
        return int(self._rpc_samples("grpc_server_started_total", method, None))

    def rpcs_handled(self, method: str, code: str | None = None) -> int:
        """Calls of `method` whose handler has unwound on the server (with `code`, or any):
        counted after the call limits and the dispatcher let go of the call, so a test that
        must know the server has seen a cancellation waits for this, not for the client."""
        return int(self._rpc_samples("grpc_server_handled_total", method, code))

    def rpcs_in_progress(self, method: str) -> int:
        """Calls of `method` begun on the server and not yet ended (counted by the limits)."""
        return self.rpcs_started(method) - self.rpcs_handled(method)

    def _rpc_samples(self, sample: str, method: str, code: str | None) -> float:
        total = 0.0
        for family in self.running.metrics.registry.collect():
            for s in family.samples:
                labels = s.labels
                if s.name != sample or labels.get("grpc_method") != method:
                    continue
                if labels.get("grpc_service") != "ferrum.executor.v1.ExecutorService":
                    continue
                if code is None or labels.get("grpc_code") == code:
                    total += s.value
        return total

    def live_requests(self) -> set[str]:
        """Request ids of the caches alive once background work has settled."""
        self.settle()
        return {s.request_id for s in self.engine.kv.caches.values()}

    def blocks_leaked(self, limit_s: float = 3.0) -> int:
        """Blocks held by live caches (0 after a clean scenario); checks KV invariants too.

        The count is taken again (each time after settling) until it is 0 or `limit_s` has
        passed: what a scenario's end returns to the pool arrives asynchronously, the ends of
        its step streams (a cancellation the server sees a moment later, a half-close it waits
        HALF_CLOSE_GRACE_S on) and release calls still in flight. A cache still held after
        that is a leak. A full CI run once counted one executor's four caches (16) here while
        every run of the test alone, loaded or not, counted 0."""
        deadline = time.monotonic() + limit_s
        while True:
            self.settle()
            kv = self.engine.kv
            self.run(self.engine.call(kv.check))
            leaked = int(kv.pool.num_blocks - kv.pool.num_available) + len(kv.caches)
            if leaked == 0 or time.monotonic() > deadline:
                return leaked
            time.sleep(0.05)


@contextlib.contextmanager
def serve_in_process(
    engine: dict[str, Any] | None = None, server: dict[str, Any] | None = None
) -> Iterator[InProcessServer]:
    from ferrum_server.app import start_server
    from ferrum_server.config import EngineConfig, ServerConfig

    engine_kwargs = {
        "block_size": 4,
        "kv_cache_bytes": 2 * 1024**2,
        "max_batch_tokens": 256,
        "max_batch_size": 32,
        **(engine or {}),
    }
    server_kwargs = {"host": "127.0.0.1", "port": 0, "metrics_port": -1, **(server or {})}
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    running = asyncio.run_coroutine_threadsafe(
        start_server(EngineConfig(**engine_kwargs), ServerConfig(**server_kwargs)), loop
    ).result(timeout=120)
    try:
        yield InProcessServer(running, loop)
    finally:
        if not running.servicer.draining:  # a test may have drained it already (and waited)
            asyncio.run_coroutine_threadsafe(running.drain(1.0), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def rss_bytes(pid: int | None = None) -> int:
    with open(f"/proc/{pid or os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# -- a small batching driver ------------------------------------------------------------------


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


@dataclass
class Generation:
    request_id: str
    prompt: list[int]
    max_new: int
    cache_id: str = ""
    position: int = 0
    tokens: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def prefilling(self) -> bool:
        return self.position < len(self.prompt)


async def drive(
    client: AsyncExecutorClient,
    generations: list[Generation],
    tally: Tally,
    *,
    chunk: int = 16,
    max_steps: int = 400,
    instance_id: int = 0,
) -> None:
    """Run the generations to completion in shared unified batches (greedy), completing each
    cache at the end; every generation ends in exactly one tally outcome."""
    active = list(generations)
    for gen in active:
        tally.send(gen.request_id)
    try:
        for _ in range(max_steps):
            active = [g for g in active if not g.done]
            if not active:
                return
            builder = BatchBuilder()
            for gen in active:
                if gen.prefilling:
                    piece = gen.prompt[gen.position : gen.position + chunk]
                    builder.add_prefill_chunk(
                        gen.request_id, gen.cache_id, piece, gen.position, len(gen.prompt)
                    )
                else:
                    builder.add_decode(gen.request_id, gen.cache_id, gen.tokens[-1], gen.position)
            response = await client.unified_batch(
                pb.UnifiedBatchRequest(items=builder.build(), executor_instance_id=instance_id)
            )
            for gen, view in zip(active, item_views(response.results), strict=True):
                await _advance(client, gen, view, tally, instance_id)
        for gen in active:
            if not gen.done:
                gen.done = True
                tally.resolve(gen.request_id, "STEP_LIMIT")
    except BaseException as exc:
        for gen in active:
            if not gen.done:
                gen.done = True
                tally.resolve(gen.request_id, code_name(exc))
        if not isinstance(exc, ExecutorError | grpc.RpcError):
            raise


async def _advance(
    client: AsyncExecutorClient, gen: Generation, view: Any, tally: Tally, instance_id: int
) -> None:
    if view.deferred:
        return
    if view.failed:
        gen.done = True
        tally.resolve(gen.request_id, grpc.StatusCode.RESOURCE_EXHAUSTED.name)
        if gen.cache_id:
            await client.release_cache(
                pb.ReleaseCacheRequest(cache_id=gen.cache_id, executor_instance_id=instance_id)
            )
        return
    gen.cache_id = view.cache_id
    gen.position = view.committed_tokens
    if view.has_token:
        gen.tokens.append(view.token_id)
    if len(gen.tokens) >= gen.max_new:
        gen.done = True
        await client.complete_cache(
            pb.CompleteCacheRequest(
                request_id=gen.request_id,
                cache_id=gen.cache_id,
                input_tokens=len(gen.prompt),
                output_tokens=len(gen.tokens),
                executor_instance_id=instance_id,
            )
        )
        tally.resolve(gen.request_id)


async def solo_outputs(target: str, prompts: dict[str, list[int]], max_new: int) -> dict[str, Any]:
    """Greedy outputs of each prompt run alone (the reference for batched runs)."""
    outputs: dict[str, Any] = {}
    tally = Tally("solo-reference")
    async with AsyncExecutorClient(target) as client:
        for name, tokens in prompts.items():
            gen = Generation(f"solo-{name}", tokens, max_new)
            await drive(client, [gen], tally)
            outputs[name] = gen.tokens
    assert tally.completed == len(prompts), tally.line()
    return outputs

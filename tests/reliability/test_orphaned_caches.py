"""Clients that die holding caches, and an admitted request that never computes its prefix
(issue #17): the cache lease gives the slots back, the prefix-pending bound frees the waiter.

The dying clients are real subprocesses, SIGKILLed once they hold their caches, so nothing on the
client side releases anything: only the executor's lease can.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import ferrum_client
import pytest
from ferrum_client import AsyncExecutorClient, pb
from ferrum_client.scheduler import GenerationParams, Scheduler
from reliability.harness import (
    InProcessServer,
    Tally,
    prompt,
    report,
    run_scenario,
    serve_in_process,
)

# Long enough that the dead client's caches are surely still live when the test first looks
# (after the client closes its channel, says ready and is killed): at 1 s a loaded machine could
# take that long, and the caches would have expired before the check that they are held.
LEASE_S = 2.0
# The sweep runs every quarter lease; the rest is margin for a loaded machine.
EXPIRED_WITHIN_S = LEASE_S * 1.25 + 1.0
PENDING_S = 0.5
SLOTS = 4

# A client that opens caches, says "ready", and waits to be killed. `unary`: three caches opened
# by Prefill and one admitted by TryAdmitPrefill but never prefilled; `stream`: four caches opened
# on a StepStream that it then half-closes (a normal end: the executor keeps the caches).
_DYING_CLIENT = textwrap.dedent(
    """
    import asyncio, sys, time
    from ferrum_client import AsyncExecutorClient, BatchBuilder, pb

    async def main(target, mode, prefix):
        async with AsyncExecutorClient(target) as client:
            if mode == "unary":
                for k in range(3):
                    await client.prefill(pb.PrefillRequest(
                        request_id=f"{prefix}-{k}", input_tokens=[k + 1, 2, 3, 4, 5]))
                decision = await client.try_admit_prefill(pb.TryAdmitPrefillRequest(
                    request_id=f"{prefix}-3", input_tokens=[9, 9, 9], product_prompt_tokens=3))
                assert decision.WhichOneof("decision") == "admitted", decision
            else:
                async with client.step_stream() as stream:
                    for k in range(4):
                        batch = BatchBuilder()
                        batch.add_prefill_chunk(f"{prefix}-{k}", "", [k + 1, 2, 3], 0, 3)
                        await stream.run(pb.UnifiedBatchRequest(items=batch.build()))
        print("ready", flush=True)
        time.sleep(600)

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.fixture(scope="module")
def leased() -> Iterator[InProcessServer]:
    with serve_in_process(engine={"max_batch_size": SLOTS, "cache_lease_s": LEASE_S}) as live:
        yield live


@pytest.fixture(scope="module")
def bounded_prefix() -> Iterator[InProcessServer]:
    with serve_in_process(
        engine={"max_batch_size": SLOTS, "cache_lease_s": 0, "prefix_pending_s": PENDING_S}
    ) as live:
        yield live


def _kill_when_holding(target: str, mode: str, prefix: str) -> None:
    """Run the dying client until it holds its caches, then SIGKILL it."""
    client_root = str(pathlib.Path(ferrum_client.__file__).resolve().parents[1])
    path = os.pathsep.join([client_root, os.environ.get("PYTHONPATH", "")])
    process = subprocess.Popen(
        [sys.executable, "-c", _DYING_CLIENT, target, mode, prefix],
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=path),
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.strip() == b"ready", f"the client failed before holding its caches: {line!r}"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)


@pytest.mark.parametrize("mode", ["unary", "stream"])
def test_a_dying_client_s_caches_expire_and_a_new_request_is_admitted(
    leased: InProcessServer, mode: str
) -> None:
    """unary: a client dies holding every slot (one of them admitted, never prefilled);
    stream: a stream client half-closes, then dies."""
    tally = Tally(f"dying-{mode}-client")
    dead = [f"dead-{mode}-{k}" for k in range(SLOTS)]
    for request_id in dead:
        tally.send(request_id)
    _kill_when_holding(leased.target, mode, f"dead-{mode}")
    killed = time.monotonic()
    assert leased.live_requests() == set(dead)  # every slot is held by a dead client

    async def scenario() -> float:
        alive = f"alive-{mode}"
        tally.send(alive)
        tokens = prompt(7, 9)
        async with AsyncExecutorClient(leased.target) as client:
            request = pb.TryAdmitPrefillRequest(
                request_id=alive, input_tokens=tokens, product_prompt_tokens=len(tokens)
            )
            decision = await client.try_admit_prefill(request)
            while decision.WhichOneof("decision") == "deferred":
                await client.wait_for_capacity_change(
                    pb.WaitForCapacityChangeRequest(
                        condition=decision.deferred.wait_condition, timeout_ms=10_000
                    )
                )
                decision = await client.try_admit_prefill(request)
            admitted_after = time.monotonic() - killed
            cache_id = decision.admitted.cache_id
            cached = decision.admitted.cached_prompt_tokens
            chunk = pb.PrefillChunk(
                tokens_processed=cached,
                tokens_to_process=len(tokens) - cached,
                total_prompt_tokens=len(tokens),
            )
            await client.prefill(
                pb.PrefillRequest(
                    request_id=alive, cache_id=cache_id, input_tokens=tokens, chunk=chunk
                )
            )
            await client.complete_cache(
                pb.CompleteCacheRequest(
                    request_id=alive,
                    cache_id=cache_id,
                    input_tokens=len(tokens),
                    output_tokens=1,
                )
            )
            tally.resolve(alive)
        return admitted_after

    admitted_after = run_scenario(scenario(), timeout_s=30)
    # The lease ran from the dead client's last call, before the kill; the sweep runs every
    # quarter lease. The first slot came back within that, and by then every slot has.
    assert admitted_after < EXPIRED_WITHIN_S, admitted_after
    time.sleep(max(0.0, killed + EXPIRED_WITHIN_S - time.monotonic()))
    live = leased.live_requests()
    for request_id in dead:
        tally.resolve(request_id, "EXPIRED" if request_id not in live else "STILL_LIVE")
    tally.blocks_leaked = leased.blocks_leaked()
    tally.notes = f"admitted {admitted_after:.2f}s after the kill (lease {LEASE_S:g}s)"
    assert tally.codes["EXPIRED"] == SLOTS, tally.line()
    report(tally)


def test_an_idle_prefix_owner_holds_the_reference_scheduler_only_briefly(
    bounded_prefix: InProcessServer,
) -> None:
    """An admitted request that never prefills owns a shared prefix; the reference scheduler's
    request with that prefix is admitted within the bound (it waited forever before)."""
    tally = Tally("idle-prefix-owner")
    shared = prompt(11, 64)  # sixteen full blocks of 4

    async def scenario() -> float:
        async with AsyncExecutorClient(bounded_prefix.target) as client:
            tally.send("owner")
            owner = await client.try_admit_prefill(
                pb.TryAdmitPrefillRequest(
                    request_id="owner", input_tokens=[*shared, 1], product_prompt_tokens=65
                )
            )
            assert owner.WhichOneof("decision") == "admitted"
            started = time.monotonic()
            scheduler = Scheduler(client)
            (result,) = await scheduler.generate([[*shared, 2]], GenerationParams(max_new_tokens=4))
            elapsed = time.monotonic() - started
            tally.send(result.request_id)
            tally.resolve(result.request_id, "OK" if result.finish_reason == "length" else "FAILED")
            assert scheduler.stats.admissions_deferred >= 1  # it did meet the pending prefix
            await client.release_cache(pb.ReleaseCacheRequest(cache_id=owner.admitted.cache_id))
            tally.resolve("owner")
        return elapsed

    elapsed = run_scenario(scenario(), timeout_s=30)
    assert elapsed < PENDING_S + 1.5, elapsed
    tally.blocks_leaked = bounded_prefix.blocks_leaked()
    tally.notes = f"waiter done in {elapsed:.2f}s (bound {PENDING_S:g}s)"
    report(tally)

"""Cache leases, prefix-mark expiry and warmup with every slot taken, through gRPC (issue #17).

`leased` has a 0.6 s lease and two sequence slots; `unleased` has no lease, a 0.4 s prefix
pending bound and two slots, so that what wakes a waiter there is the bound, not a lease.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Iterator, Sequence

import pytest
from ferrum_client import (
    AsyncExecutorClient,
    ExecutorClient,
    InvalidArgumentError,
    NotFoundError,
    pb,
)
from ferrum_client.scheduler import (
    GenerationParams,
    GrpcBackend,
    PlannedItem,
    Scheduler,
    SchedulerConfig,
    StepResult,
)
from helpers_server import LiveServer, start_live_server, tiny_block_bytes

LEASE_S = 0.6
PENDING_S = 0.4


@pytest.fixture(scope="module")
def leased() -> Iterator[LiveServer]:
    yield from start_live_server(
        block_size=4,
        kv_cache_bytes=64 * tiny_block_bytes(4),
        max_batch_tokens=256,
        max_batch_size=2,
        cache_lease_s=LEASE_S,
    )


@pytest.fixture(scope="module")
def unleased() -> Iterator[LiveServer]:
    yield from start_live_server(
        block_size=4,
        kv_cache_bytes=64 * tiny_block_bytes(4),
        max_batch_tokens=256,
        max_batch_size=2,
        cache_lease_s=0,
        prefix_pending_s=PENDING_S,
    )


def _prefill(client: ExecutorClient, request_id: str, tokens: list[int]) -> str:
    response = client.prefill(pb.PrefillRequest(request_id=request_id, input_tokens=tokens))
    return str(response.completed.kv_cache.cache_id)


def _admit(
    client: ExecutorClient, request_id: str, tokens: list[int]
) -> pb.TryAdmitPrefillResponse:
    return client.try_admit_prefill(
        pb.TryAdmitPrefillRequest(
            request_id=request_id, input_tokens=tokens, product_prompt_tokens=len(tokens)
        )
    )


def _expired_total(server: LiveServer) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    found = re.search(r"^ferrum_executor_caches_expired_total (\S+)$", text, re.MULTILINE)
    assert found, "ferrum_executor_caches_expired_total is not exported"
    return float(found.group(1))


def _quiescent(server: LiveServer) -> None:
    kv = server.engine.kv  # type: ignore[attr-defined]
    server.run(server.engine.call(kv.check))  # type: ignore[attr-defined]
    assert not kv.caches
    assert kv.pool.num_available == kv.pool.num_blocks


def test_caches_nobody_names_expire_and_their_slots_come_back(leased: LiveServer) -> None:
    expired_before = _expired_total(leased)
    with ExecutorClient(leased.target) as client:
        assert client.get_capabilities().capabilities.cache_lease_ms == 600
        orphans = [_prefill(client, f"orphan-{k}", [1, 2, 3, 4, 5]) for k in range(2)]
        late = _admit(client, "late", [9, 8, 7])
        assert late.WhichOneof("decision") == "deferred"  # both slots are held
        started = time.monotonic()
        woken = client.wait_for_capacity_change(
            pb.WaitForCapacityChangeRequest(
                condition=late.deferred.wait_condition, timeout_ms=10_000
            )
        )
        waited = time.monotonic() - started
        assert woken.changed and waited < LEASE_S + 1.0, waited
        admitted = _admit(client, "late", [9, 8, 7])
        assert admitted.WhichOneof("decision") == "admitted"
        client.release_cache(pb.ReleaseCacheRequest(cache_id=admitted.admitted.cache_id))
        time.sleep(LEASE_S)  # the other orphan was opened a little later
        with pytest.raises(NotFoundError, match="expired"):
            client.decode(
                pb.DecodeRequest(
                    request_id="orphan-0", cache_id=orphans[0], input_token=1, position=5
                )
            )
        complete = client.complete_cache(
            pb.CompleteCacheRequest(request_id="orphan-1", cache_id=orphans[1])
        )
        assert not complete.released  # already released by the lease: a harmless repeat
    assert _expired_total(leased) == expired_before + 2
    _quiescent(leased)


def test_renewal_and_maintenance_keep_idle_caches(leased: LiveServer) -> None:
    with ExecutorClient(leased.target) as client:
        renewed = _prefill(client, "renewed", [1, 2, 3])
        maintained = _prefill(client, "maintained", [4, 5, 6])
        deadline = time.monotonic() + 3 * LEASE_S
        while time.monotonic() < deadline:
            answer = client.renew_cache_lease(
                pb.RenewCacheLeaseRequest(cache_ids=[renewed, "never-opened"])
            )
            assert answer.renewed == 1 and list(answer.not_live_cache_ids) == ["never-opened"]
            assert answer.cache_lease_ms == 600
            client.maintain_prefill_backing(
                pb.MaintainPrefillBackingRequest(request_id="maintained")
            )
            time.sleep(LEASE_S / 4)
        assert set(leased.engine.kv.caches) == {renewed, maintained}  # type: ignore[attr-defined]
        for cache_id in (renewed, maintained):
            client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
    _quiescent(leased)


def test_bad_renewals_are_refused_and_change_nothing(leased: LiveServer) -> None:
    with ExecutorClient(leased.target) as client:
        for ids in ([""], ["x" * 257], [f"c{k}" for k in range(3)]):
            with pytest.raises(InvalidArgumentError):
                client.renew_cache_lease(pb.RenewCacheLeaseRequest(cache_ids=ids))
        # Repeats count once: two distinct ids fit the limit of two.
        answer = client.renew_cache_lease(pb.RenewCacheLeaseRequest(cache_ids=["a", "a", "b"]))
        assert list(answer.not_live_cache_ids) == ["a", "b"]


class _SlowSteps(GrpcBackend):
    """Every step takes at least 0.1 s (a slow device), so waiting requests sit idle."""

    def submit(self, items: Sequence[PlannedItem]) -> asyncio.Future[StepResult]:
        result = super().submit(items)

        async def slow() -> StepResult:
            await asyncio.sleep(0.1)
            return await result

        return asyncio.ensure_future(slow())


def test_the_reference_scheduler_renews_the_caches_it_holds_idle(leased: LiveServer) -> None:
    """The second prompt is admitted at once but prefilled only after the first one's 10
    chunks (over 1 s, longer than the lease): the scheduler must keep its cache alive."""
    expired_before = _expired_total(leased)
    # One step in flight: with decode continuation's two, the second prompt's chunks would
    # alternate with the first's instead of waiting.
    config = SchedulerConfig(
        max_step_tokens=16,
        target_step_ms=0,
        align_first_tokens=False,
        decode_continuation=False,
    )

    async def scenario() -> tuple[list[list[int]], int]:
        async with AsyncExecutorClient(leased.target) as client:
            scheduler = Scheduler(_SlowSteps(client), config)
            prompts = [list(range(1, 161)), list(range(300, 316))]
            results = await scheduler.generate(prompts, GenerationParams(max_new_tokens=2))
        assert [r.finish_reason for r in results] == ["length", "length"], results
        return [r.output_ids for r in results], scheduler.stats.lease_renewals

    outputs, renewals = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert renewals > 0 and all(len(o) == 2 for o in outputs)
    assert _expired_total(leased) == expired_before
    _quiescent(leased)


def test_an_owner_that_never_prefills_holds_waiters_only_briefly(unleased: LiveServer) -> None:
    prefix = list(range(1, 33))  # eight full blocks
    with ExecutorClient(unleased.target) as client:
        owner = _admit(client, "owner", [*prefix, 100])
        assert owner.WhichOneof("decision") == "admitted"
        waiter = _admit(client, "waiter", [*prefix, 200])
        assert waiter.WhichOneof("decision") == "deferred"
        assert waiter.deferred.blockers[0].kind == pb.SHORTFALL_KIND_PREFIX_PENDING
        started = time.monotonic()
        woken = client.wait_for_capacity_change(
            pb.WaitForCapacityChangeRequest(
                condition=waiter.deferred.wait_condition, timeout_ms=10_000
            )
        )
        waited = time.monotonic() - started
        assert woken.changed and waited < PENDING_S + 1.0, waited
        admitted = _admit(client, "waiter", [*prefix, 200])
        assert admitted.WhichOneof("decision") == "admitted"
        for decision in (owner, admitted):
            client.release_cache(pb.ReleaseCacheRequest(cache_id=decision.admitted.cache_id))
    _quiescent(unleased)


def test_warmup_with_every_slot_taken_runs_and_changes_nothing(unleased: LiveServer) -> None:
    with ExecutorClient(unleased.target) as client:
        held = [_prefill(client, f"held-{k}", [1, 2, 3, 4, 5]) for k in range(2)]
        before = client.get_capacity_snapshot()
        warm = client.warmup(pb.WarmupRequest(num_tokens=32))
        assert warm.num_tokens == 32 and warm.forward_ms > 0 and not warm.HasField("deferred")
        after = client.get_capacity_snapshot()
        assert (after.kv, after.sources, after.epochs) == (before.kv, before.sources, before.epochs)
        assert set(unleased.engine.kv.caches) == set(held)  # type: ignore[attr-defined]
        for cache_id in held:
            client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
    _quiescent(unleased)

"""TryAdmitPrefillBatch end to end: probes decided in order as single probes would be, the
batch stopping at the first deferral, bad input changing nothing, step-id replay, and the
reference scheduler admitting a burst in one call."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from ferrum_client import AsyncExecutorClient, ExecutorClient, ExecutorError, pb
from ferrum_client.scheduler import GenerationParams, Scheduler, SchedulerConfig
from ferrum_server.capacity import MIN_ADMISSION_BATCH_TOKENS
from helpers_server import (
    TINY_VOCAB,
    LiveServer,
    assert_quiescent,
    random_prompts,
    start_live_server,
    tiny_block_bytes,
)

BLOCKS, BLOCK_SIZE, MAX_ITEMS = 24, 4, 16


@pytest.fixture(scope="module")
def tight() -> Iterator[LiveServer]:
    """24 blocks of 4 tokens: two of the test's 40-token prompts fill most of it."""
    yield from start_live_server(
        block_size=BLOCK_SIZE,
        kv_cache_bytes=BLOCKS * tiny_block_bytes(BLOCK_SIZE),
        max_batch_tokens=256,
        max_batch_size=MAX_ITEMS,
    )


@pytest.fixture(scope="module")
def roomy() -> Iterator[LiveServer]:
    yield from start_live_server(
        block_size=BLOCK_SIZE,
        kv_cache_bytes=1024 * tiny_block_bytes(BLOCK_SIZE),
        max_batch_tokens=256,
        max_batch_size=64,
    )


def _probe(
    request_id: str, length: int, token: int = 3, **fields: int
) -> pb.TryAdmitPrefillRequest:
    return pb.TryAdmitPrefillRequest(
        request_id=request_id,
        input_tokens=[token] * length,
        product_prompt_tokens=length,
        **fields,  # type: ignore[arg-type]
    )


def _cancel(client: ExecutorClient, *request_ids: str) -> None:
    for request_id in request_ids:
        client.cancel_prefill_admission(pb.CancelPrefillAdmissionRequest(request_id=request_id))


# a: 10 blocks, admitted; huge: can never fit; c: 10 more blocks; d: 8 blocks with 4 left,
# deferred; e: would fit, but comes after the deferral. Each its own token, so no probe finds
# another's (pending) blocks in the prefix cache.
BURST = [("a", 40, 3), ("huge", 100, 4), ("c", 40, 5), ("d", 30, 6), ("e", 4, 7)]


def test_capabilities_advertise_the_batch(tight: LiveServer) -> None:
    with ExecutorClient(tight.target) as client:
        capabilities = client.get_capabilities().capabilities
    assert capabilities.supports_admission_batch
    assert capabilities.max_admission_batch_tokens == MIN_ADMISSION_BATCH_TOKENS


def test_probes_are_decided_in_order_until_one_is_deferred(tight: LiveServer) -> None:
    with ExecutorClient(tight.target) as client:
        # What single probes answer, one after another.
        singles = [client.try_admit_prefill(_probe(*probe)) for probe in BURST[:4]]
        _cancel(client, "a", "c")
        assert_quiescent(tight)
        batch = client.try_admit_prefill_batch(
            pb.TryAdmitPrefillBatchRequest(probes=[_probe(*probe) for probe in BURST])
        ).decisions
        kinds = [d.WhichOneof("decision") for d in batch]
        assert kinds == ["admitted", "rejected", "admitted", "deferred"]
        assert kinds == [d.WhichOneof("decision") for d in singles]
        assert [d.admitted.held_blocks for d in (batch[0], batch[2])] == [10, 10]
        assert batch[1].rejected.reason == singles[1].rejected.reason
        shortfall = batch[3].deferred.blockers[0]
        assert (shortfall.requested, shortfall.available) == (8, 4)
        # "e" was not decided: it holds nothing, and a probe of its own admits it now.
        kv = tight.engine.kv  # type: ignore[attr-defined]
        assert kv.live_cache_of("e") is None and len(kv.caches) == 2
        assert client.try_admit_prefill(_probe(*BURST[4])).WhichOneof("decision") == "admitted"
        _cancel(client, "a", "c", "e")
    assert_quiescent(tight)


def _refused(client: ExecutorClient, request: pb.TryAdmitPrefillBatchRequest) -> ExecutorError:
    with pytest.raises(ExecutorError) as caught:
        client.try_admit_prefill_batch(request)
    return caught.value


def test_bad_input_fails_the_whole_batch_and_changes_nothing(tight: LiveServer) -> None:
    over = MIN_ADMISSION_BATCH_TOKENS // 2 + 1
    with ExecutorClient(tight.target) as client:
        probes_before = tight.engine.capacity.stats.probes  # type: ignore[attr-defined]
        for probes, words in (
            # A later probe is bad: the good one before it is not admitted either.
            ([_probe("a", 8), _probe("bad", 8, token=TINY_VOCAB)], "outside the vocabulary"),
            ([_probe("a", 8), _probe("a", 4)], "probed twice"),
            ([_probe("a", 8), _probe("b", 4, step_id=7)], "step_id"),
            ([_probe(f"r{i}", 1) for i in range(MAX_ITEMS + 1)], "max_batch_size"),
            ([_probe("a", over), _probe("b", over)], f"at most {MIN_ADMISSION_BATCH_TOKENS}"),
            ([_probe("a", 8), _probe("b", 4, executor_instance_id=12345)], "instance"),
        ):
            error = _refused(client, pb.TryAdmitPrefillBatchRequest(probes=probes))
            expected = (
                grpc.StatusCode.FAILED_PRECONDITION
                if words == "instance"
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            assert error.code == expected, error
            assert words in str(error), error
            assert_quiescent(tight)
        stale = pb.TryAdmitPrefillBatchRequest(probes=[_probe("a", 8)], executor_instance_id=12345)
        assert _refused(client, stale).code == grpc.StatusCode.FAILED_PRECONDITION
        # Nothing was decided: no probe was counted.
        assert tight.engine.capacity.stats.probes == probes_before  # type: ignore[attr-defined]
        # An empty batch decides nothing.
        assert not client.try_admit_prefill_batch(pb.TryAdmitPrefillBatchRequest()).decisions
    assert_quiescent(tight)


def test_a_step_id_replays_the_stored_decisions(tight: LiveServer) -> None:
    request = pb.TryAdmitPrefillBatchRequest(
        probes=[_probe("a", 8), _probe("b", 8, token=9)], step_id=41
    )
    with ExecutorClient(tight.target) as client:
        first = client.try_admit_prefill_batch(request)
        again = client.try_admit_prefill_batch(request)
        assert again == first
        assert [d.WhichOneof("decision") for d in first.decisions] == ["admitted", "admitted"]
        assert len(tight.engine.kv.caches) == 2  # type: ignore[attr-defined]
        other = pb.TryAdmitPrefillBatchRequest(probes=[_probe("x", 8)], step_id=41)
        assert _refused(client, other).code == grpc.StatusCode.ALREADY_EXISTS
        _cancel(client, "a", "b")
    assert_quiescent(tight)


def _generate(
    server: LiveServer, prompts: list[list[int]], config: SchedulerConfig
) -> tuple[list[list[int]], Scheduler]:
    async def scenario() -> tuple[list[list[int]], Scheduler]:
        async with AsyncExecutorClient(server.target) as client:
            scheduler = Scheduler(client, config)
            results = await scheduler.generate(prompts, GenerationParams(max_new_tokens=6))
        assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
        return [r.output_ids for r in results], scheduler

    return server.run(scenario())  # type: ignore[return-value]


def test_the_scheduler_admits_a_burst_in_one_call(roomy: LiveServer) -> None:
    prompts = random_prompts(3, 12, 5, 30)
    batched, scheduler = _generate(roomy, prompts, SchedulerConfig(max_step_tokens=64))
    assert scheduler.stats.admission_batches == 1
    assert scheduler.stats.admission_probes == len(prompts)
    one_by_one, single = _generate(
        roomy, prompts, SchedulerConfig(max_step_tokens=64, batch_admissions=False)
    )
    assert single.stats.admission_batches == 0
    assert single.stats.admission_probes == len(prompts)
    assert batched == one_by_one
    assert_quiescent(roomy)


def test_a_burst_larger_than_the_pool_completes_as_with_single_probes(
    tight: LiveServer, roomy: LiveServer
) -> None:
    # Deferrals end batches midway; the scheduler waits, preempts and re-probes as before.
    prompts = random_prompts(7, 10, 6, 20)
    config = SchedulerConfig(max_step_tokens=32)
    expected, _ = _generate(roomy, prompts, SchedulerConfig(max_step_tokens=32))
    outputs, scheduler = _generate(tight, prompts, config)
    assert outputs == expected
    assert scheduler.stats.admission_batches >= 1 and scheduler.stats.admissions_deferred > 0
    assert_quiescent(tight)
    assert_quiescent(roomy)


def test_the_receive_limit_holds_a_full_batch(tight: LiveServer) -> None:
    from ferrum_server.app import message_limits
    from ferrum_server.config import ServerConfig

    engine = tight.engine
    receive, _ = message_limits(engine, ServerConfig())  # type: ignore[arg-type]
    # The largest batch: max_batch_size probes, the token budget in ids of 5-byte varints,
    # every id 256 bytes long.
    per_probe = MIN_ADMISSION_BATCH_TOKENS // MAX_ITEMS
    probe = pb.TryAdmitPrefillRequest(
        request_id="r" * 256,
        input_tokens=[2**32 - 1] * per_probe,
        maximum_sequence_tokens=2**63,
        product_prompt_tokens=2**63,
        replayed_output_tokens=2**63,
        request_origin=pb.REQUEST_ORIGIN_PRODUCT,
        executor_instance_id=2**63,
        first_chunk_tokens=2**63,
    )
    batch = pb.TryAdmitPrefillBatchRequest(
        probes=[probe] * MAX_ITEMS, executor_instance_id=2**63, step_id=2**63
    )
    assert batch.ByteSize() <= receive

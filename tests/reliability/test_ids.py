"""Long ids: refused with INVALID_ARGUMENT in every RPC before anything changes, never logged
whole; ListReleaseSources keeps answering, in bounded pages."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ferrum_client import (
    AsyncExecutorClient,
    BatchBuilder,
    ExecutorClient,
    InvalidArgumentError,
    pb,
)
from reliability.harness import InProcessServer, Tally, report, run_scenario, serve_in_process

# Under the tiny model's receive limit (about 1.06 MiB with the harness's batch limits), so the
# handler sees it: the transport's own limit is not what refuses it.
HUGE = "x" * 1_000_000
JUST_OVER = "y" * 257


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with serve_in_process() as live:
        yield live


def _calls(client: ExecutorClient, cache: str, long_id: str) -> list[tuple[str, Callable[[], Any]]]:
    """(field, call): one call per RPC that takes an id, with `long_id` in that field."""
    items = BatchBuilder()
    items.add_prefill_chunk(long_id, "", [3, 4], 0, 2)
    decode_items = BatchBuilder()
    decode_items.add_decode("r", long_id, 3, 3)
    prefill = pb.PrefillRequest(request_id=long_id, input_tokens=[3, 4], step_id=71)
    decode = pb.DecodeRequest(cache_id=long_id, input_token=3, position=3, step_id=72)
    unified = pb.UnifiedBatchRequest(items=items.build(), step_id=73)
    batch_decode = pb.BatchDecodeRequest(items=decode_items.build())
    verify = pb.ForwardVerifyRequest(request_id=long_id, cache_id=cache, token_ids=[3], position=3)
    truncate = pb.TruncateKvRequest(cache_id=long_id, new_length=1)
    reserve = pb.ReserveKvSlotsRequest(request_ids=[long_id], target_lens=[8])
    release = pb.ReleaseCacheRequest(cache_id=long_id)
    complete = pb.CompleteCacheRequest(request_id=long_id, cache_id=cache)
    admit = pb.TryAdmitPrefillRequest(
        request_id=long_id, input_tokens=[3, 4], product_prompt_tokens=2, step_id=74
    )
    cancel = pb.CancelPrefillAdmissionRequest(request_id=long_id)
    maintain = pb.MaintainPrefillBackingRequest(request_id=long_id)
    preempt = pb.PreemptExecutionCapacityRequest(cache_id=long_id)
    listing = pb.ListReleaseSourcesRequest(page_token=long_id)
    return [
        ("request_id", lambda: client.prefill(prefill)),
        ("cache_id", lambda: client.decode(decode)),
        ("items.request_ids[0]", lambda: client.unified_batch(unified)),
        ("items.cache_ids[0]", lambda: client.batch_decode(batch_decode)),
        ("request_id", lambda: client.forward_verify(verify)),
        ("cache_id", lambda: client.truncate_kv(truncate)),
        ("request_ids[0]", lambda: client.reserve_kv_slots(reserve)),
        ("cache_id", lambda: client.release_cache(release)),
        ("request_id", lambda: client.complete_cache(complete)),
        ("request_id", lambda: client.try_admit_prefill(admit)),
        ("request_id", lambda: client.cancel_prefill_admission(cancel)),
        ("request_id", lambda: client.maintain_prefill_backing(maintain)),
        ("cache_id", lambda: client.preempt_execution_capacity(preempt)),
        ("page_token", lambda: client.list_release_sources(listing)),
    ]


def _state(server: InProcessServer) -> tuple[int, int, int]:
    server.settle()
    ledger = server.running.servicer.dispatch.ledger
    return int(server.engine.stats.steps), len(server.engine.kv.caches), len(ledger)


def test_long_ids_are_refused_before_anything_changes(
    server: InProcessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    tally = Tally("long-ids")
    with ExecutorClient(server.target) as client:
        kept = client.prefill(pb.PrefillRequest(request_id="keeper", input_tokens=[3, 4, 5]))
        cache = kept.completed.kv_cache.cache_id
        before = _state(server)
        capsys.readouterr()
        for size, long_id in (("1MB", HUGE), ("257B", JUST_OVER)):
            for field, call in _calls(client, cache, long_id):
                name = f"{size}:{field}:{len(tally.sent)}"
                tally.send(name)
                with pytest.raises(InvalidArgumentError) as caught:
                    call()
                message = str(caught.value)
                assert f"{field} is {len(long_id)} bytes" in message, message
                assert "limited to 256 bytes" in message
                tally.resolve(name, caught.value.code.name)
        logged = capsys.readouterr()
        assert _state(server) == before
        # 28 refusals of ids up to 1 MB: the log carries each id clipped, never whole.
        assert len(logged.out) + len(logged.err) < 64 * 1024
        # Ids at the limit are fine, and every caller can still list.
        at_limit = "z" * 256
        opened = client.prefill(pb.PrefillRequest(request_id=at_limit, input_tokens=[3, 4]))
        listed = client.list_release_sources()
        assert {e.request_id for e in listed.entries} == {"keeper", at_limit}
        assert listed.next_page_token == ""
        for ref in (cache, opened.completed.kv_cache.cache_id):
            client.release_cache(pb.ReleaseCacheRequest(cache_id=ref))
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_a_long_id_in_a_stream_step_fails_that_step_only(server: InProcessServer) -> None:
    tally = Tally("long-ids[stream]")

    async def scenario() -> str:
        long_step = BatchBuilder()
        long_step.add_prefill_chunk(HUGE, "", [3, 4], 0, 2)
        good_step = BatchBuilder()
        good_step.add_prefill_chunk("fine", "", [3, 4], 0, 2)
        async with AsyncExecutorClient(server.target) as client, client.step_stream() as stream:
            tally.send("stream:long")
            with pytest.raises(InvalidArgumentError, match=r"request_ids\[0\] is 1000000 bytes"):
                await stream.run(pb.UnifiedBatchRequest(items=long_step.build(), step_id=9))
            tally.resolve("stream:long", "INVALID_ARGUMENT")
            tally.send("stream:fine")
            answer = await stream.run(pb.UnifiedBatchRequest(items=good_step.build()))
            tally.resolve("stream:fine")
            return answer.results.cache_ids[0]

    cache = run_scenario(scenario())
    with ExecutorClient(server.target) as client:
        client.release_cache(pb.ReleaseCacheRequest(cache_id=cache))
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_release_sources_come_in_bounded_pages(server: InProcessServer) -> None:
    tally = Tally("list-pages")
    with ExecutorClient(server.target) as client:
        opened = set()
        for i in range(10):
            tally.send(f"open#{i}")
            answer = client.prefill(
                pb.PrefillRequest(request_id=f"{i:03d}" + "p" * 253, input_tokens=[3, 4])
            )
            opened.add(answer.completed.kv_cache.cache_id)
            tally.resolve(f"open#{i}")
        seen: list[str] = []
        token = ""
        pages = 0
        while True:
            page = client.list_release_sources(
                pb.ListReleaseSourcesRequest(page_size=4, page_token=token)
            )
            assert len(page.entries) <= 4
            seen += [e.cache_id for e in page.entries]
            pages += 1
            token = page.next_page_token
            if not token:
                break
        assert pages == 3 and seen == sorted(opened)
        whole = client.list_release_sources()  # page_size 0: up to 1024
        assert [e.cache_id for e in whole.entries] == seen and not whole.next_page_token
        for cache_id in opened:
            client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)

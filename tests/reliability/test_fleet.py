"""The reference scheduler over a fleet of in-process executors: failover, affinity, drain.

Three executors on 127.0.0.1 (in-process; the SIGKILL scenario is in test_fleet_process.py),
each behind a loopback TCP proxy so a test can cut one's connections mid-step: the scheduler
sees UNAVAILABLE on that executor's step stream, exactly as when the executor dies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import pathlib
import time
from collections.abc import Awaitable, Iterator, Sequence
from typing import Any

import grpc
import pytest
from ferrum_client import AsyncExecutorClient
from ferrum_client.errors import ExecutorError
from ferrum_client.fleet import ExecutorFleet, ExecutorState
from ferrum_client.fleet_backend import FleetBackend
from ferrum_client.scheduler import (
    GenerationParams,
    GenerationResult,
    PlannedItem,
    Scheduler,
    SchedulerConfig,
    StepResult,
)
from ferrum_server import faults
from helpers_server import tiny_block_bytes
from reliability.harness import (
    InProcessServer,
    Tally,
    prompt,
    report,
    run_scenario,
    serve_in_process,
)
from reliability.proxy import TcpProxy

CONFIG = SchedulerConfig(max_step_tokens=64, target_step_ms=0)
ENGINE = {"kv_cache_bytes": 4 * 1024**2, "max_batch_tokens": 512}


@pytest.fixture(scope="module")
def servers() -> Iterator[list[InProcessServer]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(serve_in_process(ENGINE)) for _ in range(3)]


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    return [prompt(seed * 1000 + k, 20 + 7 * (k % 5)) for k in range(count)]


def _tally(name: str, results: Sequence[GenerationResult], count: int) -> Tally:
    tally = Tally(name)
    for k in range(count):
        tally.send(f"p{k}")
    for result in results:
        done = result.finish_reason in ("length", "stop")
        tally.resolve(f"p{result.index}", "OK" if done else result.finish_reason or "NONE")
    return tally


async def _single(target: str, prompts: list[list[int]], params: GenerationParams) -> list[Any]:
    async with AsyncExecutorClient(target) as client:
        results = await Scheduler(client, CONFIG).generate(prompts, params)
    return [r.output_ids for r in results]


def test_a_cut_link_mid_step_fails_over_and_the_executor_rejoins(
    servers: list[InProcessServer],
) -> None:
    prompts = _prompts(12)
    params = GenerationParams(max_new_tokens=24)

    async def scenario() -> tuple[list[Any], list[GenerationResult], dict[str, Any], int]:
        reference = await _single(servers[0].target, prompts, params)
        proxies = [TcpProxy(s.running.port) for s in servers]
        for proxy in proxies:
            await proxy.start()
        cut: list[int] = []
        try:
            async with ExecutorFleet([p.target for p in proxies]) as fleet:
                backend = FleetBackend(fleet)
                scheduler = Scheduler(backend, CONFIG)
                produced = 0

                def on_token(index: int, token: int) -> None:
                    nonlocal produced
                    produced += 1
                    if produced == 60:  # mid-run: every request is running somewhere
                        cut.append(proxies[1].reset())

                scheduler.on_token = on_token
                results = await scheduler.generate(prompts, params)
                # The cut executor reconnects, rejoins as a new incarnation and gets work.
                member = fleet.get(proxies[1].target)
                await fleet.wait_serving(30)
                async with asyncio.timeout(30):
                    while member.state is not ExecutorState.SERVING:
                        await fleet.wait_for_change(fleet.generation, None)
                before = member.counters.admitted
                again = await Scheduler(FleetBackend(fleet), CONFIG).generate(
                    _prompts(6, seed=1), GenerationParams(max_new_tokens=4)
                )
                assert all(r.finish_reason == "length" for r in again)
                return reference, results, fleet.metrics(), member.counters.admitted - before
        finally:
            for proxy in proxies:
                await proxy.close()

    reference, results, metrics, admitted_after = run_scenario(scenario(), 240)
    tally = _tally("fleet-cut-link", results, len(prompts))
    failovers = sum(r.failovers for r in results)
    tally.notes = f"failovers={failovers}"
    tally.blocks_leaked = sum(s.blocks_leaked() for s in servers)
    report(tally)
    assert [r.output_ids for r in results] == reference
    assert failovers > 0, metrics
    cut_member = [m for m in metrics.values() if m["lost"]]
    assert len(cut_member) == 1 and cut_member[0]["joined"] == 2, metrics
    assert admitted_after > 0, metrics
    assert all(r.executor for r in results)


def test_an_admission_on_a_member_lost_meanwhile_is_given_back() -> None:
    """A member deemed lost while its admission was on the way (a step there answered
    UNAVAILABLE) may be alive: the fleet places the request elsewhere and cancels that
    admission, instead of leaving its cache to the lease (300 s by default)."""
    with serve_in_process(ENGINE) as server:

        async def scenario() -> str:
            async with ExecutorFleet([server.target]) as fleet:
                backend = FleetBackend(fleet)
                await backend.open()
                member = fleet.get(server.target)
                admit = member.client.try_admit_prefill

                async def admitted_then_lost(request: Any) -> Any:
                    decision = await admit(request)
                    lost = ExecutorError("injected loss", grpc.StatusCode.UNAVAILABLE)
                    fleet.report_failure(member, member.incarnation, lost)
                    return decision

                member.client.try_admit_prefill = admitted_then_lost  # type: ignore[method-assign]
                tokens = prompt(11, 24)
                admission = await backend.admit("given-back", tokens, len(tokens) + 8, len(tokens))
                await backend.close()
                return admission.kind

        # Its only member lost, the request waits for the fleet to change.
        assert run_scenario(scenario(), 60) == "deferred"
        assert server.blocks_leaked() == 0  # the admitted cache is gone, its blocks free


def test_an_executor_answering_unavailable_mid_step_fails_over_and_rejoins(
    servers: list[InProcessServer], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The third executor is healthy but answers one step UNAVAILABLE (fault injection): its
    requests move, replayed, and it rejoins; its old caches come back when the stream ends."""
    prompts = _prompts(12, seed=3)
    params = GenerationParams(max_new_tokens=24)
    plan = tmp_path / "faults.json"
    monkeypatch.setenv(faults.ENABLE_ENV, "1")
    monkeypatch.setenv(faults.PLAN_ENV, str(plan))
    with serve_in_process(ENGINE) as faulty:
        monkeypatch.delenv(faults.ENABLE_ENV)  # the next servers run without injection

        async def scenario() -> tuple[list[Any], list[GenerationResult], dict[str, Any]]:
            reference = await _single(servers[0].target, prompts, params)
            async with ExecutorFleet(
                [servers[0].target, servers[1].target, faulty.target]
            ) as fleet:
                async with asyncio.timeout(30):
                    while len(fleet.serving()) < 3:
                        await fleet.wait_for_change(fleet.generation, None)
                member = fleet.get(faulty.target)
                scheduler = Scheduler(FleetBackend(fleet), CONFIG)
                produced = 0

                def on_token(index: int, token: int) -> None:
                    nonlocal produced
                    produced += 1
                    if produced == 40:  # the executor's next forward answers UNAVAILABLE
                        plan.write_text(
                            json.dumps({"rules": [{"kind": "unavailable", "times": 1}]})
                        )

                scheduler.on_token = on_token
                results = await scheduler.generate(prompts, params)
                async with asyncio.timeout(30):
                    while member.state is not ExecutorState.SERVING or member.incarnation < 2:
                        await fleet.wait_for_change(fleet.generation, None)
                again = await Scheduler(FleetBackend(fleet), CONFIG).generate(
                    _prompts(6, seed=4), GenerationParams(max_new_tokens=4)
                )
                assert all(r.finish_reason == "length" for r in again)
                return reference, results, fleet.metrics()

        reference, results, metrics = run_scenario(scenario(), 240)
        faulted = metrics[faulty.target]
        tally = _tally("fleet-unavailable-step", results, len(prompts))
        tally.notes = f"failovers={sum(r.failovers for r in results)}"
        tally.blocks_leaked = faulty.blocks_leaked() + sum(s.blocks_leaked() for s in servers)
    report(tally)
    assert [r.output_ids for r in results] == reference
    assert sum(r.failovers for r in results) > 0, metrics
    assert faulted["lost"] == 1 and faulted["joined"] == 2, metrics
    assert faulted["admitted"] > faulted["failed_over"], metrics  # it got work after rejoining
    assert tally.blocks_leaked == 0


def test_decode_continuation_over_a_fleet_survives_a_cut_link_mid_step(
    servers: list[InProcessServer],
) -> None:
    """Two steps in flight on each executor's lane, every running request a continuation: a
    link cut mid-run loses both steps in flight there (the continuation is void with the item
    it follows), and those requests are replayed elsewhere without a token lost or repeated."""
    prompts = _prompts(12, seed=8)
    params = GenerationParams(max_new_tokens=24)
    config = dataclasses.replace(CONFIG, decode_continuation=True)

    async def scenario() -> tuple[list[Any], list[GenerationResult], Scheduler, dict[str, Any]]:
        reference = await _single(servers[0].target, prompts, params)
        proxies = [TcpProxy(s.running.port) for s in servers]
        for proxy in proxies:
            await proxy.start()
        try:
            async with ExecutorFleet([p.target for p in proxies]) as fleet:
                async with asyncio.timeout(30):
                    while len(fleet.serving()) < 3:
                        await fleet.wait_for_change(fleet.generation, None)
                scheduler = Scheduler(FleetBackend(fleet), config)
                produced = 0

                def on_token(index: int, token: int) -> None:
                    nonlocal produced
                    produced += 1
                    if produced == 60:  # mid-run: continuations in flight on every lane
                        proxies[2].reset()

                scheduler.on_token = on_token
                results = await scheduler.generate(prompts, params)
                return reference, results, scheduler, fleet.metrics()
        finally:
            for proxy in proxies:
                await proxy.close()

    reference, results, scheduler, metrics = run_scenario(scenario(), 240)
    tally = _tally("fleet-continuation-cut-link", results, len(prompts))
    tally.notes = f"failovers={sum(r.failovers for r in results)}"
    report(tally)
    assert [r.output_ids for r in results] == reference
    stats = scheduler.stats
    assert stats.continuations > 0 and stats.max_in_flight == 2, stats
    assert sum(r.failovers for r in results) > 0, metrics
    # The lost steps' answers came back lost, and the continuations among them were discarded.
    assert stats.discarded_items > 0, stats


def test_a_member_without_continuation_gets_plain_decodes_while_the_others_continue(
    servers: list[InProcessServer],
) -> None:
    """Members of a fleet may run different versions: a lane continues decodes only if its own
    executor said it takes them (an older one would read a continuation as a decode of token 0)."""
    prompts = _prompts(9, seed=9)
    params = GenerationParams(max_new_tokens=16)
    config = dataclasses.replace(CONFIG, decode_continuation=True)
    old = servers[1].target

    async def scenario() -> tuple[list[Any], list[GenerationResult], list[tuple[str, bool]]]:
        reference = await _single(servers[0].target, prompts, params)
        async with ExecutorFleet([s.target for s in servers]) as fleet:
            async with asyncio.timeout(30):
                while len(fleet.serving()) < 3:
                    await fleet.wait_for_change(fleet.generation, None)
            capabilities = fleet.get(old).capabilities
            assert capabilities is not None and capabilities.supports_decode_continuation
            capabilities.supports_decode_continuation = False  # as an older executor says
            backend = FleetBackend(fleet)
            sent: list[tuple[str, bool]] = []
            submit = backend.submit

            def recording(items: Sequence[PlannedItem]) -> Awaitable[StepResult]:
                sent.extend((backend.executor_of(i.cache_id), i.continuation) for i in items)
                return submit(items)

            backend.submit = recording  # type: ignore[method-assign]
            results = await Scheduler(backend, config).generate(prompts, params)
            return reference, results, sent

    reference, results, sent = run_scenario(scenario(), 240)
    assert [r.output_ids for r in results] == reference
    to_old = [continued for executor, continued in sent if executor == old]
    to_others = [continued for executor, continued in sent if executor != old]
    assert to_old and not any(to_old), "a continuation went to the member without it"
    assert any(to_others), "the members that take continuations got none"


def test_continued_lanes_preempt_on_their_own_executor_and_match_a_roomy_run(
    servers: list[InProcessServer],
) -> None:
    """One member's pool is too small for its share: its decodes are deferred with
    continuations in flight, its lane drains and preempts there (each lane keeps its own
    deferrals), and every output equals a single roomy executor's."""
    prompts = [prompt(7000 + k, 20) for k in range(6)]
    params = GenerationParams(max_new_tokens=16)
    config = dataclasses.replace(CONFIG, decode_continuation=True)
    with serve_in_process({**ENGINE, "kv_cache_bytes": 24 * tiny_block_bytes(4)}) as tight:

        async def scenario() -> tuple[list[Any], list[GenerationResult], Scheduler]:
            reference = await _single(servers[0].target, prompts, params)
            async with ExecutorFleet([tight.target, servers[1].target]) as fleet:
                async with asyncio.timeout(30):
                    while len(fleet.serving()) < 2:
                        await fleet.wait_for_change(fleet.generation, None)
                scheduler = Scheduler(FleetBackend(fleet), config)
                results = await scheduler.generate(prompts, params)
            return reference, results, scheduler

        reference, results, scheduler = run_scenario(scenario(), 240)
        leaked = tight.blocks_leaked()
    assert [r.output_ids for r in results] == reference
    stats = scheduler.stats
    assert stats.deferred_items > 0 and stats.preemptions > 0 and stats.continuations > 0, stats
    assert {r.executor for r in results} == {tight.target, servers[1].target}
    assert leaked == 0


def test_each_executor_runs_its_own_steps_so_a_slow_one_holds_back_only_its_requests(
    servers: list[InProcessServer], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One lane per executor: the requests on a fast executor finish at its pace while a slow
    one (every forward delayed 0.2 s) is still on its first tokens; in one lock-step loop they
    would all finish together, at the slow one's pace."""
    prompts = _prompts(8, seed=6)
    params = GenerationParams(max_new_tokens=12)
    plan = tmp_path / "faults.json"
    plan.write_text(json.dumps({"rules": [{"kind": "slow", "delay_s": 0.2}]}))
    monkeypatch.setenv(faults.ENABLE_ENV, "1")
    monkeypatch.setenv(faults.PLAN_ENV, str(plan))
    with serve_in_process(ENGINE) as slow:
        monkeypatch.delenv(faults.ENABLE_ENV)

        async def scenario() -> tuple[list[Any], list[GenerationResult], float]:
            reference = await _single(servers[0].target, prompts, params)
            async with ExecutorFleet([servers[0].target, slow.target]) as fleet:
                async with asyncio.timeout(30):
                    while len(fleet.serving()) < 2:
                        await fleet.wait_for_change(fleet.generation, None)
                start = time.perf_counter()
                results = await Scheduler(FleetBackend(fleet), CONFIG).generate(prompts, params)
            return reference, results, start

        reference, results, start = run_scenario(scenario(), 240)
    assert [r.output_ids for r in results] == reference
    fast_done = [r.finished_s - start for r in results if r.executor == servers[0].target]
    slow_done = [r.finished_s - start for r in results if r.executor == slow.target]
    assert fast_done and slow_done  # placement spread them by load
    # The slow executor needs at least 13 forwards of 0.2 s for its requests.
    assert min(slow_done) > 2.5
    assert max(fast_done) < 0.5 * min(slow_done), (fast_done, slow_done)


def test_prefix_affinity_keeps_a_shared_prefix_on_one_executor(
    servers: list[InProcessServer],
) -> None:
    shared = prompt(4242, 256)
    prompts = [shared + prompt(5000 + k, 8) for k in range(16)]

    async def scenario() -> dict[str, Any]:
        async with ExecutorFleet([s.target for s in servers]) as fleet:
            await fleet.wait_serving(30)
            async with asyncio.timeout(30):
                while len(fleet.serving()) < 3:
                    await fleet.wait_for_change(fleet.generation, None)
            results = await Scheduler(FleetBackend(fleet), CONFIG).generate(
                prompts, GenerationParams(max_new_tokens=4)
            )
            assert all(r.finish_reason == "length" for r in results)
            return fleet.metrics()

    metrics = run_scenario(scenario(), 240)
    prefilled = sorted(int(m["prefill_tokens"]) for m in metrics.values())
    # Every prompt went where the prefix was placed: the other two computed none of it.
    assert prefilled[0] == prefilled[1] == 0, metrics
    assert prefilled[2] >= 256, metrics


def test_a_draining_executor_finishes_its_requests_and_gets_no_new_ones(
    servers: list[InProcessServer],
) -> None:
    prompts = _prompts(12, seed=2)
    params = GenerationParams(max_new_tokens=24)
    with serve_in_process(ENGINE) as drained:

        async def scenario() -> tuple[list[Any], list[GenerationResult], int, int, str, bool]:
            reference = await _single(servers[0].target, prompts, params)
            targets = [servers[0].target, servers[1].target, drained.target]
            async with ExecutorFleet(targets) as fleet:
                async with asyncio.timeout(30):
                    while len(fleet.serving()) < 3:
                        await fleet.wait_for_change(fleet.generation, None)
                member = fleet.get(drained.target)
                scheduler = Scheduler(FleetBackend(fleet), CONFIG)
                produced = 0
                at_drain: list[int] = []
                drain: list[concurrent.futures.Future[bool]] = []

                def on_token(index: int, token: int) -> None:
                    nonlocal produced
                    produced += 1
                    if produced == 40:  # SIGTERM's drain, on the server's own loop
                        drain.append(
                            asyncio.run_coroutine_threadsafe(
                                drained.running.drain(10.0), drained.loop
                            )
                        )

                async def watch_drain() -> None:
                    while member.state is ExecutorState.SERVING:
                        await fleet.wait_for_change(fleet.generation, None)
                    at_drain.append(member.counters.admitted)

                watcher = asyncio.ensure_future(watch_drain())
                scheduler.on_token = on_token
                results = await scheduler.generate(prompts, params)
                await asyncio.wait_for(watcher, 30)
                finished = await asyncio.wait_for(asyncio.wrap_future(drain[0]), 30)
                return (
                    reference,
                    results,
                    at_drain[0],
                    member.counters.admitted,
                    member.state.value,
                    finished,
                )

        reference, results, admitted_at_drain, admitted_end, state, finished = run_scenario(
            scenario(), 240
        )
    tally = _tally("fleet-drain", results, len(prompts))
    tally.notes = f"failovers={sum(r.failovers for r in results)}"
    report(tally)
    assert [r.output_ids for r in results] == reference
    assert admitted_at_drain > 0  # it had work when the drain began
    assert admitted_end == admitted_at_drain, "a request landed on a draining executor"
    # Its running requests finished there: none moved, and its drain cut none off.
    assert sum(r.failovers for r in results) == 0
    assert sum(r.executor == drained.target for r in results) == admitted_at_drain
    assert finished
    assert state in ("draining", "lost")


def test_an_admission_refused_as_draining_marks_the_member_draining_not_lost(
    servers: list[InProcessServer],
) -> None:
    """An executor may refuse admissions (reason DRAINING) before its health watch says so:
    the fleet then sends new requests elsewhere and loses nothing there."""
    with serve_in_process(ENGINE) as early:

        async def scenario() -> tuple[list[GenerationResult], dict[str, Any], str]:
            async with ExecutorFleet([early.target, servers[0].target]) as fleet:
                async with asyncio.timeout(30):
                    while len(fleet.serving()) < 2:
                        await fleet.wait_for_change(fleet.generation, None)
                # The finishing phase alone (health still SERVING): admissions are refused.
                early.loop.call_soon_threadsafe(early.running.servicer.begin_finishing)
                member = fleet.get(early.target)
                member.running = -1  # rank it first, so the first admission goes there
                results = await Scheduler(FleetBackend(fleet), CONFIG).generate(
                    _prompts(4, seed=5), GenerationParams(max_new_tokens=4)
                )
                return results, fleet.metrics(), member.state.value

        results, metrics, state = run_scenario(scenario(), 120)
    assert all(r.finish_reason == "length" and r.failovers == 0 for r in results)
    assert {r.executor for r in results} == {servers[0].target}
    assert state == "draining", metrics
    assert metrics[early.target]["lost"] == 0, metrics


def test_generate_cli_drives_every_target_given(
    servers: list[InProcessServer], capsys: pytest.CaptureFixture[str]
) -> None:
    from ferrum_server.tools.cli import build_parser

    a, b, c = (s.target for s in servers)
    args = build_parser().parse_args(
        ["generate", "--target", a, "--target", f"{b},{c}", "--random", "6", "--max-new-tokens",
         "3", "--target-step-ms", "0", "--json"]
    )  # fmt: skip
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["executors"]) == {a, b, c}  # no flag silently dropped
    assert {r["executor"] for r in report["results"]} == {a, b, c}  # least loaded: spread
    assert all(r["failovers"] == 0 and len(r["output_ids"]) == 3 for r in report["results"])
    bad = build_parser().parse_args(["generate", "--target", f"{a},", "--random", "1"])
    assert bad.func(bad) == 2
    assert "empty executor address" in capsys.readouterr().err


def test_requests_deferred_everywhere_wait_for_capacity_and_all_complete() -> None:
    # Two executors of 24 blocks: a request needs 12, so at most two run on each at once and
    # the rest are deferred by both until a completion frees room somewhere.
    small = {**ENGINE, "kv_cache_bytes": 24 * 4 * 512}  # 24 blocks of 4 float32 tiny tokens
    prompts = [prompt(9000 + k, 40) for k in range(8)]
    params = GenerationParams(max_new_tokens=8)
    with serve_in_process(small) as first, serve_in_process(small) as second:

        async def scenario() -> tuple[list[Any], list[GenerationResult], Any]:
            async with ExecutorFleet([first.target, second.target]) as fleet:
                async with asyncio.timeout(30):
                    while len(fleet.serving()) < 2:
                        await fleet.wait_for_change(fleet.generation, None)
                scheduler = Scheduler(FleetBackend(fleet), CONFIG)
                results = await scheduler.generate(prompts, params)
            async with AsyncExecutorClient(first.target) as client:
                alone = [
                    (await Scheduler(client, CONFIG).generate([p], params))[0].output_ids
                    for p in prompts
                ]
            return alone, results, scheduler.stats

        alone, results, stats = run_scenario(scenario(), 240)
        tally = _tally("fleet-deferred-everywhere", results, len(prompts))
        tally.blocks_leaked = first.blocks_leaked() + second.blocks_leaked()
    report(tally)
    assert [r.output_ids for r in results] == alone
    assert stats.admissions_deferred > 0
    assert {r.executor for r in results} == {first.target, second.target}

"""Process-level faults on a real server subprocess: SIGTERM mid-batch, SIGKILL and restart."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import time
from typing import Any

import grpc
import pytest
from ferrum_client import (
    AsyncExecutorClient,
    BatchBuilder,
    ExecutorClient,
    ExecutorError,
    NotFoundError,
    StaleExecutorError,
    pb,
)
from ferrum_server.server_process import start_server_process
from helpers_server import logged_metrics_port, wait_for_rpcs_started
from reliability.harness import Tally, code_name, prompt, report, run_scenario

SERVING, NOT_SERVING = 1, 2


def _start(
    tmp_path: pathlib.Path, *args: str, slow_s: float = 0.0, metrics: bool = False
) -> tuple[object, int]:
    """A server subprocess; with `metrics`, on an ephemeral metrics port that it logs
    (`helpers_server.logged_metrics_port(tmp_path / "server.log")`)."""
    env = dict(os.environ)
    if slow_s:
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps({"rules": [{"kind": "slow", "delay_s": slow_s}]}))
        env.update(FERRUM_ENABLE_FAULT_INJECTION="1", FERRUM_FAULT_PLAN=str(plan))
    log = open(tmp_path / "server.log", "ab")  # noqa: SIM115 - owned by the child
    observed = ["--metrics-port", "0", "--log-level", "info", "--log-format", "json"]
    return start_server_process(
        [*(observed if metrics else ["--metrics-port", "-1", "--log-level", "warning"]), *args],
        env=env,
        stdout=log,
        stderr=log,
    )


def test_sigterm_mid_batch_finishes_in_flight_work_and_exits_zero(tmp_path: pathlib.Path) -> None:
    process, port = _start(tmp_path, "--grace-s", "10", slow_s=0.5, metrics=True)
    target = f"127.0.0.1:{port}"
    metrics_port = logged_metrics_port(tmp_path / "server.log")
    tally = Tally("sigterm-mid-batch")

    async def scenario() -> None:
        async with AsyncExecutorClient(target, timeout_s=30) as client:

            async def one(k: int) -> None:
                name = f"term-{k}"
                tally.send(name)
                try:
                    await client.prefill(
                        pb.PrefillRequest(request_id=name, input_tokens=prompt(k, 20))
                    )
                    tally.resolve(name)  # the drain releases its cache
                except ExecutorError as exc:
                    tally.resolve(name, code_name(exc))

            # The connection is open before the four calls go out, so that on a loaded machine
            # they still reach the server at once, before the SIGTERM.
            await client.get_info()
            calls = [asyncio.ensure_future(one(k)) for k in range(4)]
            # All four on the server (one step running, three queued behind it) before the
            # SIGTERM: a call that reached it later would rightly be refused as draining.
            await wait_for_rpcs_started(metrics_port, "Prefill", 4)
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
            await asyncio.sleep(0.1)
            # Health flips first; once the listener stops, new calls cannot even connect.
            try:
                assert await client.health() == NOT_SERVING
            except ExecutorError as exc:
                assert exc.code == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(ExecutorError) as late:
                await client.prefill(pb.PrefillRequest(request_id="late", input_tokens=[1]))
            assert late.value.code == grpc.StatusCode.UNAVAILABLE
            await asyncio.gather(*calls)
            assert time.monotonic() - sent < 10

    try:
        run_scenario(scenario(), 60)
        assert process.wait(timeout=30) == 0  # type: ignore[attr-defined]
    finally:
        process.kill()  # type: ignore[attr-defined]
    assert tally.completed == 4  # every in-flight step finished within the grace period
    report(tally)


def test_sigkill_then_restart_fences_stale_callers(tmp_path: pathlib.Path) -> None:
    tally = Tally("sigkill-restart")
    process, port = _start(tmp_path, slow_s=0.5)
    try:
        with ExecutorClient(f"127.0.0.1:{port}", timeout_s=10) as old:
            instance = old.get_info().executor_instance_id
            opened = old.prefill(
                pb.PrefillRequest(
                    request_id="pre-crash", input_tokens=[1, 2, 3], executor_instance_id=instance
                )
            )

            async def in_flight() -> str:
                async with AsyncExecutorClient(f"127.0.0.1:{port}", timeout_s=10) as client:
                    try:
                        await client.prefill(
                            pb.PrefillRequest(request_id="mid", input_tokens=[4, 5, 6])
                        )
                        return "OK"
                    except ExecutorError as exc:
                        return code_name(exc)

            async def crash_mid_step() -> str:
                call = asyncio.ensure_future(in_flight())
                await asyncio.sleep(0.25)
                process.kill()  # type: ignore[attr-defined]
                return await call

            tally.send("mid")
            tally.resolve("mid", run_scenario(crash_mid_step(), 30))
            assert tally.codes["UNAVAILABLE"] == 1
    finally:
        process.kill()  # type: ignore[attr-defined]
        process.wait(timeout=10)  # type: ignore[attr-defined]
    process, port = _start(tmp_path)
    try:
        with ExecutorClient(f"127.0.0.1:{port}", timeout_s=10) as new:
            assert new.get_info().executor_instance_id != instance
            stale_calls = {
                "prefill": lambda: new.prefill(
                    pb.PrefillRequest(
                        request_id="stale", input_tokens=[1], executor_instance_id=instance
                    )
                ),
                "decode": lambda: new.decode(
                    pb.DecodeRequest(
                        cache_id=opened.completed.kv_cache.cache_id,
                        input_token=1,
                        position=3,
                        executor_instance_id=instance,
                        step_id=5,
                    )
                ),
                "release": lambda: new.release_cache(
                    pb.ReleaseCacheRequest(
                        cache_id=opened.completed.kv_cache.cache_id, executor_instance_id=instance
                    )
                ),
            }
            for name, call in stale_calls.items():
                tally.send(name)
                with pytest.raises(StaleExecutorError) as caught:
                    call()
                tally.resolve(name, caught.value.code.name)
            # Nothing from before the crash is reachable, and the refusals changed nothing.
            with pytest.raises(NotFoundError):
                new.release_cache(
                    pb.ReleaseCacheRequest(cache_id=opened.completed.kv_cache.cache_id)
                )
            status = new.get_status()
            assert status.status.active_sequences == 0 and status.status.steps_executed == 1
            tally.blocks_leaked = int(new.get_kv_slot_capacity().snapshot.used_blocks)
    finally:
        process.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        process.wait(timeout=30)  # type: ignore[attr-defined]
    report(tally)


def test_sigterm_ends_idle_streams_and_waits_at_once(tmp_path: pathlib.Path) -> None:
    """Idle calls do not hold a drain for its grace period: with no cache held and an idle
    WatchCapacity, a parked WaitForCapacityChange, an idle StepStream (its one step answered,
    its cache released) and a health Watch open, SIGTERM ends them with UNAVAILABLE (the
    health Watch after it has seen NOT_SERVING) and the process exits 0 in far less than
    --grace-s 20."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    process, port = _start(tmp_path, "--grace-s", "20")
    target = f"127.0.0.1:{port}"
    tally = Tally("sigterm-idle-streams")
    service = "/ferrum.executor.v1.ExecutorService/"

    last: dict[str, Any] = {}

    async def ended(name: str, call: Any) -> None:
        """Read the call to its end; resolve it with its final code."""
        tally.send(name)
        try:
            if hasattr(call, "read"):
                while (message := await call.read()) is not grpc.aio.EOF:
                    last[name] = message
            else:
                await call
        except grpc.aio.AioRpcError as exc:
            tally.resolve(name, exc.code().name)
            return
        tally.resolve(name, "OK")

    async def scenario() -> float:
        async with grpc.aio.insecure_channel(target) as channel:
            stream = channel.stream_stream(
                service + "StepStream",
                request_serializer=pb.StepStreamRequest.SerializeToString,
                response_deserializer=pb.StepStreamResponse.FromString,
            )()
            builder = BatchBuilder()
            builder.add_prefill_chunk("idle", "", [3, 1, 4], 0, 3)
            await stream.write(
                pb.StepStreamRequest(step_id=1, batch=pb.UnifiedBatchRequest(items=builder.build()))
            )
            answer = await stream.read()
            assert answer.HasField("result")
            # Released (before the wait below reads the state it waits on): a cache still held
            # would keep the drain's finishing phase open (its request runs to its end).
            await channel.unary_unary(
                service + "ReleaseCache",
                request_serializer=pb.ReleaseCacheRequest.SerializeToString,
                response_deserializer=pb.ReleaseCacheResponse.FromString,
            )(pb.ReleaseCacheRequest(cache_id=answer.result.results.cache_ids[0]))
            watch = channel.unary_stream(
                service + "WatchCapacity",
                request_serializer=pb.WatchCapacityRequest.SerializeToString,
                response_deserializer=pb.WatchCapacityResponse.FromString,
            )(pb.WatchCapacityRequest())
            first = await watch.read()
            condition = pb.CapacityWaitCondition(coordinator_id=first.epochs.coordinator_id)
            condition.observed.append(first.sources[0])
            wait = channel.unary_unary(
                service + "WaitForCapacityChange",
                request_serializer=pb.WaitForCapacityChangeRequest.SerializeToString,
                response_deserializer=pb.WaitForCapacityChangeResponse.FromString,
            )(pb.WaitForCapacityChangeRequest(condition=condition, timeout_ms=60_000))
            health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await health.read()).status == SERVING
            await asyncio.sleep(0.2)  # the wait is parked
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
            await asyncio.gather(
                ended("watch", watch),
                ended("wait", wait),
                ended("stream", stream),
                ended("health-watch", health),
            )
            return time.monotonic() - sent

    try:
        took = run_scenario(scenario(), 60)
        assert process.wait(timeout=30) == 0  # type: ignore[attr-defined]
    finally:
        process.kill()  # type: ignore[attr-defined]
    tally.notes = f"streams_ended_after={took:.2f}s"
    report(tally)
    assert tally.codes["UNAVAILABLE"] == 4, tally.line()
    assert took < 5.0, tally.line()  # it was the whole grace period, 20 s
    assert last["health-watch"].status == NOT_SERVING  # told before the watch ended

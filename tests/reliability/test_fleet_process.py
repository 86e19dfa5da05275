"""A fleet with one executor in a real subprocess: SIGKILLed mid-run, then restarted on the same
port. Two in-process executors keep the machine's cost down; the subprocess is the one killed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
from typing import Any

from ferrum_client import AsyncExecutorClient
from ferrum_client.fleet import ExecutorFleet, ExecutorState, Member
from ferrum_client.fleet_backend import FleetBackend
from ferrum_client.scheduler import GenerationParams, GenerationResult, Scheduler, SchedulerConfig
from ferrum_server.server_process import start_server_process
from reliability.harness import Tally, prompt, report, run_scenario, serve_in_process

CONFIG = SchedulerConfig(max_step_tokens=64, target_step_ms=0)
ENGINE = {"kv_cache_bytes": 4 * 1024**2, "max_batch_tokens": 512}
SERVER_ARGS = (
    "--metrics-port",
    "-1",
    "--log-level",
    "warning",
    "--block-size",
    "4",
    "--kv-cache-bytes",
    str(4 * 1024**2),
    "--max-batch-tokens",
    "512",
    "--max-batch-size",
    "32",
)


def _spawn(tmp_path: pathlib.Path, *args: str) -> tuple[Any, int]:
    log = open(tmp_path / "server.log", "ab")  # noqa: SIM115 - owned by the child
    return start_server_process([*SERVER_ARGS, *args], stdout=log, stderr=log)


async def _until(fleet: ExecutorFleet, member: Member, incarnation: int) -> None:
    async with asyncio.timeout(120):
        while member.state is not ExecutorState.SERVING or member.incarnation < incarnation:
            await fleet.wait_for_change(fleet.generation, None)


def test_sigkill_mid_run_loses_nothing_and_the_restarted_executor_rejoins(
    tmp_path: pathlib.Path,
) -> None:
    prompts = [prompt(7000 + k, 20 + 7 * (k % 5)) for k in range(12)]
    params = GenerationParams(max_new_tokens=24)
    process, port = _spawn(tmp_path)
    try:
        with serve_in_process(ENGINE) as first, serve_in_process(ENGINE) as second:
            killed_target = f"127.0.0.1:{port}"

            async def scenario() -> tuple[list[Any], list[GenerationResult], dict[str, Any]]:
                async with AsyncExecutorClient(first.target) as client:
                    reference = await Scheduler(client, CONFIG).generate(prompts, params)
                targets = [first.target, second.target, killed_target]
                async with ExecutorFleet(targets) as fleet:
                    member = fleet.get(killed_target)
                    await _until(fleet, member, 1)
                    old_instance = member.instance_id
                    scheduler = Scheduler(FleetBackend(fleet), CONFIG)
                    produced = 0

                    def on_token(index: int, token: int) -> None:
                        nonlocal produced
                        produced += 1
                        if produced == 40:
                            os.kill(process.pid, signal.SIGKILL)

                    scheduler.on_token = on_token
                    results = await scheduler.generate(prompts, params)
                    assert member.counters.lost == 1
                    # Restarted on the same port: a new instance id, a new incarnation, work.
                    await asyncio.to_thread(process.wait, 10)
                    restarted = await asyncio.to_thread(_spawn, tmp_path, "--port", str(port))
                    processes.append(restarted[0])
                    await _until(fleet, member, 2)
                    assert member.instance_id != old_instance
                    before = member.counters.admitted
                    again = await Scheduler(FleetBackend(fleet), CONFIG).generate(
                        [prompt(8000 + k, 12) for k in range(6)], GenerationParams(max_new_tokens=4)
                    )
                    assert all(r.finish_reason == "length" for r in again)
                    assert member.counters.admitted > before, fleet.metrics()
                    return [r.output_ids for r in reference], results, fleet.metrics()

            processes: list[Any] = []
            try:
                reference, results, metrics = run_scenario(scenario(), 300)
            finally:
                for extra in processes:
                    extra.kill()
                    extra.wait(timeout=10)
            blocks_leaked = first.blocks_leaked() + second.blocks_leaked()
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait(timeout=10)
    tally = Tally("fleet-sigkill")
    for k in range(len(prompts)):
        tally.send(f"p{k}")
    for result in results:
        ok = result.finish_reason in ("length", "stop")
        tally.resolve(f"p{result.index}", "OK" if ok else result.finish_reason)
    tally.blocks_leaked = blocks_leaked
    tally.notes = f"failovers={sum(r.failovers for r in results)}"
    report(tally)
    assert [r.output_ids for r in results] == reference
    assert sum(r.failovers for r in results) > 0, metrics

"""Load held: steady mixed load (exactly-once, solo-equal greedy outputs, no leak, bounded RSS)
and overload (excess deferred fast, exact recovery)."""

from __future__ import annotations

import asyncio
import time
import zlib

import pytest
from ferrum_client import AsyncExecutorClient, pb
from reliability.harness import (
    Generation,
    Tally,
    drive,
    prompt,
    report,
    rss_bytes,
    run_scenario,
    serve_in_process,
    solo_outputs,
)

PROMPT_LENGTHS = {"p5": 5, "p9": 9, "p17": 17, "p23": 23, "p33": 33, "p40": 40}
MAX_NEW = 6


async def _steady_load(target: str, num_tasks: int, num_waves: int, per_wave: int) -> Tally:
    prompts = {name: prompt(i, n) for i, (name, n) in enumerate(PROMPT_LENGTHS.items())}
    reference = await solo_outputs(target, prompts, MAX_NEW)
    tally = Tally(f"steady-load[{num_tasks}x{num_waves}x{per_wave}]")
    names = list(prompts)
    clients = [AsyncExecutorClient(target, timeout_s=120) for _ in range(4)]
    mismatches: list[str] = []
    rss_after_first_wave: list[int] = []

    async def task(index: int) -> None:
        client = clients[index % len(clients)]
        for wave in range(num_waves):
            gens = []
            for k in range(per_wave):
                name = names[(index + wave + k) % len(names)]
                gens.append(Generation(f"t{index}-w{wave}-{k}:{name}", prompts[name], MAX_NEW))
            await drive(client, gens, tally)
            mismatches.extend(
                g.request_id for g in gens if g.tokens != reference[g.request_id.split(":")[1]]
            )
            if wave == 0 and index == 0:
                rss_after_first_wave.append(rss_bytes())

    try:
        await asyncio.gather(*(task(i) for i in range(num_tasks)))
    finally:
        for client in clients:
            await client.close()
    growth = rss_bytes() - rss_after_first_wave[0]
    tally.notes = f"rss_growth={growth / 2**20:.1f}MiB"
    assert not mismatches, f"outputs differ from solo runs: {mismatches[:5]}"
    assert growth < 50 * 2**20, tally.line()
    return tally


@pytest.mark.parametrize(
    ("num_tasks", "num_waves", "per_wave"),
    [
        pytest.param(16, 3, 4, id="ci"),
        pytest.param(48, 6, 4, id="heavy", marks=pytest.mark.slow),
    ],
)
def test_steady_mixed_load_resolves_every_request_once(
    num_tasks: int, num_waves: int, per_wave: int
) -> None:
    with serve_in_process() as server:
        tally = run_scenario(_steady_load(server.target, num_tasks, num_waves, per_wave))
        tally.blocks_leaked = server.blocks_leaked()
    assert tally.completed == num_tasks * num_waves * per_wave
    report(tally)


def _admit(request_id: str, tokens: list[int]) -> pb.TryAdmitPrefillRequest:
    return pb.TryAdmitPrefillRequest(
        request_id=request_id, input_tokens=tokens, product_prompt_tokens=len(tokens)
    )


def test_overload_defers_excess_fast_and_recovers_exactly() -> None:
    capacity = 8  # sequence slots = max batch size
    with serve_in_process(engine={"max_batch_size": capacity}) as server:
        tally = Tally("overload[4x capacity]")

        async def scenario() -> None:
            async with AsyncExecutorClient(server.target) as client:

                async def probe(request_id: str) -> tuple[str, float, pb.TryAdmitPrefillResponse]:
                    tally.send(request_id)
                    started = time.monotonic()
                    # Distinct prompts: identical ones would wait on each other's prefix.
                    tokens = prompt(zlib.crc32(request_id.encode()), 12)
                    answer = await client.try_admit_prefill(_admit(request_id, tokens))
                    kind = answer.WhichOneof("decision") or ""
                    tally.resolve(request_id, "OK" if kind == "admitted" else kind.upper())
                    return kind, time.monotonic() - started, answer

                first = await asyncio.gather(*(probe(f"a{i}") for i in range(4 * capacity)))
                admitted = [a for kind, _, a in first if kind == "admitted"]
                deferred = [(s, a) for kind, s, a in first if kind == "deferred"]
                assert len(admitted) == capacity and len(deferred) == 3 * capacity
                assert max(s for s, _ in deferred) < 2.0  # answered without queueing on work
                for answer in admitted:
                    released = await client.cancel_prefill_admission(
                        pb.CancelPrefillAdmissionRequest(request_id=answer.admitted.request_id)
                    )
                    assert released.released
                second = await asyncio.gather(*(probe(f"b{i}") for i in range(capacity)))
                assert [kind for kind, _, _ in second] == ["admitted"] * capacity
                assert (await probe("c0"))[0] == "deferred"
                for _, _, answer in second:
                    await client.cancel_prefill_admission(
                        pb.CancelPrefillAdmissionRequest(request_id=answer.admitted.request_id)
                    )

        run_scenario(scenario())
        tally.blocks_leaked = server.blocks_leaked()
    report(tally)

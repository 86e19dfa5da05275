"""The fleet's pieces that need no executor: spec parsing, the client's prefix-hash chain (the
executor's, byte for byte), and DNS re-resolution through a fake resolver."""

from __future__ import annotations

import asyncio
import random

import pytest
from ferrum_client.fleet import ExecutorFleet, FleetSpec, parse_fleet_spec
from ferrum_client.prefix import chain_hashes
from ferrum_server.kv.manager import chain_hashes as server_chain_hashes


def test_spec_parses_lists_dns_and_repeated_flags() -> None:
    assert parse_fleet_spec("a:1,b:2") == FleetSpec(("a:1", "b:2"))
    assert parse_fleet_spec(["a:1", "b:2,a:1", "dns:///exec.ns.svc:50051"]) == FleetSpec(
        ("a:1", "b:2"), (("exec.ns.svc", 50051),)
    )
    assert parse_fleet_spec("[::1]:7") == FleetSpec(("[::1]:7",))


@pytest.mark.parametrize(
    "spec", ["", "a:1,,b:2", "a", "a:0", "a:70000", "a:x", "dns://x:1", "dns:///x", ":5"]
)
def test_bad_specs_are_refused_with_the_entry_named(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_fleet_spec(spec)


def test_client_prefix_hashes_equal_the_executors() -> None:
    rng = random.Random(0)
    for block_size in (1, 4, 16):
        for length in (0, 3, 16, 257):
            tokens = [rng.randrange(0, 2**31) for _ in range(length)]
            assert chain_hashes(tokens, block_size) == server_chain_hashes(tokens, block_size)


class FakeResolver:
    def __init__(self, answers: list[list[str] | Exception]) -> None:
        self.answers = answers
        self.calls = 0
        self.called = asyncio.Event()

    async def wait_calls(self, count: int) -> None:
        while self.calls < count:
            await self.called.wait()
            self.called.clear()

    async def resolve(self, name: str, port: int) -> list[str]:
        assert (name, port) == ("executors.test", 50051)
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        self.called.set()
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


def test_dns_members_follow_the_resolver() -> None:
    # Nothing listens on these ports: members stay connecting/lost, membership is what counts.
    a, b, c = "127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11"
    resolver = FakeResolver([[a, b], OSError("dns down"), [b, c]])

    async def scenario() -> list[list[str]]:
        seen: list[list[str]] = []
        fleet = ExecutorFleet(
            ["dns:///executors.test:50051", "127.0.0.1:12"],
            resolver=resolver,
            resolve_interval_s=0.05,
        )
        async with fleet:
            seen.append(sorted(fleet.names()))
            await resolver.wait_calls(2)  # the failed resolution
            seen.append(sorted(fleet.names()))
            await resolver.wait_calls(4)  # the third lookup has been applied in full
            seen.append(sorted(fleet.names()))
        seen.append(fleet.names())
        return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), 30))
    static = "127.0.0.1:12"
    assert seen[0] == sorted([a, b, static])
    assert seen[1] == sorted([a, b, static])  # a failed lookup removes nobody
    assert seen[2] == sorted([b, c, static])
    assert seen[3] == []


def test_bad_members_are_refused() -> None:
    async def scenario() -> None:
        async with ExecutorFleet("127.0.0.1:9") as fleet:
            with pytest.raises(ValueError):
                fleet.add("no-port")
            with pytest.raises(KeyError):
                fleet.get("127.0.0.1:10")
            assert fleet.names() == ["127.0.0.1:9"]

    asyncio.run(asyncio.wait_for(scenario(), 30))

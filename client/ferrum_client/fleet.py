"""A fleet of executors (one per GPU) as one handle: membership, health, capacity. No torch.

``ExecutorFleet`` is the registry: executors come from a static list of addresses and/or DNS
names resolved again every ``resolve_interval_s`` (a Kubernetes headless Service answers one
address per pod), and can be added and removed at run time. For each member it holds an
``AsyncExecutorClient``, the executor's instance id and capabilities, its health (the standard
``grpc.health.v1`` Watch stream) and its capacity (the ``WatchCapacity`` stream; never polled),
a state and per-executor counters.

States: SERVING (takes new requests), DRAINING (health reported NOT_SERVING: no new requests,
running ones keep going for as long as the executor takes their steps) and LOST (its channel
broke, a watch ended, a call answered UNAVAILABLE, or it answered with another instance id: it
restarted). A lost member that is still in the fleet is reconnected with a bounded backoff
(``RECONNECT_MIN_S`` doubling to ``RECONNECT_MAX_S``); once its health says SERVING again it
rejoins as a new incarnation (``Member.incarnation``), with nothing of the old one carried over:
the scheduler treats every request placed on the old incarnation as lost.

Every change the scheduler could wait for (a capacity event, a state change, a member added or
removed) advances ``ExecutorFleet.generation`` and wakes ``wait_for_change``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

from ferrum_client.errors import ExecutorError
from ferrum_client.handles import AsyncExecutorClient
from ferrum_client.pb import executor_pb2 as pb

SERVING_STATUS = 1  # grpc.health.v1 HealthCheckResponse.SERVING
# How often a DNS name is resolved again (a pod added to a headless Service is seen this late).
DEFAULT_RESOLVE_INTERVAL_S = 30.0
# Backoff between reconnection attempts to a lost member (doubling from the minimum).
RECONNECT_MIN_S = 0.1
RECONNECT_MAX_S = 2.0
# Prompt block hashes remembered per member for prefix affinity (least recently placed first out).
AFFINITY_MAX_BLOCKS = 65536


class ExecutorState(enum.Enum):
    CONNECTING = "connecting"
    SERVING = "serving"
    DRAINING = "draining"  # health NOT_SERVING: no new requests
    LOST = "lost"


class Resolver(Protocol):
    """Turns a DNS name into executor addresses ("host:port")."""

    async def resolve(self, name: str, port: int) -> list[str]: ...


class SystemResolver:
    """The event loop's getaddrinfo: every A/AAAA record of the name (a headless Service)."""

    async def resolve(self, name: str, port: int) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
        addresses: list[str] = []
        for family, _, _, _, sockaddr in infos:
            host = str(sockaddr[0])
            address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
            if address not in addresses:
                addresses.append(address)
        return addresses


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """Where the executors are: fixed addresses and DNS names (host, port) to resolve."""

    addresses: tuple[str, ...] = ()
    dns_names: tuple[tuple[str, int], ...] = ()


def _host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{what} {text!r} must be HOST:PORT with a port in 1..65535")
    return host, int(port_text)


def parse_fleet_spec(specs: str | Iterable[str]) -> FleetSpec:
    """``"host:port,host:port"`` and/or ``"dns:///name:port"``; several specs (repeated
    --target flags) accumulate. Raises ValueError naming the bad entry."""
    addresses: list[str] = []
    names: list[tuple[str, int]] = []
    for spec in [specs] if isinstance(specs, str) else list(specs):
        for entry in (part.strip() for part in spec.split(",")):
            if not entry:
                raise ValueError(f"empty executor address in {spec!r}")
            if entry.startswith("dns:"):
                if not entry.startswith("dns:///"):
                    raise ValueError(f"{entry!r}: a DNS target is dns:///NAME:PORT")
                name = _host_port(entry.removeprefix("dns:///"), "DNS target")
                if name not in names:
                    names.append(name)
                continue
            _host_port(entry, "executor address")
            if entry not in addresses:
                addresses.append(entry)
    if not addresses and not names:
        raise ValueError("no executor address given")
    return FleetSpec(tuple(addresses), tuple(names))


@dataclass(slots=True)
class MemberCounters:
    """Per-executor counters (cumulative over incarnations)."""

    admitted: int = 0
    steps: int = 0
    # Prompt (and replayed) tokens sent here to prefill, and tokens produced here.
    prefill_tokens: int = 0
    tokens: int = 0
    # Requests moved away after this member was lost.
    failed_over: int = 0
    # Times it was lost, and times it (re)joined.
    lost: int = 0
    joined: int = 0
    capacity_events: int = 0


@dataclass(slots=True)
class Member:
    """One executor of the fleet."""

    address: str
    client: AsyncExecutorClient
    state: ExecutorState = ExecutorState.CONNECTING
    instance_id: int = 0
    # Client-side count of joins: a request placed on an older incarnation is lost.
    incarnation: int = 0
    capabilities: pb.ExecutorCapabilities | None = None
    capacity: pb.WatchCapacityResponse | None = None
    block_size: int = 0
    counters: MemberCounters = field(default_factory=MemberCounters)
    # Prompt block hashes placed here (this incarnation), for prefix affinity.
    prefix_blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    # Requests the scheduler placed here and not yet retired (its load).
    running: int = 0
    task: asyncio.Task[None] | None = None
    removed: bool = False

    def cached_prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt were placed here already."""
        count = 0
        for digest in hashes:
            if digest not in self.prefix_blocks:
                break
            count += 1
        return count

    def remember_prefix(self, hashes: Sequence[bytes]) -> None:
        for digest in hashes:
            self.prefix_blocks[digest] = None
            self.prefix_blocks.move_to_end(digest)
        while len(self.prefix_blocks) > AFFINITY_MAX_BLOCKS:
            self.prefix_blocks.popitem(last=False)

    @property
    def used_fraction(self) -> float:
        kv = self.capacity.kv if self.capacity is not None else None
        if kv is None or not kv.total_blocks:
            return 0.0
        return float(kv.used_blocks + kv.reserved_blocks) / kv.total_blocks


ClientFactory = Callable[[str], AsyncExecutorClient]


class ExecutorFleet:
    """The registry of executors; ``async with ExecutorFleet(...) as fleet``."""

    def __init__(
        self,
        spec: FleetSpec | str | Iterable[str],
        *,
        resolver: Resolver | None = None,
        resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S,
        client_factory: ClientFactory | None = None,
    ) -> None:
        self.spec = spec if isinstance(spec, FleetSpec) else parse_fleet_spec(spec)
        if resolve_interval_s <= 0:
            raise ValueError("resolve_interval_s must be > 0")
        self.resolver: Resolver = resolver or SystemResolver()
        self.resolve_interval_s = resolve_interval_s
        self._client_factory = client_factory or (lambda a: AsyncExecutorClient(a, timeout_s=30))
        self._members: dict[str, Member] = {}
        self._dns_members: set[str] = set()
        self.generation = 0
        self._changed = asyncio.Event()
        self._resolver_task: asyncio.Task[None] | None = None
        self._closed = False
        self._started = False
        # Called with (member, old incarnation) when a member is lost.
        self.on_lost: list[Callable[[Member, int], None]] = []

    async def __aenter__(self) -> ExecutorFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Join the static members and resolve the DNS names (idempotent)."""
        if self._started:
            return
        self._started = True
        for address in self.spec.addresses:
            self.add(address)
        if self.spec.dns_names:
            await self.resolve_now()
            self._resolver_task = asyncio.ensure_future(self._resolve_loop())

    async def close(self) -> None:
        self._closed = True
        if self._resolver_task is not None:
            self._resolver_task.cancel()
        for address in list(self._members):
            await self.remove(address)

    # -- registry ---------------------------------------------------------------------------

    def add(self, address: str) -> Member:
        """Register an executor (idempotent); it joins once its health says SERVING."""
        _host_port(address, "executor address")
        if (member := self._members.get(address)) is not None:
            return member
        member = Member(address, self._client_factory(address))
        self._members[address] = member
        member.task = asyncio.ensure_future(self._keep(member))
        self._bump()
        return member

    async def remove(self, address: str) -> None:
        """Take an executor out of the fleet: its requests are treated as lost."""
        member = self._members.pop(address, None)
        if member is None:
            return
        member.removed = True
        self._dns_members.discard(address)
        if member.task is not None:
            member.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await member.task
        self._mark_lost(member)
        await member.client.close()
        self._bump()

    def get(self, address: str) -> Member:
        try:
            return self._members[address]
        except KeyError:
            raise KeyError(f"no executor {address!r} in the fleet") from None

    def names(self) -> list[str]:
        return list(self._members)

    def members(self) -> list[Member]:
        return list(self._members.values())

    def serving(self) -> list[Member]:
        return [m for m in self._members.values() if m.state is ExecutorState.SERVING]

    def metrics(self) -> dict[str, dict[str, object]]:
        """Per executor: state, instance id, incarnation, load and counters."""
        return {
            m.address: {
                "state": m.state.value,
                "instance_id": m.instance_id,
                "incarnation": m.incarnation,
                "running": m.running,
                "used_fraction": round(m.used_fraction, 4),
                **{k: getattr(m.counters, k) for k in m.counters.__slots__},
            }
            for m in self._members.values()
        }

    # -- changes ----------------------------------------------------------------------------

    def _bump(self) -> None:
        self.generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, since: int, timeout_s: float | None) -> bool:
        """Wait until the fleet changed after generation `since` (True) or the timeout (False)."""
        if self.generation != since:
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        return self.generation != since

    async def wait_serving(self, timeout_s: float) -> None:
        """Wait until at least one member is SERVING; TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while not self.serving():
                await self.wait_for_change(self.generation, None)

    async def wait_settled(self, timeout_s: float) -> bool:
        """Wait until no member is still making its first connection (each has joined or
        failed once), at most `timeout_s`; whether that happened in time."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while any(m.state is ExecutorState.CONNECTING for m in self._members.values()):
                    await self.wait_for_change(self.generation, None)
                return True
        return False

    def report_failure(self, member: Member, incarnation: int, error: BaseException) -> None:
        """A call to `member` failed in a way that means it is gone (or restarted)."""
        if member.incarnation == incarnation and member.state is not ExecutorState.LOST:
            self._mark_lost(member)
            if member.task is not None and not member.removed:
                member.task.cancel()  # the keeper restarts below
                member.task = asyncio.ensure_future(self._keep(member, reconnect=True))

    def report_draining(self, member: Member, incarnation: int) -> None:
        """`member` refused new work as draining (reason DRAINING) before its health said so:
        no new request goes there; what runs there stays."""
        if member.incarnation == incarnation and member.state is ExecutorState.SERVING:
            member.state = ExecutorState.DRAINING
            self._bump()

    def _mark_lost(self, member: Member) -> None:
        if member.state is ExecutorState.LOST:
            return
        was_joined = member.state in (ExecutorState.SERVING, ExecutorState.DRAINING)
        member.state = ExecutorState.LOST
        if was_joined:
            member.counters.lost += 1
            member.prefix_blocks.clear()
            for callback in self.on_lost:
                callback(member, member.incarnation)
        self._bump()

    # -- per member -------------------------------------------------------------------------

    async def _keep(self, member: Member, reconnect: bool = False) -> None:
        """Join, watch health and capacity, and on any failure reconnect with backoff."""
        delay = RECONNECT_MIN_S
        if reconnect:
            await asyncio.sleep(delay)
        while not member.removed and not self._closed:
            try:
                await self._join_and_watch(member)
            except asyncio.CancelledError:
                raise
            except (ExecutorError, OSError, StopAsyncIteration, RuntimeError):
                pass  # unreachable, refused, or a watch that ended: lost, then retried
            self._mark_lost(member)
            await asyncio.sleep(delay)
            delay = min(RECONNECT_MAX_S, delay * 2)

    async def _join_and_watch(self, member: Member) -> None:
        client = member.client
        info = await client.get_info()
        capabilities = (await client.get_capabilities()).capabilities
        # Both are async generators: closed below, which ends their calls.
        health = cast(AsyncGenerator[int, None], client.watch_health())
        capacity = cast(AsyncGenerator[pb.WatchCapacityResponse, None], client.watch_capacity())
        try:
            status = await anext(health)
            if status != SERVING_STATUS:
                # Warming up or draining: wait for SERVING on the same watch.
                async for status in health:
                    if status == SERVING_STATUS:
                        break
                else:
                    return
            first = await anext(capacity)
            member.instance_id = info.executor_instance_id
            member.capabilities = capabilities
            member.capacity = first
            member.block_size = int(capabilities.block_size) or int(first.kv.block_size)
            member.incarnation += 1
            member.prefix_blocks.clear()
            member.running = 0
            member.state = ExecutorState.SERVING
            member.counters.joined += 1
            self._bump()
            health_task = asyncio.ensure_future(self._follow_health(member, health))
            capacity_task = asyncio.ensure_future(self._follow_capacity(member, capacity))
            try:
                await asyncio.wait(
                    [health_task, capacity_task], return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                health_task.cancel()
                capacity_task.cancel()
                await asyncio.gather(health_task, capacity_task, return_exceptions=True)
        finally:
            await health.aclose()
            await capacity.aclose()

    async def _follow_health(self, member: Member, health: AsyncGenerator[int, None]) -> None:
        async for status in health:
            state = ExecutorState.SERVING if status == SERVING_STATUS else ExecutorState.DRAINING
            if member.state is not state:
                member.state = state
                self._bump()

    async def _follow_capacity(
        self, member: Member, capacity: AsyncGenerator[pb.WatchCapacityResponse, None]
    ) -> None:
        async for event in capacity:
            member.capacity = event
            member.counters.capacity_events += 1
            self._bump()

    # -- DNS --------------------------------------------------------------------------------

    async def resolve_now(self) -> None:
        """Resolve every DNS name once; add new addresses, remove the ones no longer answered.
        A failed resolution changes nothing (a DNS outage must not empty the fleet)."""
        found: list[str] = []
        for name, port in self.spec.dns_names:
            try:
                found.extend(await self.resolver.resolve(name, port))
            except (OSError, ValueError):
                return
        for address in found:
            if address not in self._members:
                self.add(address)
            self._dns_members.add(address)
        for address in list(self._dns_members):
            if address not in found and address not in self.spec.addresses:
                await self.remove(address)

    async def _resolve_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.resolve_interval_s)
            await self.resolve_now()


__all__ = [
    "DEFAULT_RESOLVE_INTERVAL_S",
    "ExecutorFleet",
    "ExecutorState",
    "FleetSpec",
    "Member",
    "MemberCounters",
    "Resolver",
    "SystemResolver",
    "parse_fleet_spec",
]

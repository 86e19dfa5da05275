"""A loopback TCP proxy for network faults: added latency, connection resets, half-open links.

Runs on the test's event loop; listens on 127.0.0.1:0 and forwards to one upstream port.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    def __init__(self, upstream_port: int, *, latency_s: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.latency_s = latency_s
        # When True, bytes are read and dropped: both ends stay connected but nothing arrives
        # (a half-open link, as behind a dead NAT entry).
        self.blackhole = False
        self.num_connections = 0
        self._server: asyncio.Server | None = None
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def target(self) -> str:
        assert self._server is not None
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        link = (writer, up_writer)
        self._links.add(link)
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
            self._tasks.discard(task)
        self._links.discard(link)
        for end in link:
            end.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                if self.blackhole:
                    continue
                writer.write(data)
                await writer.drain()

    def reset(self) -> int:
        """Abort every live connection (both sides see a reset); return how many."""
        links = list(self._links)
        for link in links:
            for end in link:
                end.transport.abort()
        self._links.clear()
        return len(links)

    async def close(self) -> None:
        self.reset()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()

"""A TCP relay that can cut its clients off: the reconnect workload's broken link.

    python -m bench.harness.cutter LISTEN=TARGET [LISTEN=TARGET ...]

Each ``LISTEN`` (``host:port``) accepts connections and relays each to its ``TARGET``
(``host:port``), counting the bytes that flow each way. Commands, one per line on standard
input, each answered by one line on standard output:

* ``cut``: close every relayed connection (both sides, at once) and stop listening, so a
  client's reconnects are refused, as when its link or its server is gone;
* ``heal``: listen again;
* ``bytes``: ``BYTES <to clients> <to targets> <connections accepted>``, totals so far;
* ``quit``.

It says ``READY`` once it listens. The counts are of payload bytes (what the clients'
sockets read and wrote), the same for every system measured through it.
"""
from __future__ import annotations

import asyncio
import sys


class Cutter:
    def __init__(self, routes: list[tuple[str, int, str, int]]):
        self.routes = routes
        self.servers: list[asyncio.Server] = []
        self.links: set[asyncio.StreamWriter] = set()
        self.to_clients = 0
        self.to_targets = 0
        self.accepted = 0

    async def listen(self) -> None:
        for host, port, thost, tport in self.routes:
            async def relay(reader, writer, thost=thost, tport=tport):
                await self._relay(reader, writer, thost, tport)
            self.servers.append(await asyncio.start_server(relay, host, port,
                                                           reuse_address=True))

    async def cut(self) -> None:
        servers, self.servers = self.servers, []
        for server in servers:
            server.close()
        for writer in list(self.links):
            transport = writer.transport
            transport.abort()  # a reset, not a polite close: the link is gone
        self.links.clear()
        for server in servers:
            await server.wait_closed()

    async def _relay(self, reader, writer, thost: str, tport: int) -> None:
        self.accepted += 1
        try:
            treader, twriter = await asyncio.open_connection(thost, tport)
        except OSError:
            writer.transport.abort()
            return
        self.links.update((writer, twriter))

        async def pump(src, dst, to_client: bool):
            try:
                while True:
                    data = await src.read(1 << 16)
                    if not data:
                        break
                    if to_client:
                        self.to_clients += len(data)
                    else:
                        self.to_targets += len(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:  # either side gone: the relayed connection is gone
                writer.transport.abort()
                twriter.transport.abort()

        await asyncio.gather(pump(treader, writer, True), pump(reader, twriter, False))
        self.links.discard(writer)
        self.links.discard(twriter)


def _route(text: str) -> tuple[str, int, str, int]:
    listen, _, target = text.partition("=")
    host, _, port = listen.rpartition(":")
    thost, _, tport = target.rpartition(":")
    return host, int(port), thost, int(tport)


async def main(routes: list[tuple[str, int, str, int]]) -> None:
    cutter = Cutter(routes)
    await cutter.listen()
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if line in ("", "quit"):
            break
        if line == "cut":
            await cutter.cut()
            print("CUT", flush=True)
        elif line == "heal":
            if not cutter.servers:
                await cutter.listen()
            print("HEALED", flush=True)
        elif line == "bytes":
            print(f"BYTES {cutter.to_clients} {cutter.to_targets} {cutter.accepted}",
                  flush=True)
        else:
            print(f"ERROR unknown command {line!r}", flush=True)
    await cutter.cut()


if __name__ == "__main__":
    asyncio.run(main([_route(a) for a in sys.argv[1:]]))

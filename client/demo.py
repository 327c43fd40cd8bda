"""``python -m clonemap.client.demo`` (``make run``): one real shard server and two clients.

Starts ``python -m clonemap.shards`` as a child process on a free port base (on loopback), waits
for its ``READY`` line, then:

* a *reader*, ``AsyncClone`` (asyncio) with a watch on ``/demo/``, prints every change;
* a *writer*, ``Clone`` (synchronous, its agent on a background thread), writes a few
  keys (msgpack values), one with a 1 s TTL, and deletes one;
* the reader waits (with deadlines) for each change, including the TTL expiry published
  by the server, and both clients' maps are compared at the end.

Exits 0 within a few seconds; 1 with a message if a step missed its deadline; 130 on
Ctrl-C. ``--hold`` keeps the server and both clients running after the last step (it
prints ``holding``, with the server's address for ``chp``) until Ctrl-C or SIGTERM. The server is ended by its PID on every path out (normal, exception, Ctrl-C,
SIGTERM), and on Linux it is also told to exit if this process dies (PDEATHSIG), so no
server is left behind.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import uvloop
from rich.console import Console
from rich.table import Table

from clonemap.client.api import AsyncClone, Clone
from clonemap.client.watch import SYNCED, Change
from clonemap.shards.common.children import LinePump, die_with_parent, terminate
from clonemap.shards.common.ports import ports_free

HOST = "127.0.0.1"
READY_TIMEOUT_S = 10.0
STEP_TIMEOUT_S = 5.0
TTL_S = 1.0
HEARTBEAT_S = 0.5

console = Console(highlight=False, soft_wrap=True)


class DemoFailed(Exception):
    pass


# ------------------------------------------------------------------ the server process
def _free_port_base(count: int = 3) -> int:
    """A base P with P..P+count-1 free now (bind-checked; a race is retried by the caller)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        if ports_free(HOST, base, count):
            return base
    raise DemoFailed("no free port range found")


class ServerProcess:
    """``python -m clonemap.shards`` as a child; ``stop()`` ends it by PID (TERM, then KILL)."""

    def __init__(self, port: int, log_file):
        self.port = port
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "clonemap.shards", "--port", str(port), "--host", HOST,
             "--heartbeat-s", str(HEARTBEAT_S), "--log-level", "warning"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=die_with_parent())
        self.pid = self.popen.pid
        self._stdout = LinePump(self.popen.stdout)

    def wait_ready(self, timeout_s: float) -> str | None:
        """The READY line; None if the process exited first. Raises on the deadline."""
        try:
            line = self._stdout.wait_for(lambda text: text.startswith("READY "), timeout_s)
        except TimeoutError:
            raise DemoFailed(f"shard server printed no READY within {timeout_s} s") from None
        if line is None:
            self.popen.wait(5)
        return line

    def stop(self, grace_s: float = 3.0) -> int | None:
        return terminate(self.popen, grace_s, kill_wait_s=grace_s)


def start_server(log_file, attempts: int = 3) -> ServerProcess:
    """Start a server on a free port base, retrying if the port was taken meanwhile."""
    for _ in range(attempts):
        server = ServerProcess(_free_port_base(), log_file)
        try:
            ready = server.wait_ready(READY_TIMEOUT_S)
        except BaseException:
            server.stop()
            raise
        if ready is not None:
            console.print(f"[bold green]server[/] {ready}")
            return server
        if server.popen.returncode != 3:  # 3: port in use; anything else is fatal
            raise DemoFailed(f"shard server exited with {server.popen.returncode}")
    raise DemoFailed(f"no free port for the shard server after {attempts} attempts")


# ------------------------------------------------------------------ the clients
def _show(change: Change) -> str:
    if change.kind == SYNCED:
        return f"[cyan]synced[/] (end of snapshot, seq {change.seq})"
    if change.kind == "delete":
        return f"[red]delete[/] {change.key} (seq {change.seq})"
    return f"[green]put[/]    {change.key} = {change.value!r} (seq {change.seq})"


async def run_clients(address: str, hold: bool = False) -> None:
    changes: asyncio.Queue[Change] = asyncio.Queue()

    async def expect(kind: str, key: str, what: str) -> Change:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while True:
            remaining = deadline - time.monotonic()
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a Ctrl-C
                # cancellation that lands just as the queue delivers
                async with asyncio.timeout(max(remaining, 0)):
                    change = await changes.get()
            except TimeoutError:
                raise DemoFailed(f"the reader saw no {kind} of {key} ({what}) "
                                 f"within {STEP_TIMEOUT_S} s") from None
            if change.kind == kind and change.key == key:
                return change

    async with AsyncClone(address, subtree="/demo/", codec="msgpack") as reader:
        console.print(f"[bold]reader[/] AsyncClone ACTIVE on {address} "
                      f"(subtree /demo/, {len(reader)} keys, seq {reader.version_vector})")

        async def watch() -> None:
            async with reader.watch("/demo/") as w:
                async for change in w:
                    console.print(f"  [bold]reader watch[/] {_show(change)}")
                    changes.put_nowait(change)

        watcher = asyncio.create_task(watch())
        await expect(SYNCED, "/demo/", "end of snapshot")

        writer = await asyncio.to_thread(Clone, address, subtree="/demo/", codec="msgpack")
        try:
            console.print(f"[bold]writer[/] Clone (sync) ACTIVE on {address}")
            steps = [
                ("set /demo/greeting = 'hello'", lambda: writer.set("/demo/greeting", "hello"),
                 "put", "/demo/greeting"),
                ("set /demo/config = {...}",
                 lambda: writer.set("/demo/config", {"shards": 1, "tags": ["a", "b"]}),
                 "put", "/demo/config"),
                (f"set /demo/session = 'token-42' with ttl={TTL_S:g} s",
                 lambda: writer.set("/demo/session", "token-42", ttl=TTL_S),
                 "put", "/demo/session"),
                ("delete /demo/greeting", lambda: writer.delete("/demo/greeting"),
                 "delete", "/demo/greeting"),
            ]
            set_at = {}
            for text, action, kind, key in steps:
                set_at[key] = time.monotonic()
                uuid = action()
                console.print(f"[bold]writer[/] {text}  [dim](KVSET uuid {uuid.hex()[:8]}...)[/]")
                await expect(kind, key, text)
            console.print("[bold]writer[/] waiting for the server to expire /demo/session")
            await expect("delete", "/demo/session", "TTL expiry")
            console.print(f"[bold]ttl expired[/] /demo/session removed by the server "
                          f"{time.monotonic() - set_at['/demo/session']:.2f} s after it "
                          f"was set (ttl {TTL_S:g} s)")

            deadline = time.monotonic() + STEP_TIMEOUT_S
            while writer.version_vector != reader.version_vector:
                if time.monotonic() > deadline:
                    raise DemoFailed(f"writer at {writer.version_vector}, reader at "
                                     f"{reader.version_vector}")
                await asyncio.sleep(0.02)
            mine, theirs = dict(reader.items()), dict(await asyncio.to_thread(writer.items))
            table = Table(title="both local maps")
            table.add_column("key")
            table.add_column("reader")
            table.add_column("writer")
            for key in sorted(mine.keys() | theirs.keys()):
                table.add_row(key, repr(mine.get(key)), repr(theirs.get(key)))
            console.print(table)
            if mine != theirs:
                raise DemoFailed(f"maps differ: reader {mine!r}, writer {theirs!r}")
            console.print(f"[bold green]maps converged[/] {len(mine)} key{'s' if len(mine) != 1 else ''} at "
                          f"seq {reader.version_vector['s0']}")
            if hold:
                console.print(f"[bold]holding[/]: server at {address}, both clients live; "
                              "Ctrl-C ends the demo")
                await asyncio.Event().wait()
        finally:
            await asyncio.to_thread(writer.close)
            watcher.cancel()
            try:
                await watcher
            except asyncio.CancelledError:
                pass


# ------------------------------------------------------------------ main
def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clonemap.client.demo",
                                 description="one shard server, an AsyncClone reader and a "
                                             "Clone writer, a few seconds")
    ap.add_argument("--hold", action="store_true",
                    help="keep the server and both clients running after the last step, "
                         "until Ctrl-C")
    hold = ap.parse_args(argv).hold
    # Ctrl-C works even when started with SIGINT ignored (e.g. as a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _on_sigterm)
    server = None
    with tempfile.TemporaryFile() as server_log:
        try:
            server = start_server(server_log)
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(run_clients(f"tcp://{HOST}:{server.port}", hold))
            console.print("[bold green]demo done[/]")
            return 0
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]")
            return 130
        except DemoFailed as exc:
            console.print(f"[bold red]demo failed:[/] {exc}")
            server_log.seek(0)
            tail = server_log.read().decode("utf-8", "replace").splitlines()[-20:]
            if tail:
                console.print("server log tail:\n" + "\n".join(tail), markup=False)
            return 1
        finally:
            if server is not None:
                code = server.stop()
                console.print(f"[bold]server[/] pid {server.pid} stopped (exit {code})")


if __name__ == "__main__":
    sys.exit(main())

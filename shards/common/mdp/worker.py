"""MDP/0.2 worker library (asyncio): one service, one DEALER to one broker.

    async def echo(request):                  # the handler contract: see shards.common.mdp
        await request.partial(b"working")     # any number of PARTIALs...
        return request.body                   # ...then the FINAL body

    async with MdpWorker("tcp://127.0.0.1:5555", "echo", echo, heartbeat_s=2.5):
        await stop_event.wait()

The conversation (spec 18/MDP v0.2, MDP/Worker):

* connect a fresh DEALER, send READY; requests then arrive as REQUEST, one at a time;
* the handler's PARTIALs and FINAL go back with the client address and an empty frame;
* HEARTBEAT every ``heartbeat_s`` unless something else was sent in that interval; every
  valid message from the broker counts as its heartbeat;
* a broker silent for ``liveness`` intervals, or a DISCONNECT from it, closes the socket
  (cancelling a running handler: the broker re-queues or has lost that request) and starts
  over on a fresh socket. The first reconnect is immediate (a restarted broker answers the
  old socket's HEARTBEAT with DISCONNECT), further ones back off from ``reconnect_s`` to
  ``reconnect_max_s`` until the broker is heard again;
* ``stop()`` sends DISCONNECT and closes.

Never blocks the loop: the socket is read in capped batches by ``clonemap.shards.common.zio.AsyncSocket``,
so a worker lives beside other sockets on one loop (the shard servers embed one). A plain
(non-async) handler is called inline and its FINAL sent at once (no task per request).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Callable

import zmq

from clonemap.shards.common.security import Security
from clonemap.shards.common.drops import DropCounter
from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.mdp import Handler, Request, as_body, error_body, run_handler
from clonemap.shards.common.mdp import codec as mdp
from clonemap.shards.common.timing import MDP_HEARTBEAT_S, MDP_LIVENESS
from clonemap.shards.common.mdp.codec import MDPW, W_DISCONNECT, W_FINAL, W_HEARTBEAT, W_PARTIAL, W_REQUEST
from clonemap.shards.common.zio import DEFAULT_BATCH, AsyncSocket, send_frames

log = logging.getLogger(__name__)

STOP_LINGER_MS = 100
"""How long the closing socket may keep trying to deliver ``stop()``'s DISCONNECT (a
broker that misses it keeps the worker until its heartbeats stop, ``liveness`` intervals)."""


class MdpWorker:
    def __init__(self, endpoint: str, service: str | bytes, handler: Handler, *,
                 ctx: zmq.Context | None = None, heartbeat_s: float = MDP_HEARTBEAT_S,
                 liveness: int = MDP_LIVENESS,
                 reconnect_s: float = 0.25, reconnect_max_s: float = 5.0,
                 batch: int = DEFAULT_BATCH, clock: Callable[[], float] = time.monotonic,
                 security: Security | None = None):
        self.endpoint = endpoint
        self.security = security or Security.off()
        self.service = service.encode() if isinstance(service, str) else service
        mdp.check_service(self.service, "READY")
        if heartbeat_s <= 0 or liveness < 1:
            raise ValueError("heartbeat_s must be > 0 and liveness >= 1")
        self.handler = handler
        self.ctx = ctx or zmq.Context.instance()
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.reconnect_s = reconnect_s
        self.reconnect_max_s = reconnect_max_s
        self.batch = batch
        self.clock = clock
        self.drops = DropCounter(log)
        self.counters = dict.fromkeys(
            ("connects", "requests", "partials", "finals", "handler_errors",
             "heartbeats_sent", "heartbeats_received", "disconnects_received",
             "broker_silent", "cancelled"), 0)
        self._inline = not inspect.iscoroutinefunction(handler)
        self._asock: AsyncSocket | None = None
        self._gen = 0
        self._busy = False
        self._task: asyncio.Task | None = None
        self._timer: asyncio.Task | None = None
        self._reconnect_handle: asyncio.TimerHandle | None = None
        self._failures = 0
        self._last_recv = 0.0
        self._last_sent = 0.0
        self._running = False
        self._reading = False  # inside the socket's read handler

    # ----------------------------------------------------------------- life cycle
    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._connect()
        self._timer = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    async def stop(self) -> None:
        """Send DISCONNECT, close the socket, cancel a running handler."""
        if not self._running:
            return
        self._running = False
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.gather(self._timer, return_exceptions=True)
            self._timer = None
        if self._asock is not None:
            self._send([MDPW, W_DISCONNECT])
        self._close_socket(linger_ms=STOP_LINGER_MS)
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def __aenter__(self) -> "MdpWorker":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def stats(self) -> dict:
        return {"service": self.service.decode("utf-8", "replace"), "endpoint": self.endpoint,
                "busy": self._busy, **self.counters, "drops": dict(self.drops.counts)}

    # ----------------------------------------------------------------- connection
    def _connect(self) -> None:
        self._reconnect_handle = None
        if not self._running:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        self.security.connect_side(sock)
        sock.connect(self.endpoint)
        self._gen += 1
        self._asock = AsyncSocket(sock, self._on_message, batch=self.batch,
                                  name=f"mdp-worker {self.service.decode(errors='replace')}")
        self.counters["connects"] += 1
        self._last_recv = self.clock()
        self._send(mdp.ready(self.service))

    def _close_socket(self, linger_ms: int = 0) -> None:
        self._gen += 1  # replies of a running handler now go nowhere
        if self._task is not None and not self._task.done():
            self.counters["cancelled"] += 1
            self._task.cancel()
        self._busy = False
        if self._asock is not None:
            self._asock.close(linger=linger_ms)
            self._asock = None

    def _reconnect(self, why: str) -> None:
        """Close this socket and start over on a fresh one (at once the first time)."""
        self._close_socket()
        if not self._running or self._reconnect_handle is not None:
            return
        self._failures += 1
        delay = 0.0 if self._failures == 1 else min(
            self.reconnect_max_s, self.reconnect_s * 2 ** (self._failures - 2))
        log.info("worker %r: %s; reconnecting to %s in %.2f s", self.service, why,
                 self.endpoint, delay)
        self._reconnect_handle = asyncio.get_running_loop().call_later(delay, self._connect)

    async def _heartbeat_loop(self) -> None:
        tick_s = self.heartbeat_s / 4
        silent_s = self.heartbeat_s * self.liveness
        while True:
            await asyncio.sleep(tick_s)
            if self._asock is None:
                continue
            now = self.clock()
            if now - self._last_recv > silent_s:
                self.counters["broker_silent"] += 1
                self._reconnect(f"broker silent for {silent_s:g} s")
            elif now - self._last_sent >= self.heartbeat_s:
                self.counters["heartbeats_sent"] += 1
                self._send([MDPW, W_HEARTBEAT])

    # ----------------------------------------------------------------- receiving
    def _on_message(self, frames: list[bytes]) -> None:
        self._reading = True
        try:
            self._on_command(frames)
        finally:
            self._reading = False

    def _on_command(self, frames: list[bytes]) -> None:
        try:
            msg = mdp.decode_worker(frames)
        except ProtocolError as exc:
            self.drops.drop(exc.reason, f"from broker {self.endpoint}: {exc}")
            return
        self._last_recv = self.clock()
        command = msg.command
        if command == W_REQUEST:
            self._failures = 0
            self._on_request(msg.client, list(msg.body))
        elif command == W_HEARTBEAT:
            self._failures = 0
            self.counters["heartbeats_received"] += 1
        elif command == W_DISCONNECT:
            self.counters["disconnects_received"] += 1
            self._reconnect("DISCONNECT from the broker")
        else:
            self.drops.drop("wrong_direction", f"from broker {self.endpoint}: MDPW02 "
                                               f"{mdp.WORKER_COMMANDS[command]}")

    def _on_request(self, client: bytes, body: list[bytes]) -> None:
        if self._busy:
            self.drops.drop("busy", f"REQUEST from {self.endpoint} while serving one")
            return
        self.counters["requests"] += 1
        gen = self._gen
        if self._inline:
            request = Request(self.service, body, client, self._partial_sender(gen, client))
            try:
                result = self.handler(request)
            except Exception as exc:
                self._handler_failed(exc)
                self._reply(gen, W_FINAL, client, error_body(exc))
                return
            if not inspect.isawaitable(result):
                self._reply(gen, W_FINAL, client, as_body(result))
                return
            awaitable = result
        else:
            awaitable = None
        self._busy = True
        self._task = asyncio.get_running_loop().create_task(
            self._serve(gen, client, body, awaitable))

    async def _serve(self, gen: int, client: bytes, body: list[bytes], awaitable) -> None:
        try:
            if awaitable is not None:
                final = as_body(await awaitable)
            else:
                request = Request(self.service, body, client, self._partial_sender(gen, client))
                final = await run_handler(self.handler, request)
        except asyncio.CancelledError:
            return
        except Exception as exc:
            self._handler_failed(exc)
            final = error_body(exc)
        if gen == self._gen:
            self._busy = False
            self._task = None
        self._reply(gen, W_FINAL, client, final)

    def _handler_failed(self, exc: Exception) -> None:
        self.counters["handler_errors"] += 1
        log.error("worker %r: handler failed", self.service, exc_info=exc)

    # ----------------------------------------------------------------- sending
    def _partial_sender(self, gen: int, client: bytes):
        async def send_partial(body: list[bytes]) -> None:
            frames = [MDPW, W_PARTIAL, client, b"", *body]
            while gen == self._gen and self._asock is not None:
                asock = self._asock
                try:
                    asock.send(frames)
                except zmq.Again:  # flow control: wait (bounded) for room, then retry
                    try:
                        await asock.wait_writable(self.heartbeat_s * self.liveness)
                    except Exception:
                        self.drops.drop("send_hwm", f"PARTIAL to {self.endpoint}: stuck at "
                                                    "the high-water mark")
                        return
                    continue
                self._last_sent = self.clock()
                self.counters["partials"] += 1
                await asyncio.sleep(0)  # let the loop breathe between PARTIALs
                return
            self.drops.drop("stale_reply", "the broker connection was replaced meanwhile")
        return send_partial

    def _reply(self, gen: int, command: bytes, client: bytes, body: list[bytes]) -> None:
        if gen != self._gen:
            self.drops.drop("stale_reply", "the broker connection was replaced meanwhile")
            return
        if self._send([MDPW, command, client, b"", *body]):
            self.counters["finals"] += 1
        else:  # the broker would think us busy for ever: start over instead
            self._reconnect("could not send a FINAL")

    def _send(self, frames: list[bytes]) -> bool:
        asock = self._asock
        if asock is None:
            return False
        try:
            if self._reading:  # the reader re-checks the socket after its batch
                send_frames(asock.sock, frames)
            else:
                asock.send(frames)
        except zmq.Again:
            self.drops.drop("send_hwm", f"to broker {self.endpoint}: at the high-water mark")
            return False
        self._last_sent = self.clock()
        return True

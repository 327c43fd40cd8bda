"""MDP/0.2 client library: ``MdpClient`` (asyncio) and ``SyncMdpClient`` (blocking).

    client = MdpClient("tcp://127.0.0.1:5555", timeout_s=2.5, retries=2)
    body = await client.request("echo", b"hello")            # the FINAL body (frames)
    async with client.stream("stats", b"s0") as replies:     # PARTIAL bodies, in order
        async for body in replies:
            ...
    replies.final                                            # the FINAL body
    await client.close()

    with SyncMdpClient("tcp://127.0.0.1:5555") as client:
        body = client.request("echo", b"hello")

MDP/Client is strictly synchronous: one request at a time per client (concurrent calls on
one ``MdpClient`` wait their turn); use several clients for requests in flight.

Deadlines and retries (the spec's recommended strategy): ``timeout_s`` is the longest
wait for the next reply message of an attempt (each PARTIAL restarts it). When it
passes, the socket is closed and the request re-sent on a FRESH socket, up to ``retries``
more times (``retries=0``: one attempt); then ``RequestTimeout`` (a ``clonemap.shards.common.errors.Timeout``,
so also a ``TimeoutError``) names the service, endpoint, deadline and attempts. A stream
that has already yielded a PARTIAL is not retried (that would repeat PARTIALs): it raises.
A stream abandoned before its FINAL also closes the socket, so a late reply can never be
taken for the answer to the next request.

A service no worker serves gets no answer at all: the broker queues the request and lets
it expire silently (spec 18/MDP), so it ends in ``RequestTimeout``. To tell "absent"
from "slow", ask first: ``request("mmi.service", b"name")`` answers ``[b"200"]`` or
``[b"404"]``.

Replies are checked: wrong header/command/frames (the codec), a service other than the
one asked, or a reply when nothing was asked are dropped and counted (``drops``). PARTIALs
wait in a bounded queue (``max_pending``); overflow raises ``SlowConsumer``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import zmq

from clonemap.shards.common.security import Security
from clonemap.shards.common.drops import DropCounter
from clonemap.shards.common.errors import HandshakeRefused, ProtocolError, SlowConsumer, Timeout
from clonemap.shards.common.handshake import FAILED_EVENTS, Refusals
from clonemap.shards.common.mdp import codec as mdp
from clonemap.shards.common.mdp.codec import C_FINAL, C_PARTIAL, C_REQUEST
from clonemap.shards.common.zio import AsyncSocket, close_monitored, recv_frames, send_frames

log = logging.getLogger(__name__)

MAX_PENDING = 10000


class RequestTimeout(Timeout):
    """No reply from the broker in time, after every attempt."""

    def __init__(self, service: bytes, endpoint: str, timeout_s: float, attempts: int,
                 partials: int = 0):
        name = service.decode("utf-8", "replace")
        more = f" after {partials} PARTIAL(s)" if partials else ""
        super().__init__(f"MDP request to service {name!r} at {endpoint}: no reply within "
                         f"{timeout_s:g} s{more} ({attempts} attempt(s), each on a fresh "
                         "socket)", what=f"mdp service {name}", deadline_s=timeout_s)
        self.service = name
        self.endpoint = endpoint
        self.attempts = attempts
        self.partials = partials


def _name(service: str | bytes) -> bytes:
    name = service.encode() if isinstance(service, str) else service
    return mdp.check_service(name, "REQUEST")


def _classify(frames: list[bytes], service: bytes | None, drops: DropCounter,
              endpoint: str) -> tuple[bytes, list[bytes]] | None:
    """Decode one reply; ``(command, body)`` if it answers the current request."""
    try:
        msg = mdp.decode_client(frames)
    except ProtocolError as exc:
        drops.drop(exc.reason, f"from {endpoint}: {exc}")
        return None
    if msg.command == C_REQUEST:
        drops.drop("wrong_direction", f"from {endpoint}: a REQUEST")
        return None
    if service is None:
        drops.drop("unexpected_reply", f"from {endpoint}: {msg.service!r} reply, no request")
        return None
    if msg.service != service:
        drops.drop("wrong_service", f"from {endpoint}: reply for {msg.service!r} while "
                                    f"waiting for {service!r}")
        return None
    return msg.command, msg.body


class _Silence(Exception):
    pass


# ===================================================================== asyncio client

class MdpClient:
    def __init__(self, endpoint: str, *, ctx: zmq.Context | None = None,
                 timeout_s: float = 2.5, retries: int = 2, max_pending: int = MAX_PENDING,
                 security: Security | None = None):
        self.endpoint = endpoint
        self.security = security or Security.off()
        self.ctx = ctx or zmq.Context.instance()
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_pending = max_pending
        self.drops = DropCounter(log)
        self.counters = dict.fromkeys(("requests", "attempts", "sockets", "partials",
                                       "finals", "timeouts", "unqueued", "patient_waits"), 0)
        self._asock: AsyncSocket | None = None
        self._monitor: AsyncSocket | None = None
        self._refused = ""
        """Why the broker refused the security handshake (``errors.HANDSHAKE_CAUSES``):
        the request fails at once with ``HandshakeRefused`` instead of timing out."""
        self.busy = asyncio.Lock()
        self._service: bytes | None = None  # the service of the request in flight
        self._inbox: deque[tuple[bytes, list[bytes]]] = deque()
        self._overflow = 0
        self._waiter: asyncio.Future | None = None

    # ----------------------------------------------------------------- public
    async def request(self, service: str | bytes, *body: bytes, timeout_s: float | None = None,
                      retries: int | None = None, patient=None) -> list[bytes]:
        """Send a REQUEST and return the FINAL body (PARTIALs are skipped). ``patient()``:
        asked when ``timeout_s`` passes without a reply; True waits that long again for
        the same attempt (its worker is known to be alive and slow: a server starved at
        background priority), neither closing the socket nor sending again."""
        name = _name(service)
        async with self.busy:
            return await self.exchange(name, body, timeout_s, retries, stream=None,
                                       patient=patient)

    def stream(self, service: str | bytes, *body: bytes, timeout_s: float | None = None,
               retries: int | None = None) -> "Stream":
        """An async iterator of PARTIAL bodies; ``.final`` holds the FINAL body at the end."""
        return Stream(self, _name(service), body, timeout_s, retries)

    def stats(self) -> dict:
        return {"endpoint": self.endpoint, **self.counters, "drops": dict(self.drops.counts)}

    async def close(self) -> None:
        self.reset()

    async def __aenter__(self) -> "MdpClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ----------------------------------------------------------------- internals
    async def exchange(self, name: bytes, body, timeout_s, retries, stream,
                       patient=None) -> list[bytes]:
        """One request's dialogue, retries included, under ``busy`` (``request`` and a
        ``Stream`` call it); PARTIAL bodies go to ``stream``; the FINAL body.
        ``patient``: ``request``'s."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        retries = self.retries if retries is None else retries
        frames = mdp.client_request(name, *body)
        self.counters["requests"] += 1
        attempts = 0
        done = False
        try:
            while True:
                attempts += 1
                self.send_frames_now(name, frames)
                try:
                    while True:
                        try:
                            command, reply = await self.next_reply(timeout_s)
                        except _Silence:
                            if patient is None or not patient():
                                raise
                            self.counters["patient_waits"] += 1
                            continue
                        if command == C_FINAL:
                            self.counters["finals"] += 1
                            done = True
                            return reply
                        self.counters["partials"] += 1
                        if stream is not None:
                            await stream.put(reply)
                except _Silence:
                    self.counters["timeouts"] += 1
                    self.reset()  # the spec: close it, re-send on a fresh socket
                    partials = stream.received if stream is not None else 0
                    if attempts > retries or partials:
                        raise RequestTimeout(name, self.endpoint, timeout_s, attempts,
                                             partials) from None
        finally:
            self._service = None
            self._inbox.clear()
            if not done:  # cancelled or failed: a late reply must not answer the next one
                self.reset()

    def send_frames_now(self, name: bytes, frames: list[bytes]) -> None:
        """One attempt of a request (a socket is made if there is none)."""
        if self._asock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0
            self.security.connect_side(sock)
            # the monitor before the connect: libzmq does not reconnect after a failed
            # handshake, so a refusal it reports before the monitor is attached is never
            # seen, and the request waits out its deadline (seen in a clean clone: a
            # plain chp told "requires CURVE" after 30 s, its first attempt's timeout)
            self._refusals = Refusals(self.security.curve)
            self._monitor = AsyncSocket(sock.get_monitor_socket(FAILED_EVENTS),
                                        self._on_monitor,
                                        name=f"mdp-client monitor {self.endpoint}")
            sock.connect(self.endpoint)
            self._asock = AsyncSocket(sock, self._on_message, name=f"mdp-client {self.endpoint}")
            self.counters["sockets"] += 1
        self._service = name
        self._inbox.clear()
        self._overflow = 0
        self.counters["attempts"] += 1
        try:
            self._asock.send(frames)
        except zmq.Again:
            # no pipe to queue on: a handshake refused before this send ends the
            # connection for good (libzmq does not reconnect after one). Not a drop: the
            # monitor's refusal answers it (or the deadline, then a fresh socket).
            self.counters["unqueued"] += 1

    def _on_message(self, frames: list[bytes]) -> None:
        got = _classify(frames, self._service, self.drops, self.endpoint)
        if got is None:
            return
        if len(self._inbox) >= self.max_pending:
            self._overflow += 1
        else:
            self._inbox.append(got)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_monitor(self, frames: list[bytes]) -> None:
        cause = self._refusals.cause(frames)
        if cause is None:
            return
        self._refused = cause
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_reply(self, timeout_s: float) -> tuple[bytes, list[bytes]]:
        """The next PARTIAL/FINAL for the request in flight, ``(command, body)``."""
        if self._refused:
            raise HandshakeRefused(self.endpoint, self._refused)
        if self._overflow:
            raise SlowConsumer(f"MDP client {self.endpoint}: {self._overflow} PARTIAL(s) "
                               "dropped, the consumer is too slow", dropped=self._overflow)
        if self._inbox:
            return self._inbox.popleft()
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        handle = loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            handle.cancel()
            self._waiter = None
        if not self._inbox and not self._refused:
            raise _Silence()
        return await self.next_reply(timeout_s)

    def reset(self) -> None:
        """Close the socket: a late reply must not answer the next request."""
        self._refused = ""
        close_monitored(self._asock, self._monitor)
        self._asock = self._monitor = None


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Stream:
    """PARTIAL bodies of one request, then ``final``. Use ``async with`` (or iterate to
    the end) so the client is released; an unfinished stream closes the client's socket."""

    def __init__(self, client: MdpClient, service: bytes, body, timeout_s, retries):
        self.client = client
        self.service = service
        self.body = body
        self.timeout_s = timeout_s
        self.retries = retries
        self.final: list[bytes] | None = None
        self.yielded = 0
        self.received = 0
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    async def put(self, body: list[bytes]) -> None:
        """A PARTIAL body for the reader (waits while it holds the last one)."""
        self.received += 1
        await self._queue.put(body)

    async def _run(self) -> None:
        async with self.client.busy:
            self.final = await self.client.exchange(self.service, self.body, self.timeout_s,
                                                     self.retries, stream=self)

    def __aiter__(self) -> "Stream":
        return self

    async def __anext__(self) -> list[bytes]:
        if self._task is None:
            self._queue = asyncio.Queue(maxsize=1)
            self._task = asyncio.get_running_loop().create_task(self._run())
        getter = asyncio.ensure_future(self._queue.get())
        await asyncio.wait([getter, self._task], return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            self.yielded += 1
            return getter.result()
        getter.cancel()
        if not self._queue.empty():
            self.yielded += 1
            return self._queue.get_nowait()
        self._task.result()  # raises RequestTimeout / SlowConsumer
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self.client.reset()  # a late PARTIAL/FINAL must not answer the next request

    async def __aenter__(self) -> "Stream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __del__(self) -> None:  # abandoned unfinished: free the client
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            self.client.reset()


# ===================================================================== blocking client

class SyncMdpClient:
    """The same dialogue over a blocking socket (``zmq.Socket.poll`` for deadlines)."""

    def __init__(self, endpoint: str, *, ctx: zmq.Context | None = None,
                 timeout_s: float = 2.5, retries: int = 2, security: Security | None = None):
        self.endpoint = endpoint
        self.security = security or Security.off()
        self.ctx = ctx or zmq.Context.instance()
        self.timeout_s = timeout_s
        self.retries = retries
        self.drops = DropCounter(log)
        self.counters = dict.fromkeys(("requests", "attempts", "sockets", "partials",
                                       "finals", "timeouts", "unqueued"), 0)
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None

    def request(self, service: str | bytes, *body: bytes, timeout_s: float | None = None,
                retries: int | None = None) -> list[bytes]:
        """Send a REQUEST and return the FINAL body (PARTIALs are skipped)."""
        with self.stream(service, *body, timeout_s=timeout_s, retries=retries) as stream:
            for _ in stream:
                pass
        return stream.final

    def stream(self, service: str | bytes, *body: bytes, timeout_s: float | None = None,
               retries: int | None = None) -> "SyncStream":
        return SyncStream(self, _name(service), body,
                          self.timeout_s if timeout_s is None else timeout_s,
                          self.retries if retries is None else retries)

    def stats(self) -> dict:
        return {"endpoint": self.endpoint, **self.counters, "drops": dict(self.drops.counts)}

    def close(self) -> None:
        if self._sock is not None:
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> "SyncMdpClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> zmq.Socket:
        """The DEALER the next attempt sends on, made and connected if there is none (a
        timeout or ``close`` ends it)."""
        if self._sock is None:
            self._sock = self.ctx.socket(zmq.DEALER)
            self._sock.linger = 0
            self.security.connect_side(self._sock)
            self._monitor = self._sock.get_monitor_socket(FAILED_EVENTS)
            self._refusals = Refusals(self.security.curve)
            self._sock.connect(self.endpoint)
            self.counters["sockets"] += 1
        return self._sock

    def send_frames_now(self, frames: list[bytes]) -> None:
        """One attempt of a request (a socket is made if there is none)."""
        self.open()
        self.counters["attempts"] += 1
        try:
            send_frames(self._sock, frames)
        except zmq.Again:
            # no pipe to queue on: a handshake refused before this send ends the
            # connection for good (libzmq does not reconnect after one). Not a drop:
            # ``next_reply`` reports the refusal, which the monitor already holds.
            self.counters["unqueued"] += 1

    def next_reply(self, service: bytes, timeout_s: float) -> tuple[bytes, list[bytes]]:
        """The next PARTIAL/FINAL for ``service``, ``(command, body)``; raises on silence
        for ``timeout_s`` or a refused handshake."""
        deadline = time.monotonic() + timeout_s
        sock, monitor = self._sock, self._monitor
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            remaining_ms = (deadline - time.monotonic()) * 1000
            ready = dict(poller.poll(max(1, int(remaining_ms) + 1))) if remaining_ms > 0 \
                else {}
            if monitor in ready:
                cause = self._refusals.cause(monitor.recv_multipart())
                if cause is not None:
                    raise HandshakeRefused(self.endpoint, cause)
            if sock not in ready:
                if time.monotonic() >= deadline:
                    raise _Silence()
                continue
            while True:
                try:
                    frames = recv_frames(sock)
                except zmq.Again:
                    break
                got = _classify(frames, service, self.drops, self.endpoint)
                if got is not None:
                    return got


class SyncStream:
    """Iterator of PARTIAL bodies; ``final`` is the FINAL body once iteration ends."""

    def __init__(self, client: SyncMdpClient, service: bytes, body, timeout_s: float,
                 retries: int):
        self.client = client
        self.service = service
        self.timeout_s = timeout_s
        self.retries = retries
        self.final: list[bytes] | None = None
        self.yielded = 0
        self._frames = mdp.client_request(service, *body)
        self._attempts = 0
        self._done = False

    def __iter__(self) -> "SyncStream":
        return self

    def __next__(self) -> list[bytes]:
        client = self.client
        if self._done:
            raise StopIteration
        if self._attempts == 0:
            client.counters["requests"] += 1
            self._attempt()
        while True:
            try:
                command, body = client.next_reply(self.service, self.timeout_s)
            except _Silence:
                client.counters["timeouts"] += 1
                client.close()  # the spec: close it, re-send on a fresh socket
                if self._attempts > self.retries or self.yielded:
                    self._done = True
                    raise RequestTimeout(self.service, client.endpoint, self.timeout_s,
                                         self._attempts, self.yielded) from None
                self._attempt()
                continue
            if command == C_PARTIAL:
                client.counters["partials"] += 1
                self.yielded += 1
                return body
            client.counters["finals"] += 1
            self.final = body
            self._done = True
            raise StopIteration

    def _attempt(self) -> None:
        self._attempts += 1
        self.client.send_frames_now(self._frames)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self.client.close()  # a late reply must not answer the next request

    def __enter__(self) -> "SyncStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""The MDP/0.2 broker's I/O shell: one ROUTER for both sub-protocols, a heartbeat timer,
broker-hosted services, ``stats()``. The bookkeeping is ``clonemap.shards.common.mdp.broker_core``.

Embeddable: ``Broker`` runs inside any asyncio program (the supervisor hosts it on its
control endpoint)::

    broker = Broker(["tcp://127.0.0.1:5555"], BrokerConfig(heartbeat_s=1.0))
    broker.register("cluster.map", cluster_map_handler)   # see shards.common.mdp for handlers
    await broker.start()
    ...
    await broker.stop()

Runnable alone: ``python -m clonemap.supervisor broker --bind tcp://127.0.0.1:5555``.

The ROUTER is read in capped batches (``clonemap.shards.common.zio.AsyncSocket``); messages are told apart
by their header frame (MDPC02 / MDPW02). The forwarding path sends with
``clonemap.shards.common.zio.send_frames`` from inside the read handler (the reader re-checks the socket
after each batch, so the edge-triggered FD is never missed). The ROUTER is
``ROUTER_MANDATORY``: a reply to a vanished peer is counted (``unroutable``), not lost
silently. The broker hosts ``mmi.stats`` itself: FINAL with ``stats()`` as JSON.

``stats()`` (and ``mmi.stats``): ``counters`` from the core (requests, dispatched,
partials, finals, queued, requeued, mmi, internal_calls, workers_registered /
_expired / _disconnected / _invalid, heartbeats_sent, disconnects_sent and one
``disconnect.<reason>`` per reason: duplicate_ready, unexpected_reply, unknown_worker,
reserved_service, too_many_workers, too_many_services), ``workers``, ``queued``,
``services`` {name: {workers, idle, queued}}, ``internal`` (hosted services),
``drops`` {reason: count} (the codec's faults: bad_header, leading_empty_frame,
bad_command, frame_count, bad_service, bad_address, missing_delimiter, oversize_body;
and wrong_direction, queue_full, too_many_services, request_expired, unroutable,
internal_busy), ``unroutable``, ``internal_errors``, ``handler_errors``, ``received``,
``internal_running``, ``endpoints``, ``uptime_s``. Drops are logged at most once per
reason per 5 s (``clonemap.shards.common.drops.DropCounter``); worker arrivals and departures at most once
per kind per second.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
from typing import Callable, Sequence

import zmq

from clonemap.shards.common import mdp as mdplib
from clonemap.shards.common.drops import DropCounter, RateLimiter
from clonemap.shards.common.errors import ConfigError, PortInUse
from clonemap.shards.common.mdp.codec import C_FINAL, C_PARTIAL, MDPC, check_service
from clonemap.shards.common.security import Authenticator, Security
from clonemap.shards.common.zio import DEFAULT_BATCH, AsyncSocket, recv_frames_with_user, send_frames
from clonemap.shards.common.mdp.broker_config import BrokerConfig
from clonemap.shards.common.mdp.broker_core import BrokerCore, Drop, InternalCall, Note

log = logging.getLogger(__name__)

MAX_INTERNAL_CALLS = 64
"""Broker-hosted requests running at once; more are dropped (``internal_busy``)."""
STOP_LINGER_MS = 200
"""How long ``stop()`` lets its DISCONNECTs to the workers drain before closing."""


class _Notes:
    """Lifecycle notes (workers arriving, leaving): at most one INFO line per event kind
    per ``interval_s`` (``RateLimiter``)."""

    def __init__(self, interval_s: float = 1.0):
        self._limiter = RateLimiter(interval_s)

    def note(self, event: str, detail: str, now: float) -> None:
        n = self._limiter.allow(event, now)
        if n is not None:
            log.info("%s%s", detail, f" (+{n} more {event} since)" if n else "")


class Broker:
    def __init__(self, bind: str | Sequence[str], config: BrokerConfig | None = None, *,
                 ctx: zmq.Context | None = None, batch: int = DEFAULT_BATCH,
                 clock: Callable[[], float] = time.monotonic,
                 security: Security | None = None):
        self.binds = [bind] if isinstance(bind, str) else list(bind)
        self.security = security or Security.off()
        self._auth: Authenticator | None = None
        self.config = config or BrokerConfig()
        self.core = BrokerCore(self.config)
        self.batch = batch
        self.clock = clock
        self._own_ctx = ctx is None
        self.ctx = ctx
        self.endpoints: list[str] = []
        self.drops = DropCounter(log)
        self.handlers: dict[bytes, mdplib.Handler] = {}
        self.counters = {"unroutable": 0, "internal_errors": 0}
        self._notes = _Notes()
        self._asock: AsyncSocket | None = None
        self._sock: zmq.Socket | None = None
        self._tick_task: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()
        self._started_at = 0.0
        self.register("mmi.stats", self._mmi_stats)

    # ----------------------------------------------------------------- services
    def register(self, service: str | bytes, handler: mdplib.Handler) -> None:
        """Host ``service`` in the broker: requests to it run ``handler`` (the contract in
        ``clonemap.shards.common.mdp``), whose PARTIALs and FINAL go straight back to the client."""
        name = service.encode() if isinstance(service, str) else service
        check_service(name, "REQUEST", self.config.limits)
        self.handlers[name] = handler
        self.core.add_internal(name)

    def unregister(self, service: str | bytes) -> None:
        name = service.encode() if isinstance(service, str) else service
        self.handlers.pop(name, None)
        self.core.remove_internal(name)

    def admit_identities(self, names: frozenset[str]) -> set[str]:
        """Admit exactly these named identities from now on (``Authenticator.
        admit_identities``); the names no longer admitted."""
        return self._auth.admit_identities(names) if self._auth is not None else set()

    # ----------------------------------------------------------------- life cycle
    async def start(self) -> None:
        """Bind every endpoint (``PortInUse`` / ``ConfigError`` on failure) and serve."""
        if self.ctx is None:
            self.ctx = zmq.Context()
        self._auth = Authenticator(self.ctx, self.security)
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.router_mandatory = 1
        sock.maxmsgsize = self.config.limits.max_body_bytes
        self.security.bind_side(sock)
        try:
            for endpoint in self.binds:
                try:
                    sock.bind(endpoint)
                except zmq.ZMQError as exc:
                    if exc.errno == errno.EADDRINUSE:
                        raise PortInUse(f"cannot bind {endpoint}: address already in use",
                                        endpoint=endpoint) from None
                    raise ConfigError(f"cannot bind {endpoint}: {exc.strerror}",
                                      field="bind") from None
                self.endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except Exception:
            sock.close(0)
            self._auth.stop()
            self._auth = None
            if self._own_ctx:
                self.ctx.term()
                self.ctx = None
            raise
        self._sock = sock
        self._asock = AsyncSocket(sock, self._on_message, batch=self.batch, name="broker",
                                  recv=recv_frames_with_user if self.security.curve else None)
        self._started_at = self.clock()
        self._tick_task = asyncio.get_running_loop().create_task(self._ticker())
        log.info("MDP/0.2 broker bound to %s (heartbeat %g s, liveness %d, expiry %g s)",
                 ", ".join(self.endpoints), self.config.heartbeat_s, self.config.liveness,
                 self.config.request_expiry_s)

    async def stop(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
            await asyncio.gather(self._tick_task, return_exceptions=True)
            self._tick_task = None
        for task in list(self._calls):
            task.cancel()
        if self._calls:
            await asyncio.gather(*self._calls, return_exceptions=True)
        if self._asock is not None:
            self._perform(self.core.on_stop())
            self._asock.close(linger=STOP_LINGER_MS)
            self._asock = None
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx and self.ctx is not None:
            self.ctx.term()
            self.ctx = None

    async def __aenter__(self) -> "Broker":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ----------------------------------------------------------------- hot path
    def _on_message(self, frames: list[bytes]) -> None:
        effects = self.core.on_message(frames, self.clock())
        if effects:
            sock = self._sock
            for effect in effects:
                match effect:
                    case list():  # frames to send (the common case)
                        try:
                            send_frames(sock, effect)
                        except zmq.ZMQError:
                            self._unroutable(effect)
                    case _:
                        self._effect(effect)

    def _perform(self, effects: list) -> None:
        """Effects produced outside the read handler: send through AsyncSocket.send,
        which re-checks the edge-triggered FD afterwards."""
        for effect in effects:
            match effect:
                case list():
                    self._send(effect)
                case _:
                    self._effect(effect)

    def _send(self, frames: list[bytes]) -> None:
        if self._asock is None:
            return
        try:
            self._asock.send(frames)
        except zmq.ZMQError:
            self._unroutable(frames)

    def _unroutable(self, frames: list[bytes]) -> None:
        self.counters["unroutable"] += 1
        self.drops.drop("unroutable", f"peer {frames[0].hex()} is gone or at its high-water "
                                      "mark")

    def _effect(self, effect) -> None:
        match effect:
            case Drop(reason=reason, detail=detail):
                self.drops.drop(reason, detail)
            case Note(event=event, detail=detail):
                self._notes.note(event, detail, self.clock())
            case InternalCall():
                self._start_call(effect)
            case _:
                raise TypeError(f"not a broker effect: {effect!r}")

    # ----------------------------------------------------------------- timer
    async def _ticker(self) -> None:
        tick_s = max(0.005, min(self.config.heartbeat_s, self.config.request_expiry_s) / 4)
        while True:
            await asyncio.sleep(tick_s)
            try:
                self._perform(self.core.on_tick(self.clock()))
            except Exception:  # a bug here must not stop heartbeats for good
                log.exception("broker tick failed")

    # ----------------------------------------------------------------- hosted services
    def _start_call(self, call: InternalCall) -> None:
        if len(self._calls) >= MAX_INTERNAL_CALLS:
            self.drops.drop("internal_busy", f"request for {call.service!r} from "
                                             f"{call.client.hex()}: {len(self._calls)} running")
            return
        task = asyncio.get_running_loop().create_task(self._run_call(call))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _run_call(self, call: InternalCall) -> None:
        client, service = call.client, call.service

        async def send_partial(body: list[bytes]) -> None:
            self._send([client, MDPC, C_PARTIAL, service, *body])

        request = mdplib.Request(service, call.body, client, send_partial, call.user_id)
        handler = self.handlers.get(service)
        try:
            if handler is None:
                raise LookupError(f"service {service!r} is not hosted here any more")
            body = await mdplib.run_handler(handler, request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.counters["internal_errors"] += 1
            log.exception("broker-hosted service %r failed", service)
            body = mdplib.error_body(exc)
        self._send([client, MDPC, C_FINAL, service, *body])

    def _mmi_stats(self, request: mdplib.Request) -> bytes:
        return json.dumps(self.stats(), sort_keys=True).encode()

    # ----------------------------------------------------------------- reporting
    def stats(self) -> dict:
        snap = self.core.snapshot()
        snap.update({
            "endpoints": list(self.endpoints),
            "uptime_s": round(self.clock() - self._started_at, 3) if self._started_at else 0.0,
            "received": self._asock.received if self._asock else 0,
            "handler_errors": self._asock.errors if self._asock else 0,
            "drops": dict(self.drops.counts),
            "internal_running": len(self._calls),
            **self.counters,
        })
        return snap

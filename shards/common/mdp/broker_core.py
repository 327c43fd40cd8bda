"""The MDP/0.2 broker's bookkeeping as a pure core: no sockets, no clock, no logging.

The I/O shell (``shards/common/mdp/broker.py``) feeds it every message read from its ROUTER
(``on_message(frames, now)``, ``frames[0]`` is the peer identity) and a periodic
``on_tick(now)``; both return a list of effects for the shell to perform:

* ``list[bytes]``  send these frames on the ROUTER (``frames[0]`` is the peer identity);
* ``InternalCall`` run a service the broker hosts itself (see ``add_internal``);
* ``Drop``         a message or request was dropped: count and log it (DropCounter);
* ``Note``         a rare lifecycle event worth a log line (worker came, went...).

Rules (spec 18/MDP v0.2; where it is open, the choice is marked *):

* One queue per service. A request to a service with no idle worker is queued (bounded:
  ``max_queued`` per service, overflow dropped ``queue_full``). A queued request expires
  once ``request_expiry_s`` has passed while its service has no worker at all (the spec's
  case: nobody registered it); the client is told nothing (``request_expired`` drop).
  *Requests waiting behind busy workers do not expire: slow services are not cut short.
  *The expiry clock restarts when a service loses its last worker (its queued requests
  get ``request_expiry_s`` from that moment), so a request that waited behind busy
  workers is not dropped at once when they vanish.
* Idle workers are served least-recently-used: a worker that finishes joins the back of
  its service's idle list; a request goes to the front one.
* A worker PARTIAL/FINAL is relayed to its client as MDPC02 PARTIAL/FINAL with the
  service name. A FINAL ends the request; the worker then takes the next queued request.
* Heartbeats: every message from a worker except DISCONNECT refreshes its expiry
  (``liveness`` x ``heartbeat_s``). On a tick, a worker the broker has sent nothing to
  for ``heartbeat_s`` gets a HEARTBEAT (the spec asks not to heartbeat beside other
  traffic), and a worker past its expiry is gone: forgotten silently (the spec: stop
  sending it anything) and its in-flight request re-queued at the front of the queue
  for another worker (workers are idempotent) with a fresh expiry. *A re-queued request
  starts over: the client may see PARTIALs again.
* Valid but unexpected worker commands get DISCONNECT and the worker is forgotten: a
  second READY, a PARTIAL/FINAL with no request in flight or for another client, any
  command but READY/DISCONNECT from an unknown peer (this is how workers of a restarted
  broker learn to re-register), *a READY for a service the broker hosts itself (mmi.*
  or internal), *a READY beyond ``max_workers``/``max_services``.
* Invalid messages (the codec's ProtocolError) are dropped and counted; if the sender
  was a worker it is forgotten, silently (its request re-queued). *Commands that exist
  but never travel towards a broker (MDPC02 PARTIAL/FINAL, MDPW02 REQUEST) count as
  invalid. *The broker keeps no client state, so an invalid client costs nothing more.
* A DISCONNECT from a worker: forgotten, nothing sent back; from an unknown peer: ignored.
* MMI (``mmi.*``, answered by the core itself): ``mmi.service`` with the service name as
  body answers FINAL "200" if that service has a worker or is hosted by the broker, else
  "404". Any other mmi.* service not registered with ``add_internal`` answers "501".

Open points of the spec, and what this broker decided (the list the README repeats):

* Sockets: ONE ROUTER carries both sub-protocols (the spec allows one or two); commands
  are told apart by their header frame (MDPC02 / MDPW02). It may bind several endpoints.
* Distribution: least-recently-used idle worker (the spec allows any, LRU or round robin).
  Fairness between clients: one FIFO queue per service; the ROUTER fair-queues its
  inputs and the shell reads them in capped batches.
* An unknown service (no worker ever registered): the request is queued like any other
  and expires silently after ``request_expiry_s``; the client learns it only from its
  own deadline (``clonemap.shards.common.mdp.client.RequestTimeout``). A client may ask first with
  ``mmi.service`` (FINAL "404"). Nothing else is ever sent for it: MDP/Client has no
  error command, and inventing a reply body would be indistinguishable from a worker's.
* Expiry: only while the service has no worker (see above); bounded queues
  (``max_queued``), overflow counted (``queue_full``), never answered.
* Heartbeat interval and liveness are configuration (defaults 2.5 s x 3; the spec says
  3-5 intervals). The spec's own known weakness applies: broker and workers must be
  configured alike, or healthy peers are declared dead.
* Liveness bookkeeping is per worker only: clients hold no state in the broker (the
  spec's client dialogue has no heartbeat); a reply to a client that has gone is counted
  (``unroutable``, the ROUTER is ROUTER_MANDATORY) and dropped.
* A client's retry on a fresh socket is a new request to the broker (it cannot tell
  them apart): both may be served, the reply to the abandoned socket is unroutable and
  counted. MDP's workers are idempotent (spec), so this is safe.
* Workers re-register after a broker restart because the new broker answers their
  HEARTBEAT/PARTIAL/FINAL (unknown peer) with DISCONNECT; a worker DISCONNECT from an
  unknown peer, including before READY (which the spec allows), is ignored.
* Services hosted by the broker itself (the spec allows it): ``add_internal``; ``mmi.*``
  is reserved for the broker; a worker READY for a reserved name gets DISCONNECT.
* MMI is not part of 18/MDP; ``mmi.service`` follows 8/MMI's status codes.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, NamedTuple, Sequence

from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.mdp import codec as mdp
from clonemap.shards.common.mdp.broker_config import BrokerConfig
from clonemap.shards.common.mdp.codec import (C_FINAL, C_PARTIAL, C_REQUEST, MDPC, MDPW, W_DISCONNECT,
                              W_FINAL, W_HEARTBEAT, W_PARTIAL, W_READY, W_REQUEST)

MMI_PREFIX = b"mmi."


class InternalCall(NamedTuple):
    """Run the broker-hosted service ``service`` for ``client`` (shell's job);
    ``user_id``: the name the ZAP handler gave the client's connection (None without
    CURVE), which the service may check."""

    client: bytes
    service: bytes
    body: list[bytes]
    user_id: str | None = None


class Drop(NamedTuple):
    reason: str
    detail: str


class Note(NamedTuple):
    event: str
    detail: str


class Request:
    """A client's request as the broker holds it. ``requeued``: it went to a worker that
    vanished and is held again; such a request is held whatever the budget (it was accepted
    once), so the budget bounds the others, and these are at most one per worker."""

    __slots__ = ("client", "service", "body", "expires_at", "size", "requeued")

    def __init__(self, client: bytes, service: bytes, body: list[bytes], expires_at: float):
        self.client = client
        self.service = service
        self.body = body
        self.expires_at = expires_at
        self.size = sum(map(len, body)) + len(client) + len(service)
        self.requeued = False


class Service:
    __slots__ = ("name", "requests", "idle", "workers")

    def __init__(self, name: bytes):
        self.name = name
        self.requests: deque[Request] = deque()
        self.idle: dict[bytes, Worker] = {}  # insertion order = least recently used first
        self.workers = 0


class Worker:
    __slots__ = ("identity", "service", "expires_at", "sent_at", "request")

    def __init__(self, identity: bytes, service: Service, expires_at: float, sent_at: float):
        self.identity = identity
        self.service = service
        self.expires_at = expires_at
        self.sent_at = sent_at
        self.request: Request | None = None


def _body_fits(frames: Sequence[bytes], start: int, n: int, limits: mdp.Limits) -> bool:
    if n - start == 1:
        return len(frames[start]) <= limits.max_body_bytes
    size = 0
    for i in range(start, n):
        size += len(frames[i])
    return size <= limits.max_body_bytes


def peer(identity: bytes) -> str:
    return identity.hex()


class BrokerCore:
    def __init__(self, config: BrokerConfig | None = None):
        self.config = config or BrokerConfig()
        self.guard: Callable[[bytes, list[bytes], str | None], list[bytes] | None] | None = None
        """``guard(service, body, user_id)``: a reply's body (status first) that refuses a
        client's request to a worker's service before it is queued, or None to let it
        through (the supervisor's rights: ``clonemap.supervisor.services``)."""
        self.services: dict[bytes, Service] = {}
        self.workers: dict[bytes, Worker] = {}
        self.internal: set[bytes] = set()
        self.counters: dict[str, int] = dict.fromkeys(
            ("requests", "dispatched", "partials", "finals", "queued", "requeued", "mmi",
             "internal_calls", "workers_registered", "workers_expired",
             "workers_disconnected", "workers_invalid", "heartbeats_sent",
             "disconnects_sent", "dropped_on_stop", "refused"), 0)
        self._expiry_s = self.config.worker_expiry_s
        self.held_bytes = 0
        """Bytes of the requests queued now (``Request.size``), all services."""
        self.held_by_client: dict[bytes, int] = {}

    # ----------------------------------------------------------------- internal services
    def add_internal(self, service: bytes) -> None:
        """Let the broker answer ``service`` itself (the shell runs the handler)."""
        mdp.check_service(service, "READY", self.config.limits)
        self.internal.add(service)

    def remove_internal(self, service: bytes) -> None:
        self.internal.discard(service)

    # ----------------------------------------------------------------- messages
    def on_message(self, frames: Sequence[bytes], now: float) -> list:
        """One message read from the ROUTER: ``frames[0]`` is the sender's identity."""
        n = len(frames)
        if n > 1:
            header = frames[1]
            if header == MDPW:
                if n > 5 and frames[2] == W_FINAL:
                    fast = self._fast_final(frames, n, now)
                    if fast is not None:
                        return fast
                return self._on_worker(frames, now)
            if header == MDPC:
                if n > 4 and frames[2] == C_REQUEST:
                    fast = self._fast_request(frames, n, now)
                    if fast is not None:
                        return fast
                return self._on_client(frames, now)
        identity = frames[0]
        effects: list = []
        try:
            mdp.decode_client(frames[1:], self.config.limits)
        except ProtocolError as exc:
            effects.append(Drop(exc.reason, f"peer {peer(identity)}: {exc}"))
        worker = self.workers.get(identity)
        if worker is not None:
            self._invalid_worker(worker, now, effects)
        return effects

    # The two messages of every request, without the decoder's objects and copies. Each
    # takes only input that the full path would accept and treat the same way; anything
    # else (returns None) goes the full way, which names the fault.
    def _fast_request(self, frames: Sequence[bytes], n: int, now: float) -> list | None:
        """A REQUEST to a known, worker-served service that has an idle worker."""
        service = frames[3]
        svc = self.services.get(service)  # names in ``services`` were checked on entry
        if svc is None or not svc.idle or service in self.internal:
            return None
        if n > 4 and self.guard is not None:  # a body: the guard decides (slow path)
            return None
        limits = self.config.limits
        if n - 4 > limits.max_body_frames or not _body_fits(frames, 4, n, limits):
            return None
        self.counters["requests"] += 1
        worker = svc.idle.pop(next(iter(svc.idle)))
        return [self._dispatch(worker, Request(frames[0], service, frames[4:], 0.0), now)]

    def _fast_final(self, frames: Sequence[bytes], n: int, now: float) -> list | None:
        """A FINAL from a known worker for the client it is serving."""
        worker = self.workers.get(frames[0])
        if worker is None:
            return None
        request = worker.request
        limits = self.config.limits
        if (request is None or frames[3] != request.client or frames[4]
                or n - 5 > limits.max_body_frames or not _body_fits(frames, 5, n, limits)):
            return None
        worker.expires_at = now + self._expiry_s
        self.counters["finals"] += 1
        worker.request = None
        effects = [[request.client, MDPC, C_FINAL, request.service, *frames[5:]]]
        self._worker_idle(worker, now, effects)
        return effects

    def _on_client(self, frames: Sequence[bytes], now: float) -> list:
        client = frames[0]
        try:
            msg = mdp.decode_client(frames[1:], self.config.limits)
        except ProtocolError as exc:
            return [Drop(exc.reason, f"client {peer(client)}: {exc}")]
        if msg.command != C_REQUEST:
            return [Drop("wrong_direction",
                         f"client {peer(client)}: MDPC02 {mdp.CLIENT_COMMANDS[msg.command]} "
                         "is only sent by a broker")]
        return self.on_request(client, msg.service, msg.body, now,
                               getattr(frames, "user_id", None))

    def on_request(self, client: bytes, service: bytes, body: list[bytes], now: float,
                   user_id: str | None = None) -> list:
        """A valid client REQUEST (also the entry point for tests and internal routing)."""
        self.counters["requests"] += 1
        if service in self.internal:
            self.counters["internal_calls"] += 1
            return [InternalCall(client, service, body, user_id)]
        if service.startswith(MMI_PREFIX):
            return [self._mmi(client, service, body)]
        if self.guard is not None and (refusal := self.guard(service, body, user_id)):
            self.counters["refused"] += 1
            return [[client, MDPC, C_FINAL, service, *refusal]]
        svc = self.services.get(service)
        if svc is None:
            svc = self._new_service(service)
            if svc is None:
                return [Drop("too_many_services",
                             f"request for {service!r} from {peer(client)}: "
                             f"{len(self.services)} services already")]
        if svc.idle:
            worker = svc.idle.pop(next(iter(svc.idle)))
            return [self._dispatch(worker, Request(client, service, body, 0.0), now)]
        if len(svc.requests) >= self.config.max_queued:
            return [Drop("queue_full", f"request for {service!r} from {peer(client)}: "
                                       f"{len(svc.requests)} queued")]
        request = Request(client, service, body, now + self.config.request_expiry_s)
        config = self.config
        mine = self.held_by_client.get(client, 0)
        if mine + request.size > config.max_held_bytes_per_client:
            return [Drop("client_held_bytes",
                         f"request for {service!r} from {peer(client)}: {request.size} bytes "
                         f"would hold {mine + request.size} for this client (budget "
                         f"{config.max_held_bytes_per_client})")]
        if self.held_bytes + request.size > config.max_held_bytes:
            return [Drop("held_bytes",
                         f"request for {service!r} from {peer(client)}: {request.size} bytes "
                         f"would hold {self.held_bytes + request.size} in all (budget "
                         f"{config.max_held_bytes})")]
        self._hold(request)
        svc.requests.append(request)
        self.counters["queued"] += 1
        return []

    def _hold(self, request: Request) -> None:
        self.held_bytes += request.size
        self.held_by_client[request.client] = (self.held_by_client.get(request.client, 0)
                                               + request.size)

    def _release(self, request: Request) -> Request:
        self.held_bytes -= request.size
        left = self.held_by_client.get(request.client, 0) - request.size
        if left > 0:
            self.held_by_client[request.client] = left
        else:
            self.held_by_client.pop(request.client, None)
        return request

    def _on_worker(self, frames: Sequence[bytes], now: float) -> list:
        identity = frames[0]
        worker = self.workers.get(identity)
        try:
            msg = mdp.decode_worker(frames[1:], self.config.limits)
        except ProtocolError as exc:
            effects: list = [Drop(exc.reason, f"worker {peer(identity)}: {exc}")]
            if worker is not None:
                self._invalid_worker(worker, now, effects)
            return effects
        command = msg.command
        if worker is None:
            if command == W_READY:
                return self._register(identity, msg.service, now,
                                      getattr(frames, "user_id", None))
            if command == W_DISCONNECT:
                return []
            if command == W_REQUEST:
                return [Drop("wrong_direction",
                             f"peer {peer(identity)}: MDPW02 REQUEST is only sent by a broker")]
            return self._disconnect(identity, "unknown_worker",
                                    f"{mdp.WORKER_COMMANDS[command]} from an unknown peer")
        worker.expires_at = now + self._expiry_s
        if command == W_FINAL or command == W_PARTIAL:
            request = worker.request
            if request is None or request.client != msg.client:
                effects = self._disconnect(
                    identity, "unexpected_reply",
                    f"{mdp.WORKER_COMMANDS[command]} for client {peer(msg.client)} while "
                    + ("idle" if request is None else f"serving {peer(request.client)}"))
                self._forget(worker, now, effects)
                return effects
            if command == W_PARTIAL:
                self.counters["partials"] += 1
                return [[request.client, MDPC, C_PARTIAL, request.service, *msg.body]]
            self.counters["finals"] += 1
            worker.request = None
            effects = [[request.client, MDPC, C_FINAL, request.service, *msg.body]]
            self._worker_idle(worker, now, effects)
            return effects
        if command == W_HEARTBEAT:
            return []
        if command == W_DISCONNECT:
            self.counters["workers_disconnected"] += 1
            effects = [Note("worker_disconnected",
                            f"worker {peer(identity)} ({worker.service.name!r}) disconnected")]
            self._forget(worker, now, effects)
            return effects
        if command == W_READY:
            effects = self._disconnect(identity, "duplicate_ready",
                                       f"second READY ({msg.service!r})")
            self._forget(worker, now, effects)
            return effects
        # W_REQUEST: exists, but never travels towards a broker
        effects = [Drop("wrong_direction",
                        f"worker {peer(identity)}: MDPW02 REQUEST is only sent by a broker")]
        self._invalid_worker(worker, now, effects)
        return effects

    # ----------------------------------------------------------------- timer
    def on_tick(self, now: float) -> list:
        """Expire silent workers (re-queueing their requests), heartbeat the others,
        expire queued requests, forget empty services. Call every ~heartbeat_s/4."""
        effects: list = []
        heartbeat_s = self.config.heartbeat_s
        for worker in [w for w in self.workers.values() if w.expires_at <= now]:
            self.counters["workers_expired"] += 1
            effects.append(Note("worker_expired",
                                f"worker {peer(worker.identity)} ({worker.service.name!r}) "
                                f"silent for {self._expiry_s:g} s"))
            self._forget(worker, now, effects)
        for worker in self.workers.values():
            if now - worker.sent_at >= heartbeat_s:
                worker.sent_at = now
                self.counters["heartbeats_sent"] += 1
                effects.append([worker.identity, MDPW, W_HEARTBEAT])
        for name in list(self.services):
            svc = self.services[name]
            if svc.requests and not svc.workers:
                self._expire_requests(svc, now, effects)
            if not svc.requests and not svc.workers:
                del self.services[name]
        return effects

    # ----------------------------------------------------------------- helpers
    def _new_service(self, name: bytes) -> Service | None:
        if len(self.services) >= self.config.max_services:
            for key in [k for k, s in self.services.items() if not s.requests and not s.workers]:
                del self.services[key]
            if len(self.services) >= self.config.max_services:
                return None
        svc = self.services[name] = Service(name)
        return svc

    def _register(self, identity: bytes, service: bytes, now: float,
                  user_id: str | None = None) -> list:
        if service in self.internal or service.startswith(MMI_PREFIX):
            return self._disconnect(identity, "reserved_service",
                                    f"READY for {service!r}, a service the broker hosts")
        if (user_id is not None and user_id != "server"
                and service.startswith(self.config.server_only)):
            return self._disconnect(identity, "not_a_server",
                                    f"READY for {service!r} from a peer authenticated as "
                                    f"{user_id!r}: only servers may offer it")
        if len(self.workers) >= self.config.max_workers:
            return self._disconnect(identity, "too_many_workers",
                                    f"READY for {service!r}: {len(self.workers)} workers")
        svc = self.services.get(service) or self._new_service(service)
        if svc is None:
            return self._disconnect(identity, "too_many_services",
                                    f"READY for {service!r}: {len(self.services)} services")
        if svc.requests and not svc.workers:  # the first worker: overdue requests go first
            self._expire_requests(svc, now, effects := [])
        else:
            effects = []
        worker = Worker(identity, svc, now + self._expiry_s, now)
        self.workers[identity] = worker
        svc.workers += 1
        self.counters["workers_registered"] += 1
        effects.append(Note("worker_ready", f"worker {peer(identity)} serves {service!r}"))
        self._worker_idle(worker, now, effects)
        return effects

    def _dispatch(self, worker: Worker, request: Request, now: float) -> list[bytes]:
        worker.request = request
        worker.sent_at = now
        self.counters["dispatched"] += 1
        return [worker.identity, MDPW, W_REQUEST, request.client, b"", *request.body]

    def _worker_idle(self, worker: Worker, now: float, effects: list) -> None:
        """The worker can take a request: the next queued one, or join the idle list."""
        svc = worker.service
        if svc.requests:
            effects.append(self._dispatch(worker, self._release(svc.requests.popleft()), now))
        else:
            svc.idle[worker.identity] = worker

    def _forget(self, worker: Worker, now: float, effects: list) -> None:
        """Remove the worker; its in-flight request goes back to the front of the queue."""
        self.workers.pop(worker.identity, None)
        svc = worker.service
        svc.idle.pop(worker.identity, None)
        svc.workers -= 1
        if not svc.workers and svc.requests:  # unregistered again: the expiry clock restarts
            expires_at = now + self.config.request_expiry_s
            for queued in svc.requests:
                queued.expires_at = expires_at
        request = worker.request
        worker.request = None
        if request is None:
            return
        self.counters["requeued"] += 1
        request.requeued = True
        request.expires_at = now + self.config.request_expiry_s
        if svc.idle:
            other = svc.idle.pop(next(iter(svc.idle)))
            effects.append(self._dispatch(other, request, now))
        else:  # accepted once: held again whatever the budget
            self._hold(request)
            svc.requests.appendleft(request)

    def _invalid_worker(self, worker: Worker, now: float, effects: list) -> None:
        self.counters["workers_invalid"] += 1
        effects.append(Note("worker_invalid", f"worker {peer(worker.identity)} "
                                              f"({worker.service.name!r}) sent an invalid "
                                              "message: forgotten"))
        self._forget(worker, now, effects)

    def on_stop(self) -> list:
        """The broker is going away: a DISCONNECT to every worker, which then starts over
        on a fresh socket at once (a restarted broker gets its READY without waiting
        ``liveness`` heartbeats). Requests in flight or queued are dropped and counted
        (``dropped_on_stop``): their clients' own deadlines and retries take over."""
        effects: list = []
        for identity in list(self.workers):
            effects += self._disconnect(identity, "broker_stopping", "the broker is stopping")
        lost = sum(1 for w in self.workers.values() if w.request is not None)
        lost += sum(len(svc.requests) for svc in self.services.values())
        if lost:
            self.counters["dropped_on_stop"] += lost
            effects.append(Note("stopping", f"{lost} requests in flight or queued dropped"))
        self.workers.clear()
        for svc in self.services.values():
            svc.idle.clear()
            svc.requests.clear()
            svc.workers = 0
        self.held_bytes = 0
        self.held_by_client.clear()
        return effects

    def _disconnect(self, identity: bytes, reason: str, detail: str) -> list:
        self.counters["disconnects_sent"] += 1
        key = "disconnect." + reason
        self.counters[key] = self.counters.get(key, 0) + 1
        return [Note("disconnect", f"DISCONNECT to {peer(identity)}: {detail}"),
                [identity, MDPW, W_DISCONNECT]]

    def _expire_requests(self, svc: Service, now: float, effects: list) -> None:
        live = deque()
        for request in svc.requests:
            if request.expires_at <= now:
                self._expired(self._release(request), effects)
            else:
                live.append(request)
        svc.requests = live

    def _expired(self, request: Request, effects: list) -> None:
        effects.append(Drop("request_expired",
                            f"request for {request.service!r} from {peer(request.client)}: "
                            f"no worker within {self.config.request_expiry_s:g} s"))

    def _mmi(self, client: bytes, service: bytes, body: list[bytes]) -> list[bytes]:
        self.counters["mmi"] += 1
        if service == b"mmi.service":
            name = body[0]
            svc = self.services.get(name)
            found = name in self.internal or (svc is not None and svc.workers > 0)
            status = b"200" if found else b"404"
        else:
            status = b"501"
        return [client, MDPC, C_FINAL, service, status]

    # ----------------------------------------------------------------- reporting
    def queued(self) -> int:
        return sum(len(s.requests) for s in self.services.values())

    def snapshot(self) -> dict:
        """Counters and a per-service view (names decoded), for ``stats()``."""
        services = {}
        for name, svc in self.services.items():
            services[name.decode("utf-8", "replace")] = {
                "workers": svc.workers, "idle": len(svc.idle), "queued": len(svc.requests)}
        return {"counters": dict(self.counters), "workers": len(self.workers),
                "queued": self.queued(), "held_bytes": self.held_bytes,
                "held_clients": len(self.held_by_client), "services": services,
                "internal": sorted(s.decode("utf-8", "replace") for s in self.internal)}

"""A server's ZeroMQ context and the sockets it binds and connects.

``open`` makes the context (and its ZAP handler, ``clonemap.shards.common.security``) and binds::

    P    ROUTER  snapshot:  ICANHAZ? -> KVSYNC* KTHXBAI      (ROUTER_MANDATORY: flow control)
    P+1  XPUB    publisher: KVPUB, HUGZ (verbose: every subscription is read)
    P+2  SUB     collector: KVSET (subscribed to everything)

each with its high-water mark derived from its byte budget (``clonemap.shards.byte_marks``) and a
``ZMQ_MAXMSGSIZE`` that disconnects a peer sending a frame far beyond every limit before
libzmq buffers it. A port that is taken raises ``PortInUse`` naming it, everything
opened so far closed first. Every socket a server or its parts make (``socket``,
``connect``) has linger 0 and its role's link options (ZMTP heartbeats across hosts),
and the server's side of CURVE when the cluster uses it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import zmq

from clonemap.shards.common import zio
from clonemap.shards.common.errors import PortInUse
from clonemap.shards.common.security import Authenticator, Security
from clonemap.shards.server_config import (ServerConfig, collector_frame_limit,
                                           request_frame_limit)



class Bound(NamedTuple):
    """The three sockets ``open`` bound."""

    router: zmq.Socket
    """P: snapshots (ICANHAZ), the pair's link and TTL tables, writers' replies."""
    pub: zmq.Socket
    """P+1: KVPUB and HUGZ."""
    collector: zmq.Socket
    """P+2: KVSET."""


class ServerSockets:
    """One server's context and sockets (see the module doc)."""

    def __init__(self, config: ServerConfig, security: Callable[[], Security],
                 link_options: Callable[[zmq.Socket], None]):
        """``security()``: the server's CURVE settings (set before ``open``);
        ``link_options(sock)``: the role's options for every socket."""
        self.config = config
        self._security = security
        self._link_options = link_options
        self.ctx: zmq.Context | None = None
        self._auth: Authenticator | None = None

    def open(self, router_hwm: int, pub_hwm: int, collect_hwm: int,
             identities: frozenset[str] | None = None) -> Bound:
        """The context, then P, P+1, P+2 bound with these marks; returned (the server
        keeps them). The publisher applies no subscription itself
        (``ZMQ_XPUB_MANUAL``): the server applies each (``clonemap.shards.heartbeat``),
        narrowed to what its subscriber may read (``clonemap.shards.gate``), a
        subscription to everything as one to every key (``chp.EVERY_KEY``: not to a
        move's staged updates). ``identities``: the only named identities the ZAP
        handler admits (None: every one with a key)."""
        cfg = self.config
        self.ctx = zmq.Context(io_threads=cfg.io_threads)
        self._auth = Authenticator(self.ctx, self._security(), identities)
        try:
            router = self.socket(zmq.ROUTER)
            # a reader of a large snapshot is cut off only as the pump abandons it
            zio.patient_with_readers(router, cfg.snapshot_stall_s)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.SNDHWM, router_hwm)
            router.setsockopt(zmq.MAXMSGSIZE, request_frame_limit(cfg.limits))
            self.bind(router, cfg.endpoint(0))
            pub = self.socket(zmq.XPUB)
            pub.setsockopt(zmq.SNDHWM, pub_hwm)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            pub.setsockopt(zmq.XPUB_MANUAL, 1)
            pub.setsockopt(zmq.MAXMSGSIZE, request_frame_limit(cfg.limits))
            self.bind(pub, cfg.endpoint(1))
            collector = self.socket(zmq.SUB)
            collector.setsockopt(zmq.RCVHWM, collect_hwm)
            # a frame far beyond every limit disconnects its peer before it is buffered;
            # one moderately over a limit is read and dropped, counted (oversize_*)
            collector.setsockopt(zmq.MAXMSGSIZE, collector_frame_limit(cfg.limits))
            collector.setsockopt(zmq.SUBSCRIBE, b"")
            self.bind(collector, cfg.endpoint(2))
        except BaseException:
            self.close()
            raise
        return Bound(router, pub, collector)

    @property
    def auth(self) -> Authenticator | None:
        """The ZAP handler (None before ``open`` and after ``close``)."""
        return self._auth

    def socket(self, kind: int) -> zmq.Socket:
        """A socket of this server's context: linger 0, and the role's link options."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._link_options(sock)
        return sock

    def connect(self, kind: int, endpoint: str, options: tuple = ()) -> zmq.Socket:
        """A socket (``socket``) with ``options`` (``(option, value)`` pairs, set before
        the connection makes its pipe) and the client side of this server's security,
        connected to ``endpoint``."""
        sock = self.socket(kind)
        for option, value in options:
            sock.setsockopt(option, value)
        self._security().connect_side(sock)
        sock.connect(endpoint)
        return sock

    def bind(self, sock: zmq.Socket, endpoint: str) -> None:
        """Bind with the server's side of its security; ``PortInUse`` if it is taken."""
        self._security().bind_side(sock)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EADDRINUSE:
                raise PortInUse(f"{endpoint} is already in use", endpoint=endpoint) from None
            raise

    def close(self) -> None:
        """Stop the ZAP handler and destroy the context (every socket, linger 0)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None

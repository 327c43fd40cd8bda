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

from typing import TYPE_CHECKING

import zmq

from clonemap.shards.common import zio
from clonemap.shards.common.errors import PortInUse
from clonemap.shards.common.security import Authenticator
from clonemap.shards.history import WIDTH as KVPUB_FRAMES
from clonemap.shards.server_config import collector_frame_limit, request_frame_limit

if TYPE_CHECKING:
    from clonemap.shards.server import ShardServer


class ServerSockets:
    """One server's context and sockets (see the module doc)."""

    def __init__(self, server: "ShardServer"):
        self.server = server
        self.ctx: zmq.Context | None = None
        self._auth: Authenticator | None = None

    def open(self) -> None:
        """The context, then P, P+1, P+2, bound; set on the server as ``_router_sock``,
        ``_pub`` (with ``_publish_many``) and ``_collector_sock``."""
        server = self.server
        cfg = server.config
        self.ctx = zmq.Context(io_threads=cfg.io_threads)
        self._auth = Authenticator(self.ctx, server.security)
        try:
            router = self.socket(zmq.ROUTER)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.SNDHWM, server.snapshots.hwm)
            router.setsockopt(zmq.MAXMSGSIZE, request_frame_limit(cfg.limits))
            self.bind(router, cfg.endpoint(0))
            server._router_sock = router
            pub = self.socket(zmq.XPUB)
            pub.setsockopt(zmq.SNDHWM, server.marks.pub_hwm)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            pub.setsockopt(zmq.MAXMSGSIZE, request_frame_limit(cfg.limits))
            self.bind(pub, cfg.endpoint(1))
            server._pub = pub
            server._publish_many = zio.publisher_many(pub, KVPUB_FRAMES)
            collector = self.socket(zmq.SUB)
            collector.setsockopt(zmq.RCVHWM, server.marks.collect_hwm)
            # a frame far beyond every limit disconnects its peer before it is buffered;
            # one moderately over a limit is read and dropped, counted (oversize_*)
            collector.setsockopt(zmq.MAXMSGSIZE, collector_frame_limit(cfg.limits))
            collector.setsockopt(zmq.SUBSCRIBE, b"")
            self.bind(collector, cfg.endpoint(2))
            server._collector_sock = collector
            server.snapshots.bind_hwm = server.snapshots.hwm
            server._pub_bind_hwm = server.marks.pub_hwm
        except BaseException:
            self.close()
            raise

    def socket(self, kind: int) -> zmq.Socket:
        """A socket of this server's context: linger 0, and the role's link options."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.server.role.link_options(sock)
        return sock

    def connect(self, kind: int, endpoint: str, options: tuple = ()) -> zmq.Socket:
        """A socket (``socket``) with ``options`` (``(option, value)`` pairs, set before
        the connection makes its pipe) and the client side of this server's security,
        connected to ``endpoint``."""
        sock = self.socket(kind)
        for option, value in options:
            sock.setsockopt(option, value)
        self.server.security.connect_side(sock)
        sock.connect(endpoint)
        return sock

    def bind(self, sock: zmq.Socket, endpoint: str) -> None:
        """Bind with the server's side of its security; ``PortInUse`` if it is taken."""
        self.server.security.bind_side(sock)
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

"""Closing live TCP connections that a ZeroMQ socket of this process accepted.

libzmq gives no call that closes one peer's connection of a bound socket, and a
subscription, once applied, lasts as long as its connection. When an identity's rights
change (``supervisor reload``), a server closes the connections its publisher accepted
from the hosts that identity connected from: ``shutdown(2)`` on the connection's socket
(through a duplicate of its descriptor, which only this module touches and closes
again). libzmq's I/O thread then reads the end of the stream and drops the pipe with
every subscription on it; the peer's ZeroMQ socket reconnects (100 ms by default),
passes the ZAP handler again, under the new rights or not at all, and subscribes again,
narrowed to what it may read now.

ZAP names a connection's host, not the connection (its ``address`` is the peer's IP), so
every client connection from those hosts is closed; they reconnect the same way. The
cluster's own processes on this host (the pair's peer, relays: ``clonemap.shards``
processes of this user) are found by their side of the connection and kept.
"""
from __future__ import annotations

import logging
import os
import socket

import psutil

log = logging.getLogger(__name__)

_KEEP = ("clonemap.shards",)
"""A peer process whose command line holds one of these is one of the cluster's own."""


def _own_sockets():
    """(fd, local address, peer address) of each connected TCP socket of this process."""
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            dup = os.dup(fd)
        except (ValueError, OSError):
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and \
                    sock.type == socket.SOCK_STREAM:
                yield sock, sock.getsockname()[:2], sock.getpeername()[:2]
        except OSError:  # a listening socket has no peer
            pass
        finally:
            sock.close()  # the duplicate only


def _cluster_ends() -> set[tuple[str, int]]:
    """The local ends of TCP connections held by the cluster's own processes (servers and
    relays of this user on this host)."""
    ends: set[tuple[str, int]] = set()
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return ends
    keep: dict[int, bool] = {}
    me = os.getpid()
    for conn in connections:
        if conn.pid is None or conn.pid == me or not conn.raddr:
            continue
        if conn.pid not in keep:
            try:
                cmdline = " ".join(psutil.Process(conn.pid).cmdline())
            except (psutil.Error, OSError):
                cmdline = ""
            keep[conn.pid] = any(word in cmdline for word in _KEEP)
        if keep[conn.pid]:
            ends.add((conn.laddr.ip, conn.laddr.port))
    return ends


def reset_connections(ports: set[int], hosts: set[str]) -> int:
    """Shut down every TCP connection this process accepted on one of ``ports`` whose
    peer is on one of ``hosts`` (IP addresses), except those of the cluster's own
    processes on this host (the module doc). How many."""
    if not hosts or not ports:
        return 0
    closed = 0
    kept = None
    for sock, local, peer in _own_sockets():
        if local[1] not in ports or peer[0] not in hosts:
            continue
        if kept is None:
            kept = _cluster_ends()
        if peer in kept:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError as exc:
            log.debug("cannot shut down the connection from %s: %s", peer, exc)
    return closed

"""Closing the connections a reload must close (``clonemap.shards.common.connections``),
with real sockets of this process: only the accepted connections on the given ports,
from the given hosts, are shut down; the listening socket and every other connection
keep working. (Telling the cluster's own processes apart is tested under ``supervisor
start``: ``tests/integration/test_access_control.py``.)"""
from __future__ import annotations

import socket

from clonemap.shards.common.connections import reset_connections


def _listener() -> socket.socket:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    return srv


def _pair(srv: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(srv.getsockname())
    accepted, _ = srv.accept()
    return client, accepted


def test_only_the_accepted_connections_on_the_ports_from_the_hosts_are_shut_down():
    watched, other = _listener(), _listener()
    socks = [watched, other]
    try:
        client_a, accepted_a = _pair(watched)
        client_b, accepted_b = _pair(other)
        socks += [client_a, accepted_a, client_b, accepted_b]
        port = watched.getsockname()[1]
        assert reset_connections({port}, {"10.9.9.9"}) == 0  # no peer on that host
        assert reset_connections(set(), {"127.0.0.1"}) == 0
        assert reset_connections({port}, {"127.0.0.1"}) == 1
        client_a.settimeout(5)
        assert client_a.recv(1) == b""  # the peer sees the end of the stream
        client_b.sendall(b"x")  # the connection on the other port still carries data
        accepted_b.settimeout(5)
        assert accepted_b.recv(1) == b"x"
        again, accepted_again = _pair(watched)  # the listener still accepts
        socks += [again, accepted_again]
        again.sendall(b"y")
        accepted_again.settimeout(5)
        assert accepted_again.recv(1) == b"y"
    finally:
        for sock in socks:
            sock.close()

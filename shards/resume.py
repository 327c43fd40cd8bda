"""The resume reply: the updates after a client's sequence, from the server's ``History``,
streamed like a snapshot (a ``clonemap.shards.streams`` stream: flow control, fair slots). Each is
a KVSYNC with its own sequence, UUID and properties (an empty value deletes), then a
KTHXBAI at the server's sequence when the request came, with ``resume=1`` and the map's
``term=`` (``chp.kthxbai_props``)."""
from __future__ import annotations

import zmq
from zmq.backend import Socket as _BackendSocket

from clonemap.shards import streams
from clonemap.shards.common.proto import chp

_send = _BackendSocket.send
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_LAST = int(zmq.NOBLOCK)


class ResumeStream:
    __slots__ = ("identity", "subtree", "entries", "pos", "seq", "chunk", "sent", "service",
                 "props")

    def __init__(self, service, identity: bytes, subtree: bytes, entries: list, seq: int,
                 props: bytes = chp.RESUMED):
        self.props = props
        """The KTHXBAI's properties: ``resume=1`` and the map's ``term=``."""
        self.service = service
        """The ``clonemap.shards.snapshots.SnapshotService`` it streams for."""
        self.identity = identity
        self.subtree = subtree
        self.entries = entries
        self.pos = 0
        self.seq = seq
        self.chunk = service.server.config.snapshot_chunk
        self.sent = 0

    def close(self) -> None:
        self.entries = []

    def send_some(self, sock: zmq.Socket) -> str:
        identity, entries = self.identity, self.entries
        stop = min(len(entries), self.pos + self.chunk)
        i = self.pos
        try:
            while i < stop:
                seq, key, uuid, props, value = entries[i]
                _send(sock, identity, _MORE)
                _send(sock, key, _MORE)
                _send(sock, chp.pack_seq(seq), _MORE)
                _send(sock, uuid, _MORE)
                _send(sock, props, _MORE)
                _send(sock, value, _LAST)
                i += 1
            if i == len(entries):
                _send(sock, identity, _MORE)
                for frame in chp.kthxbai(self.seq, self.subtree, self.props)[:-1]:
                    _send(sock, frame, _MORE)
                _send(sock, self.subtree, _LAST)
                self.sent += i - self.pos
                self.service.resume_sent += i - self.pos
                self.pos = i
                return streams.DONE
        except zmq.Again:
            pass
        progressed = i > self.pos
        self.sent += i - self.pos
        self.service.resume_sent += i - self.pos
        self.pos = i
        return streams.PROGRESS if progressed else streams.BLOCKED

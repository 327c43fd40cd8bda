"""A CHP server that speaks the dialect of the ZeroMQ guide's reference C Clone server
(clonesrv6), frame by frame, in raw pyzmq: the foreign peer the client is tested against.

    python tests/chp_dialect_peer.py --port P [--peer Q --active|--passive]
                                     [--heartbeat-s 1] [--mangle-kvsync]

Where the reference server deviates from 12/CHP, this peer does the same:

* KVSYNC carries the stored UUID (16 bytes) and properties in frames 2 and 3, and the
  stored update's own sequence in frame 1;
* KTHXBAI's subtree frame is empty, whatever subtree was asked for;
* HUGZ carries the current sequence in frame 1 (not 0), and a passive server sends it too;
* a KVSET's properties are published back as sent (a client's ``ttl=0`` included); a
  non-zero ``ttl`` is stored as an absolute time in milliseconds, as the C server does,
  and shows up in the KVSYNC's properties.

There is no flow control on snapshots, no clock in HUGZ, no serving hint and no map
generation. ``--mangle-kvsync`` sends every KVSYNC with a 3-byte UUID frame (no client
can apply such a snapshot). Pairs (``--peer``): a minimal Binary Star as clonesrv6 runs
it. Each server publishes its state ("ACTIVE"/"PASSIVE") on P+3 every heartbeat; the
passive subscribes to the active's P+1 and applies its KVPUBs with their sequences, keeps the
KVSETs it hears pending by UUID until the active publishes them, does not answer
ICANHAZ while the active was heard within two heartbeats, and becomes active on an
ICANHAZ (the client's vote) once it was not, publishing what is still pending.

Prints ``READY dialect-peer port=P pid=N`` once bound; exits 0 on SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import signal
import struct
import sys
import time

import zmq

SEQ = struct.Struct(">Q")


class Peer:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.ctx = zmq.Context()
        self.store: dict[bytes, list[bytes]] = {}   # key -> [key, seq, uuid, props, value]
        self.seq = 0
        self.pending: dict[bytes, list[bytes]] = {}
        """A passive's KVSETs by UUID, until the active's KVPUB with that UUID."""
        self.active = not args.passive
        self.peer_heard = time.monotonic()
        port = args.port
        self.snapshot = self._bind(zmq.ROUTER, port)
        self.publisher = self._bind(zmq.PUB, port + 1)
        self.collector = self._bind(zmq.SUB, port + 2)
        self.collector.setsockopt(zmq.SUBSCRIBE, b"")
        self.state_pub = self.state_sub = self.follow = None
        if args.peer:
            self.state_pub = self._bind(zmq.PUB, port + 3)
            self.state_sub = self.ctx.socket(zmq.SUB)
            self.state_sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.state_sub.connect(f"tcp://127.0.0.1:{args.peer + 3}")
            self.follow = self.ctx.socket(zmq.SUB)
            self.follow.setsockopt(zmq.SUBSCRIBE, b"")
            self.follow.connect(f"tcp://127.0.0.1:{args.peer + 1}")

    def _bind(self, kind: int, port: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        sock.bind(f"tcp://127.0.0.1:{port}")
        return sock

    # ------------------------------------------------------------------ handlers
    def on_icanhaz(self, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        if len(rest) != 2 or rest[0] != b"ICANHAZ?":
            return
        if not self.active:
            if time.monotonic() - self.peer_heard < 2 * self.args.heartbeat_s:
                return  # the vote is refused: no answer at all
            self.active = True  # failover: the client's vote wins
            pending, self.pending = self.pending, {}
            for update in pending.values():  # what the dead active never published
                self.on_kvset(update)
        subtree = rest[1]
        for key, msg in list(self.store.items()):
            if key.startswith(subtree):
                uuid = b"\x00\x01\x02" if self.args.mangle_kvsync else msg[2]
                self.snapshot.send_multipart([identity, key, msg[1], uuid, msg[3], msg[4]])
        self.snapshot.send_multipart([identity, b"KTHXBAI", SEQ.pack(self.seq), b"", b"",
                                      b""])

    def on_kvset(self, frames: list[bytes]) -> None:
        if len(frames) != 5:
            return
        if not self.active:  # held until the active publishes it (or we take over)
            self.pending[frames[2]] = frames
            return
        key, _, uuid, props, value = frames
        self.seq += 1
        msg = [key, SEQ.pack(self.seq), uuid, props, value]
        self.publisher.send_multipart(msg)
        self._store(msg)

    def _store(self, msg: list[bytes]) -> None:
        key, props, value = msg[0], msg[3], msg[4]
        if not value:
            self.store.pop(key, None)
            return
        lines = props.split(b"\n") if props else []
        for i, line in enumerate(lines):
            if line.startswith(b"ttl=") and line != b"ttl=0":
                ttl_ms = int(float(line[4:]) * 1000)
                lines[i] = b"ttl=%d" % (int(time.time() * 1000) + ttl_ms)
        self.store[key] = [msg[0], msg[1], msg[2], b"\n".join(lines), value]

    def on_follow(self, frames: list[bytes]) -> None:
        """The passive's replica: the active's KVPUBs, applied with their sequences."""
        if self.active or len(frames) != 5 or frames[0] == b"HUGZ":
            return
        self.pending.pop(frames[2], None)
        seq = SEQ.unpack(frames[1])[0]
        if seq > self.seq:
            self.seq = seq
            self._store(frames)

    def on_peer_state(self, frames: list[bytes]) -> None:
        self.peer_heard = time.monotonic()

    def beat(self) -> None:
        self.publisher.send_multipart([b"HUGZ", SEQ.pack(self.seq), b"", b"", b""])
        if self.state_pub is not None:
            self.state_pub.send(b"ACTIVE" if self.active else b"PASSIVE")

    # ------------------------------------------------------------------ loop
    def run(self, stop) -> None:
        poller = zmq.Poller()
        handlers = {self.snapshot: self.on_icanhaz, self.collector: self.on_kvset}
        if self.state_sub is not None:
            handlers[self.state_sub] = self.on_peer_state
            handlers[self.follow] = self.on_follow
        for sock in handlers:
            poller.register(sock, zmq.POLLIN)
        next_beat = time.monotonic()
        while not stop():
            now = time.monotonic()
            if now >= next_beat:
                self.beat()
                next_beat = now + self.args.heartbeat_s
            for sock, _ in poller.poll(max(1, int((next_beat - now) * 1000))):
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    handlers[sock](frames)
        self.ctx.destroy(linger=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--peer", type=int, default=0, help="the other server's port base")
    role = ap.add_mutually_exclusive_group()
    role.add_argument("--active", action="store_true")
    role.add_argument("--passive", action="store_true")
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--mangle-kvsync", action="store_true")
    args = ap.parse_args()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    peer = Peer(args)
    print(f"READY dialect-peer port={args.port} pid={os.getpid()}", flush=True)
    peer.run(lambda: bool(stopping))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A snapshot streamed to one requester (12/CHP's KVSYNC* KTHXBAI), a chunk per loop turn,
on the server's ``clonemap.shards.streams.StreamPump``."""
from __future__ import annotations

import logging
import time

import zmq
from zmq.backend import Socket as _BackendSocket

from clonemap.shards import gate as rights
from clonemap.shards import streams
from clonemap.shards.byte_marks import INITIAL_MARK, derive
from clonemap.shards.common import zio
from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.live_mark import LiveMark
from clonemap.shards.common.memory import give_back
from clonemap.shards.common.proto import chp
from clonemap.shards.roles import Reactor
from clonemap.shards.resume import ResumeStream
from clonemap.shards.store import Store


log = logging.getLogger("clonemap.shards.server")

_send = _BackendSocket.send
_send_rows = zio.send_rows
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_pack_seq = chp.pack_seq


PACE_AHEAD_S = 0.25
"""How far ahead of its ``pace`` a move's copy may be sent (its head start, in seconds of
the rate): the copy's own pauses (``clonemap.shards.migrate``) keep it about there."""
PACE_BURST_S = 0.05
"""A paced copy is sent at least this many seconds of its rate at a time: at 4 MiB/s, a
millisecond's worth at a time (the pump's retry) cost the source more CPU in wake-ups
and small fetches than the rows themselves."""
REQUESTERS_MAX = 4096
"""ICANHAZ requesters whose rights wait to be read (``SnapshotService.requested_by``)."""


class _Rows(tuple):
    """A fetched chunk in columns: ``(keys, values, mod_seqs, props)``, ``props`` one
    bytes for every row or a list (``_zframes.send_rows`` takes them as they are)."""

    __slots__ = ()

    def __len__(self) -> int:
        return len(self[0])

    def __new__(cls, keys: list, values: list, mods: list, props: bytes | list):
        return tuple.__new__(cls, (keys, values, mods, props))


def largest_entry(store: Store) -> int:
    """The largest key + value in ``store`` (one pass: ~5 ms per 100,000 keys)."""
    data = store.data
    if not data:
        return 0
    return max(map(len, data)) + max(map(len, data.values()))


def _both(first, second):
    """One ``may_read(key)`` of two, either of which may be None (every key)."""
    if first is None or second is None:
        return second if first is None else first
    return lambda key: first(key) and second(key)


class SnapshotStream:
    """One snapshot being streamed to one ROUTER peer (a ``clonemap.shards.streams`` stream):
    KVSYNCs from a point-in-time cursor, ``chunk`` per turn, then KTHXBAI."""

    __slots__ = ("identity", "subtree", "cursor", "seq_frame", "pending", "pos", "chunk",
                 "sent", "service", "kthxbai_props", "meta", "readable", "pace",
                 "paced_from", "paced_bytes", "row_bytes", "wait_s")

    def __init__(self, service: "SnapshotService", identity: bytes, subtree: bytes,
                 kthxbai_props: bytes = b"", meta: bool = False, readable=None,
                 pace: int | None = None):
        self.pace = pace
        """A move's copy asked at this many bytes per second (``pace=``): the rows go no
        faster (``PACE_AHEAD_S`` ahead at most), where they would otherwise fill the
        pipe's high-water mark at full speed as the copy starts. None: unpaced."""
        self.paced_from: float | None = None
        self.paced_bytes = 0.0
        self.row_bytes = 128.0
        """The rows' mean size (key and value) in the last columns fetched."""
        self.wait_s = 0.0
        """How long a paced stream that is ahead waits (``streams.PACED``)."""
        self.readable = readable
        """``may_read(key)`` of a requester that may read only some of the subtree
        (``clonemap.shards.gate``): every row is checked; None: every row goes."""
        self.kthxbai_props = kthxbai_props
        """Empty (12/CHP); for a request with our extension frame ``chp.kthxbai_props``:
        the map's ``term=``, and ``resume=0`` when a resume was asked and not possible."""
        self.service = service
        server = service.server
        self.identity = identity
        self.subtree = subtree
        self.meta = meta
        """The requester asked ``meta=1``: a TTL key's KVSYNC says ``expires=``."""
        self.cursor = server.store.open_snapshot(subtree, with_expiry=meta)
        self.seq_frame = _pack_seq(self.cursor.seq)
        self.pending = _Rows([], [], [], b"")
        self.pos = 0
        self.chunk = server.config.snapshot_chunk
        self.sent = 0

    def close(self) -> None:
        self.cursor.close()

    def send_some(self, sock: zmq.Socket) -> str:
        """Up to ``chunk`` KVSYNCs (then KTHXBAI); EHOSTUNREACH goes to the pump."""
        identity, seq_frame, cursor = self.identity, self.seq_frame, self.cursor
        meta = self.meta
        budget = self.chunk
        if self.pace is not None:
            now = time.monotonic()
            if self.paced_from is None:
                self.paced_from = now
            allowed = self.pace * (now - self.paced_from + PACE_AHEAD_S) - self.paced_bytes
            least = max(self.row_bytes, self.pace * PACE_BURST_S)
            if allowed < least:  # (a burst's worth at a time: few wake-ups, big fetches)
                self.wait_s = max(streams.PAUSE_S, (least - allowed) / self.pace)
                return streams.PACED
            budget = max(1, min(budget, int(allowed // self.row_bytes)))
        pending, pos = self.pending, self.pos
        sent = fetched = 0
        outcome = streams.BLOCKED
        send, more, last, empty = _send, _MORE, _NOBLOCK, b""
        i = pos
        try:
            while sent < budget:
                if pos >= len(pending):
                    if cursor.done:
                        _send(sock, identity, _MORE)
                        zio.send_frames5(sock, chp.KTHXBAI, seq_frame, b"",
                                         self.kthxbai_props, self.subtree)
                        outcome = streams.DONE
                        break
                    if fetched >= 8:  # a sparse subtree: examined enough keys this turn
                        outcome = streams.PROGRESS
                        break
                    keys, values, mods, expiries = cursor.next_columns(
                        budget * 4, meta, self.readable)  # (only what the requester reads)
                    props = b"" if expiries is None else [
                        b"" if e is None else b"expires=%.3f\n" % e for e in expiries]
                    pending = _Rows(keys, values, mods, props)
                    if keys and self.pace is not None:
                        self.row_bytes = max(1.0, (sum(map(len, keys)) + sum(
                            map(len, values))) / len(keys))
                    if keys:  # before any of them is queued: the byte bound holds
                        self.service.entries(max(map(len, keys)) + max(map(len, values)))
                        if not self.sent:  # this peer's pipe may have the bind-time mark
                            self.service.reapply()
                    pos = i = 0
                    fetched += 1
                    continue
                stop = min(len(pending), pos + budget - sent)
                if _send_rows is not None:  # compiled: the whole chunk in one C call
                    i = _send_rows(sock.underlying, identity, *pending, pos, stop)
                    sent += i - pos
                    pos = i
                    if i < stop:  # the peer's pipe is full (no row was half sent)
                        break
                    continue
                keys, values, mods, props = pending
                same_props = props.__class__ is bytes
                while i < stop:  # the hot loop: one KVSYNC per turn, nothing else
                    send(sock, identity, more)  # Again / EHOSTUNREACH come only from here
                    send(sock, keys[i], more)
                    send(sock, _pack_seq(mods[i]), more)  # the key's own sequence
                    send(sock, empty, more)
                    send(sock, props if same_props else props[i], more)
                    send(sock, values[i], last)
                    i += 1
                sent += i - pos
                pos = i
        except zmq.Again:
            sent += i - pos
            pos = i
        finally:
            self.pending, self.pos = pending, pos
            self.sent += sent
            self.paced_bytes += sent * self.row_bytes
            self.service.kvsync_sent += sent
        if outcome == streams.DONE:
            log.debug("snapshot of %d keys under %r at seq %d sent to %r", self.sent,
                      self.subtree, cursor.seq, identity)
            return outcome
        return streams.PROGRESS if (sent or fetched) else outcome


class SnapshotService:
    """What a server answers on P: ICANHAZ (12/CHP), and our resume extension.

    An ICANHAZ becomes a ``SnapshotStream`` on a ``clonemap.shards.streams.StreamPump`` (or waits in
    its bounded queue): a point-in-time ``SnapshotCursor``, at most ``snapshot_chunk``
    KVSYNCs per requester per loop turn, round-robin, then KTHXBAI. Every KVSYNC carries
    the key's own sequence. The pump's rules apply: a full pipe pauses only that
    requester, one that makes no progress for ``snapshot_stall_s`` is abandoned, one that
    disconnected (EHOSTUNREACH) is dropped; both are counted. A resume request (``since``)
    is answered from the server's history (``clonemap.shards.resume``) when it covers it, else by
    a whole snapshot that says ``resume=0``. The role decides whether a request is
    answered at all (``admit_snapshot_request``: a pair's client vote).

    Bytes: the ROUTER's mark in messages is each requester's share of
    ``snapshot_held_bytes`` over the largest entry streamed so far (``clonemap.shards.byte_marks``),
    lowered before a larger entry is queued and set again for pipes made since."""

    def __init__(self, server: Reactor):
        self.server = server
        self.pump: streams.StreamPump | None = None
        self.refused = 0
        self.kvsync_sent = 0
        self.resume_sent = 0
        """Updates sent in resume replies (``clonemap.shards.resume``), besides ``kvsync_sent``."""
        self.adoptions = 0
        """Adoptions answered with the updates after this shard's copy (``_adoption``)."""
        self.refused_terms = 0
        """Resumes of this map's generation refused because the client's updates came
        from another term past what this map holds (``Role.resumable``)."""
        self.largest = 0
        """The largest key + value streamed in a snapshot so far (it only grows)."""
        self._requesters: dict[bytes, object] = {}
        """Where rights are enforced: each ICANHAZ's requester's ``Scope`` (None: every
        right), by its ROUTER identity, from when it arrived (``requested_by``) until it
        is taken (``on_request``); a request without one is refused."""
        self.narrowed = 0
        self.refused_rights = 0
        self.heap_trims = 0
        self._busy = False
        self.hwm = self._mark()
        self.mark: LiveMark | None = None
        """The ROUTER's mark, from ``bind`` (``clonemap.shards.common.live_mark``)."""

    def bound(self, sock: zmq.Socket) -> None:
        """P's ROUTER is bound, with the mark this service asked for."""
        self.mark = LiveMark(sock, zmq.SNDHWM, bind_value=self.hwm, name="snapshot ROUTER")

    def start(self, loop, sock: zmq.Socket, kick) -> None:
        cfg = self.server.config
        self.pump = streams.StreamPump(
            loop, sock, kick, stall_s=cfg.snapshot_stall_s,
            max_active=cfg.max_active_snapshots, max_waiting=cfg.max_waiting_snapshots,
            yield_s=cfg.snapshot_yield_s, name="snapshot")
        if self.mark is not None:
            self.mark.start(loop, kick)

    def clear(self) -> None:
        """Drop every stream (the server stops serving)."""
        if self.pump is not None:
            self.pump.clear()

    def close(self) -> None:
        """Drop every stream and stop the mark's monitor (before the ROUTER closes)."""
        self.clear()
        if self.mark is not None:
            self.mark.close()

    # ------------------------------------------------------------------ requests
    def requested_by(self, identity: bytes, scope) -> None:
        """The ICANHAZ that ``identity`` just sent comes from a requester with these
        rights (``clonemap.shards.gate.Scope``, None: every right)."""
        requesters = self._requesters
        requesters.pop(identity, None)
        requesters[identity] = scope
        while len(requesters) > REQUESTERS_MAX:  # oldest first: refused, never widened
            requesters.pop(next(iter(requesters)))

    def on_request(self, frames: list[bytes]) -> None:
        """An ICANHAZ on the ROUTER: queue a snapshot (or resume) for this peer."""
        server = self.server
        server.heartbeat.read_subscriptions()  # (a subscription that came first applies)
        server.flush_pending()  # a snapshot point must not show what is not on disk yet
        identity = frames[0]
        try:
            request = chp.decode_icanhaz(frames[1:], server.config.limits)
        except ProtocolError as err:
            server.drops.drop(err.reason, str(err))
            return
        if server.disk_error or not server.role.admit_snapshot_request():
            self.refused += 1
            return
        readable, narrowed = None, False
        if server.gate.enforcing:
            scope = self._requesters.pop(identity, rights.NOTHING_SCOPE)
            if scope is not None:
                covered = scope.snapshot(request.subtree)
                if covered == rights.NONE:
                    self._refuse(identity, request, scope)
                    return
                if covered == rights.SOME:
                    readable, narrowed = scope.may_read, True
                    self.narrowed += 1
                    server.gate.count(scope.name, "snapshots_narrowed",
                                      f"a snapshot of {request.subtree[:80]!r} narrowed to "
                                      f"what identity {scope.name!r} may read")
        if request.move is not None:  # a move's copy: only what moves to that shard
            readable = _both(readable, server.exported_to(request.move))
        else:  # the keys that moved away, while they are forgotten (None otherwise)
            readable = _both(readable, server.forgetting)
            if request.meta:  # and, for our clients, the keys a move stages here
                readable = _both(readable, server.staged_filter())
        # a request with our extension frame (meta=1) learns the map's term and the
        # routing epoch; a plain ICANHAZ gets the empty properties 12/CHP has
        props = (chp.kthxbai_props(term=server.role.term(), epoch=server.routing_epoch)
                 if request.meta else b"")
        if narrowed:
            props += chp.NARROWED
        pace = request.pace if request.move is not None else None
        make = lambda: SnapshotStream(self, identity, request.subtree,  # noqa: E731
                                      props, request.meta, readable, pace)
        if request.since is not None:
            make = self._resume_or_snapshot(identity, request, readable, narrowed)
        elif request.adopt is not None and readable is None:
            make = self._adoption(identity, request, props) or make
        if not self.pump.add(identity, make):
            server.drops.drop("snapshot_queue_full", f"{len(self.pump.waiting)} requests "
                                                     "wait")

    def _refuse(self, identity: bytes, request: chp.Icanhaz, scope) -> None:
        """A snapshot of a subtree its requester may read nothing of: answered at once
        by an empty KTHXBAI that says ``refused=read`` (a client raises, naming the
        subtree; a strict 12/CHP peer sees an empty subtree), counted by identity."""
        self.refused_rights += 1
        self.server.gate.count(scope.name, "snapshots_refused",
                               f"identity {scope.name!r} may read nothing under "
                               f"{request.subtree[:80]!r}: its snapshot was refused")
        frames = chp.kthxbai(self.server.store.seq, request.subtree, chp.REFUSED_READ)
        try:
            zio.send_frames(self.server.router_socket, [identity, *frames])
        except zmq.ZMQError:  # gone, or its pipe is full: it asks again
            pass
        self.server.kick_router()

    def _resume_or_snapshot(self, identity: bytes, request: chp.Icanhaz, readable=None,
                            narrowed: bool = False):
        """A resume request (``since``): the updates after it when the client's map is of
        this generation, its updates up to ``since`` are all in this map (its ``term``,
        ``Role.resumable``) and the server's history covers the rest; else a full
        snapshot that says ``resume=0``. Decided when the request is taken, at the current
        sequence. ``narrowed``: the requester's rights left keys out (``narrowed=1``);
        ``readable`` may also leave out keys that moved away, which says nothing."""
        server = self.server
        entries = None
        term = server.role.term()
        same_map = not request.generation or request.generation == server.generation
        held = request.term is None or server.role.resumable(request.term, request.since)
        if same_map and held:
            entries = server.recent.since(request.since, request.subtree)
        elif same_map:
            self.refused_terms += 1
        said = chp.NARROWED if narrowed else b""
        if entries is None:
            props = chp.kthxbai_props(False, term) + said
            return lambda: SnapshotStream(self, identity, request.subtree, props,
                                          request.meta, readable)
        seq = server.store.seq
        props = chp.kthxbai_props(True, term) + said
        if readable is not None:
            entries = [entry for entry in entries if readable(entry[1])]
        return lambda: ResumeStream(self, identity, request.subtree, entries, seq, props)

    def _adoption(self, identity: bytes, request: chp.Icanhaz, props: bytes):
        """An adoption (``adopt=``): a client of the whole map that holds every map a
        change copied this (added) shard from, each at or past the sequence the copy
        holds everything up to, and each built whole before the change's epoch (its
        server had not begun to forget what moved), holds what the copy made of this
        shard. It gets the
        updates after the copy, from the history, with ``adopted=1``; None (a whole
        snapshot) when the claim falls short, or the history no longer reaches back."""
        server = self.server
        handover = server.handover
        if handover is None or request.subtree:
            return None
        at, epoch, sources = handover
        if server.routing_epoch != epoch:  # a later change since: what it copied moved on
            return None
        claim = request.adopt or {}
        for gen, seq in sources.items():
            held, built = claim.get(gen, (-1, epoch))
            if held < seq or not 0 < built < epoch:  # (built later: it may have forgotten)
                return None
        entries = server.recent.since(at, b"")
        if entries is None:
            return None
        self.adoptions += 1
        seq = server.store.seq
        props = chp.RESUMED + props + chp.ADOPTED
        return lambda: ResumeStream(self, identity, b"", entries, seq, props)

    # ------------------------------------------------------------------ bytes
    def _mark(self) -> int:
        cfg = self.server.config
        share = cfg.snapshot_held_bytes // (cfg.max_active_snapshots + streams.MAX_STALLED)
        return derive(share, cfg.snapshot_sndhwm, max(self.largest, INITIAL_MARK))

    def entries(self, biggest: int) -> None:
        """Entries of up to ``biggest`` bytes may be streamed from now on (a recovered or
        installed map, a snapshot's next chunk before it is queued): lower the ROUTER's
        mark if they are the largest yet. libzmq applies it to the pipes that exist; a
        pipe made later gets the bind-time mark, so each stream sets it again before its
        first entry (``reapply``)."""
        if biggest <= self.largest:
            return
        self.largest = biggest
        hwm = self._mark()
        if hwm != self.hwm:
            self.hwm = hwm
            if self.mark is not None:
                self.mark.set(hwm)

    def reapply(self) -> None:
        """Set a lowered mark again, for the pipes of peers that connected since (a
        no-op while it is still the bind-time one)."""
        if self.mark is not None:
            self.mark.reapply()

    def give_back(self) -> None:
        """Once the last stream has ended, give the heap's free pages back to the OS
        (``memory.give_back``): the frames of a flood of never-reading requesters (or of
        many joins) are freed small blocks that the process would keep."""
        pump = self.pump
        if pump is None:
            return
        busy = bool(pump.active or pump.waiting)
        if self._busy and not busy:
            give_back()
            self.heap_trims += 1
        self._busy = busy

    def stats(self) -> dict:
        pump = self.pump
        counters = pump.counters if pump is not None else {}
        return {
            "snapshots_served": counters.get("done", 0),
            "snapshots_active": len(pump.active) if pump is not None else 0,
            "snapshots_waiting": len(pump.waiting) if pump is not None else 0,
            "snapshots_abandoned": counters.get("abandoned", 0),
            "snapshots_unreachable": counters.get("unreachable", 0),
            "snapshots_yielded": counters.get("yielded", 0),
            "snapshots_stalled": pump.stalled if pump is not None else 0,
            "snapshots_refused": self.refused,
            "snapshots_narrowed": self.narrowed,
            "snapshots_refused_rights": self.refused_rights,
            "resumes_refused_term": self.refused_terms,
            "adoptions": self.adoptions,
            "kvsync_sent": self.kvsync_sent,
            "resume_sent": self.resume_sent,
            "snapshot_hwm": self.hwm,
            "snapshot_mark": self.mark.stats() if self.mark is not None else None,
            "heap_trims": self.heap_trims,
        }

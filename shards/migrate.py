"""Moving keys between shards (resharding, ``clonemap.supervisor.resharding``): a pinned
prefix, or the routing segments that a new shard count gives to other shards.

Two parts, one on each side of a move, driven by the supervisor through the servers'
control services (``clonemap.shards.serve``):

* ``Import``, on the target shard's active, one per source shard: a copy of the keys that
  move here from that source (under a prefix, or from its whole map, filtered by the new
  routing). It reads the source active as a replica does: its TTL table and applied
  UUIDs (``BSTAR-TTL?``), a snapshot of the prefix (``ICANHAZ?`` with ``move=``: only
  what moves here) and, from before that snapshot, the source's updates under the prefix
  on its publisher (each key's last update kept until the snapshot ends, then applied,
  ``DRAIN_CHUNK`` a loop turn, those the snapshot holds skipped; the copy is ``copied``
  once they are: the queue is bounded by the keys that move, however long the copy). ``source_seq`` is the source sequence the copy holds
  everything up to: the last KVPUB of the prefix, or the sequence of the last clock
  HUGZ, whichever is later (the publisher's stream is ordered, so a HUGZ at sequence S
  follows every KVPUB up to S). Each key copied is *staged* as it arrives
  (``ShardServer.apply_copied``): applied to the target's store with its own sequence,
  logged, replicated to its passive and published, so that the target's passive has the
  copy, on disk too, before the hold begins, and the flip has no per-key work. A shard
  the change adds serves no client before the flip. A shard that already serves marks
  each such KVPUB ``staged=1`` (``ShardServer.stage_copied``): our clients do not apply
  it (they hold the key in its owner's part, and take it from there once they follow the
  new routing: ``clonemap.client``), our clients' snapshots leave such keys out, and a
  KVSET for one is not this shard's to apply. A strict 12/CHP peer sees ordinary
  updates. A move rolled back deletes what it staged, in updates marked the same way
  (``ShardServer.abort_import``).
* ``Hold``, on the source shard's active: from ``hold`` on, its KVSETs for keys the new
  routing gives to other shards are kept, in arrival order, instead of applied (bounded
  in bytes). The hold
  ends one of two ways: the owner flipped, and the held KVSETs go to the target's
  collectors (``Forwarder``), which apply them once, after the copy; or the move is
  rolled back, and they are applied here (``release``), as if they had just arrived.
  After the flip the same ``Forwarder`` sends on the KVSETs that clients still routing
  by the old epoch send here: a write is never dropped for having been sent before its
  client learned of the move.

The flip (``ShardServer.commit_import``): the target follows the new routing (a routing
file and an fsync) and takes the source's applied UUIDs, so a write its client sends
again after the move is still applied once. A client of the whole map adopts the keys it
holds already: an added shard's part asks the shard for the updates after its copy
(``adopt=``), and a serving shard's part takes them from the parts that held them, once
those read their streams up to the new routing. Others re-home each key from the
target's snapshot. The source then follows the new routing too, forwards what it held,
and only then forgets the keys that moved, without publishing deletes
(``Store.forget``). A move rolled back before the flip stops the shards it added and
removes their data directories, staged copy and all, and a serving target deletes what
it staged.
"""
from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from clonemap.shards.common import zio
from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.proto import bstar_ttl, chp
from clonemap.shards.common.proto.props import parse_props

log = logging.getLogger(__name__)

HOLD_MAX_BYTES = 64 << 20
"""Bytes of KVSETs one hold may keep; past it the hold fails (``Hold.failed``) and the
supervisor rolls the move back: no write waits on a hold that cannot end."""
HOLD_SAFETY_S = 5.0
"""An unsealed hold ends by itself after this long (the supervisor that began it holds
it for its bound, 0.5 s by default, then releases or seals it)."""
COPY_TIMEOUT_S = 30.0
"""How long the copy may go without progress before the import fails: its source's first
HUGZ, the TTL table, and then each ``timeout_s`` some more of the snapshot (the supervisor
allows more for a copy its rate makes longer: ``clonemap.supervisor.resharding``). A copy
that moves slower than its rate, under idle priority on a busy host, goes on; a source
that stopped sending fails it. (Until 2026-11-30 it was the whole snapshot's deadline: on a
2-core host whose writes left the copy too little CPU, 168,768 of 336,160 keys came in
30 s, and the growth failed.)"""
PACE_MIN_S = 0.002
"""A copy ahead of its rate by less than this reads on (no timer for less)."""
DRAIN_CHUNK = 500
"""Updates queued during a copy's snapshot that its target applies per loop turn once the
snapshot is whole (``Import._drain``): each is staged as a write is (logged, replicated,
published), and a serving target's writes wait for the turn."""
PACED_BATCH = 64
"""Snapshot messages a paced copy reads between two checks of its rate (1024 unpaced)."""
_take_rows = zio.compiled_function("take_rows")
_NOT_ROWS = tuple(sorted(chp.RESERVED_KEYS | {bstar_ttl.REPLY}))
"""First frames that never begin a snapshot row (``Import._take_rows``)."""


def expiry_of(props: bytes) -> float | None:
    """The absolute expiry in a KVPUB's properties (``expires=``), or None."""
    if not props or b"expires=" not in props:
        return None
    try:
        return float(parse_props(props)["expires"])
    except (KeyError, ValueError, ProtocolError):
        return None


class Import:
    """The target's copy of the keys moving here from the source active at ``source``
    (its snapshot endpoint, P; the publisher is P+1). Driven by the server's loop
    through ``zio.AsyncSocket`` (each message one call, read in batches: no coroutine
    per message; on the compiled frame path the snapshot's plain rows many to a C call,
    ``_take_rows``), on sockets from ``connect(kind, endpoint, options)`` (the server's
    context and security). ``start()`` inside the server's loop."""

    def __init__(self, connect, loop, source: str, prefix: bytes, limits, owns=None,
                 index: int | None = None, *, stage, flush,
                 rate: float | None = None, timeout_s: float = COPY_TIMEOUT_S):
        """``prefix``: the subtree asked of the source (b"" for the whole map);
        ``owns(key)``: whether the new routing gives a key to this shard (only those
        are copied; None: every key under ``prefix``); ``index``: this shard's, named
        in the snapshot request (``move=``: the source sends only what moves here).
        ``stage(key, value, expiry_s)``: where each copied key goes as it arrives (an
        empty value deletes it), with ``flush()`` after each batch read. ``rate``: the
        snapshot's bytes (keys and values) read per second at most (None: as fast as
        they come): between two batches the reader pauses until it is back within the
        rate, and the source's stream waits on its high-water mark meanwhile.
        ``timeout_s``: how long the copy may go without progress (``COPY_TIMEOUT_S``)."""
        self.source = source
        self.prefix = prefix
        self.owns = owns if owns is not None else (lambda key: True)
        self.index = index
        self._stage = stage
        self.sizes: dict[bytes, int] = {}
        """key -> bytes of key and value, of every key the copy holds (kept or staged)."""
        self.bytes = 0
        """Of its keys and values."""
        self.uuids: list = []
        """The source's applied UUIDs as of its TTL table (``[uuid, seq, ...]``)."""
        self.source_seq = 0
        self.source_gen = ""
        """The generation of the source's map (its HUGZ say it): a client that holds
        that map past ``source_seq`` holds what this copy took from it."""
        self.source_term = 0
        """The Binary Star term the source's active said in its HUGZ (0: none said)."""
        self.snapshot_seq = -1
        """The snapshot's KTHXBAI sequence (-1 until it arrived whole)."""
        self.updates = 0
        self.rows_taken = 0
        """Snapshot rows read in bulk (``_take_rows``), of ``sizes``' keys and the rest."""
        self.error = ""
        self.started_at = time.monotonic()
        self._connect = connect
        self._loop = loop
        self._limits = limits
        self._sub = self._dealer = None
        self._live = False
        self._expiries: dict[bytes, float] = {}
        self._queued: dict[bytes, chp.Kvpub] = {}
        """The source's last update of each moving key while the snapshot comes (and while
        the queue is applied): one a key, however often it is written meanwhile, so the
        queue is bounded by the keys that move, not by the writes' rate and the copy's
        length (``_on_update``)."""
        self._queued_seq = 0
        """The last sequence the source said while the queue was kept (a HUGZ's, or a
        KVPUB's): ``source_seq`` once the queue is applied."""
        self._applying = None
        """The queued updates being applied (an iterator), ``DRAIN_CHUNK`` a loop turn."""
        self._draining: asyncio.Handle | None = None
        """The queued updates are being applied, ``DRAIN_CHUNK`` a loop turn (``_drain``)."""
        self._timer = None
        self._after_batch = flush
        self.rate = rate
        self.timeout_s = timeout_s
        self.received = 0
        """Bytes of the snapshot's keys and values read so far (paced by ``rate``)."""
        self.paused_s = 0.0
        """Time the reader paused to keep within ``rate``."""
        self._paced_from: float | None = None
        self._row_seqs: dict[bytes, int] = {}
        """Scratch for ``_take_rows`` (the C call fills it; cleared after each)."""
        self._looked = (False, False, 0)
        """How far the copy had got at the last look of ``_too_slow``: the source's
        publisher heard, the snapshot asked, its bytes read."""

    @property
    def staged(self) -> int:
        """Keys staged (applied on the target as they came)."""
        return len(self.sizes)

    @property
    def copied(self) -> bool:
        """The snapshot came whole, and the updates queued meanwhile are applied."""
        return self.snapshot_seq >= 0 and self._draining is None

    def start(self) -> None:
        host, port = self.source.rsplit(":", 1)
        sub = self._connect(zmq.SUB, f"{host}:{int(port) + 1}",
                            ((zmq.RCVHWM, 0), (zmq.SUBSCRIBE, self.prefix),
                             (zmq.SUBSCRIBE, chp.HUGZ)))
        self._sub = zio.AsyncSocket(sub, self._on_update, batch=1024, loop=self._loop,
                                    name="import updates", after_batch=self._after_batch)
        dealer = self._connect(zmq.DEALER, self.source, ())
        self._dealer = zio.AsyncSocket(dealer, self._on_reply,
                                       batch=1024 if self.rate is None else PACED_BATCH,
                                       loop=self._loop, name="import snapshot",
                                       after_batch=self._paced, bulk=self._take_rows)
        self._timer = self._loop.call_later(self.timeout_s, self._too_slow)

    def _too_slow(self) -> None:
        """Every ``timeout_s`` until the snapshot is whole: a copy that got further since
        the last look goes on; one that did not fails."""
        if self.snapshot_seq >= 0:
            return
        now = (self._live, self._paced_from is not None, self.received)
        if now != self._looked:
            self._looked = now
            self._timer = self._loop.call_later(self.timeout_s, self._too_slow)
            return
        # where it stopped: the source's publisher never said a HUGZ (no request
        # sent), the TTL table or the snapshot did not come (or stopped coming)
        self._fail(f"no progress of the copy in {self.timeout_s:g} s, "
                   f"{time.monotonic() - self.started_at:.1f} s after it began "
                   f"({self._where()})")

    def _where(self) -> str:
        step = ("waiting for the source's first HUGZ" if not self._live else
                "TTL table asked" if self._paced_from is None else "snapshot asked")
        return (f"{step}; {len(self.sizes)} keys, {self.received} bytes of the snapshot "
                f"read, {self.paused_s:.2f} s paused, {len(self._queued)} updates queued, "
                f"source sequence {self.source_seq}; snapshot reader: "
                f"{_reader_state(self._dealer)}; updates reader: "
                f"{_reader_state(self._sub)}")

    def _paced(self) -> None:
        """After a batch of the snapshot: staged keys flushed, and with a ``rate``, a
        pause until the bytes read are within it."""
        self._after_batch()
        if (self.rate is None or self.copied or self._dealer is None
                or self._paced_from is None):  # (no snapshot asked yet: nothing to pace)
            return
        now = self._loop.time()
        ahead = self._paced_from + self.received / self.rate - now
        if ahead > PACE_MIN_S:
            self.paused_s += ahead
            self._dealer.pause(ahead)

    def _fail(self, why: str) -> None:
        if not self.error:
            self.error = why
            log.error("import from %s failed: %s", self.source, why)
        self.close()

    # the publisher first (what it sends meanwhile is queued), then the TTL table and
    # the UUIDs, then the snapshot
    def _on_update(self, frames: list[bytes]) -> None:
        if not self._live:
            if frames[0] != chp.HUGZ:
                return  # (before the subscription's welcome: covered by the snapshot)
            self._live = True
            self._dealer.send(bstar_ttl.request())
        if self.copied:
            self._update(frames)
            return
        # (the snapshot is still coming, or the queue is being applied: each key's last
        # update is kept, applied after the snapshot if it is later than the snapshot)
        msg = self._decode(frames)
        if msg is None:
            return
        if isinstance(msg, chp.Hugz):
            self._heard(msg, queued=True)
        else:
            self._queued_seq = max(self._queued_seq, msg.seq)
            if msg.key.startswith(self.prefix) and self.owns(msg.key):
                self._queued[msg.key] = msg

    def _on_reply(self, frames: list[bytes]) -> None:
        try:
            if frames and frames[0] == bstar_ttl.REPLY:
                chunk = bstar_ttl.decode_chunk(frames)
                prefix = self.prefix
                self._expiries.update((k, t) for k, t in chunk.table.items()
                                      if k.startswith(prefix))
                if chunk.last:
                    self.uuids = list(chunk.uuids)
                    # (the source paces its side too: it would otherwise fill the
                    # pipe's high-water mark at full speed, its writes waiting)
                    self._dealer.send(chp.icanhaz(
                        self.prefix, move=self.index,
                        pace=int(self.rate) if self.rate is not None else None))
                    self._paced_from = self._loop.time()
                return
            msg = chp.decode_snapshot(frames, self._limits, strict=False)
        except ProtocolError as exc:
            self._fail(f"the source's reply does not decode: {exc}")
            return
        if isinstance(msg, chp.Kthxbai):
            self.snapshot_seq = msg.seq
            self.source_seq = max(self.source_seq, msg.seq)
            self._expiries = {}
            log.info("import of %r from %s: %d keys copied at source sequence %d, %d "
                     "updates queued meanwhile", self.prefix, self.source,
                     len(self.sizes), self.snapshot_seq, len(self._queued))
            self._applying = self._take_queued()
            self._draining = self._loop.call_soon(self._drain)
            return
        self.received += len(msg.key) + len(msg.value)
        if self.owns(msg.key):
            try:
                self._put(msg.key, msg.value, self._expiries.get(msg.key))
            except Exception as exc:
                self._staging_failed(exc)

    def _staging_failed(self, exc: Exception) -> None:
        """A copied key could not be staged: the copy cannot be whole, so it fails (the
        supervisor rolls the move back), rather than go on without that key (before
        2026-12-01 the reader logged the error and read on: the flip would have lost
        the key)."""
        log.error("import from %s: staging a copied key failed", self.source,
                  exc_info=exc)
        self._fail(f"staging a copied key failed: {exc!r}")

    def _take_rows(self, handle: int, limit: int):
        """The snapshot DEALER's ``bulk`` (``zio.AsyncSocket``, compiled path): once the
        snapshot is asked, up to ``limit`` of its plain rows (no properties: no expiry)
        taken in one C call (``_zframes.take_rows``: the checks ``chp.decode_snapshot``
        makes of such a row), then staged here in arrival order, as ``_on_reply``
        stages one; the first other message (a row with an expiry, KTHXBAI, anything
        malformed) comes back for ``_on_reply``. Per key it saves the message's list of
        frames, the handler's call and the decoder's: ~a fifth of an added shard's CPU
        per key moved (bench reshard). None: nothing to take this way (the TTL table
        is still coming, or the pure path)."""
        if _take_rows is None or self._paced_from is None or self.snapshot_seq >= 0:
            return None
        rows, seqs = {}, self._row_seqs
        limits = self._limits
        n, frames = _take_rows(handle, limit, zio.MAX_FRAMES, rows, seqs, self.prefix,
                               limits.max_key, limits.max_value, _NOT_ROWS, False)
        self.rows_taken += n
        seqs.clear()  # (the target's sequences are its own: the source's are not kept)
        if rows:
            owns, put, expiries = self.owns, self._put, self._expiries
            received = 0
            try:
                for key, value in rows.items():
                    received += len(key) + len(value)
                    if owns(key):
                        put(key, value, expiries.get(key))
            except Exception as exc:  # (a key not staged: the copy cannot be whole)
                self._staging_failed(exc)
                return n, None
            self.received += received
        return n, frames

    def _take_queued(self):
        """The queued updates, to apply (an iterator); what comes meanwhile is queued
        afresh."""
        queued, self._queued = self._queued, {}
        return iter(queued.values())

    def _drain(self) -> None:
        """Apply up to ``DRAIN_CHUNK`` of the updates queued during the snapshot, then
        the next chunk at the next loop turn; what the publisher sends meanwhile is
        queued again, and applied after them (a key's later update after its earlier
        one). A serving target (a shrink's) applied them all in one turn: ~33,000
        updates of a 20 s copy, half a second in which its own writes waited."""
        done = 0
        while done < DRAIN_CHUNK:
            msg = next(self._applying, None)
            if msg is None:  # (this queue is applied: then what came meanwhile, if any)
                if not self._queued:
                    self._applying = None
                    self.source_seq = max(self.source_seq, self._queued_seq)
                    self._after_batch()
                    self._draining = None
                    return
                self._applying = self._take_queued()
                continue
            self._apply(msg)
            if self.error:  # (an update failed the copy: closed)
                return
            done += 1
        self._after_batch()
        self._draining = self._loop.call_soon(self._drain)

    def _decode(self, frames: list[bytes]):
        """A message of the source's publisher, decoded (None: one that does not decode,
        left out)."""
        try:
            return chp.decode_update(frames, self._limits, strict=False)
        except ProtocolError:
            return None

    def _update(self, frames: list[bytes]) -> None:
        """One message of the source's publisher, once the copy is ``copied``."""
        msg = self._decode(frames)
        if msg is None:
            return
        if isinstance(msg, chp.Hugz):
            self._heard(msg)
            return
        if msg.seq > self.source_seq:  # (every update up to it was read: one stream)
            self.source_seq = msg.seq
        self._apply(msg)

    def _heard(self, msg: chp.Hugz, queued: bool = False) -> None:
        """A HUGZ of the source: the sequence it names (``queued``: the queue holds
        everything up to it, ``source_seq`` once applied), its map's generation, and its
        Binary Star term (a new one fails the copy)."""
        info = chp.hugz_info(msg)
        if info.ts is not None:
            if queued:
                self._queued_seq = max(self._queued_seq, info.seq)
            else:
                self.source_seq = max(self.source_seq, info.seq)
        if info.generation:
            self.source_gen = info.generation
        if info.serving and info.term:
            if self.source_term and info.term != self.source_term:
                # a new process at the source's address serves (one killed and back
                # through its alone record, Binary Star's L5): what it published
                # before this SUB was connected again is not in the copy
                self._fail(f"the source's active changed under the copy (term "
                           f"{self.source_term} -> {info.term})")
                return
            self.source_term = info.term

    def _apply(self, msg: chp.Kvpub) -> None:
        """A KVPUB of the source staged here, unless the snapshot holds it already or
        its key does not move here."""
        if (msg.seq <= self.snapshot_seq or not msg.key.startswith(self.prefix)
                or not self.owns(msg.key)):
            return  # in the snapshot already, or not moving here
        try:
            if msg.value:
                self._put(msg.key, msg.value, expiry_of(msg.props))
            else:
                old = self.sizes.pop(msg.key, None)
                if old is not None:  # (a key the copy never held is none of its business)
                    self.bytes -= old
                    self._stage(msg.key, b"", None)
        except Exception as exc:
            self._staging_failed(exc)
            return
        self.updates += 1

    def _put(self, key: bytes, value: bytes, expiry_s: float | None) -> None:
        size = len(key) + len(value)
        self.bytes += size - self.sizes.get(key, 0)
        self.sizes[key] = size
        self._stage(key, value, expiry_s)

    def stats(self) -> dict:
        return {"prefix": self.prefix.decode("utf-8", "replace"), "source": self.source,
                "copied": self.copied, "keys": len(self.sizes), "bytes": self.bytes,
                "source_seq": self.source_seq, "snapshot_seq": self.snapshot_seq,
                "updates": self.updates, "queued": len(self._queued), "error": self.error,
                "received": self.received, "rows_taken": self.rows_taken,
                "paused_s": round(self.paused_s, 3),
                "source_gen": self.source_gen,
                "age_s": round(time.monotonic() - self.started_at, 3)}

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._draining is not None:
            self._draining.cancel()
            self._draining = None
            self.snapshot_seq = -1  # (closed before its queue was applied: not copied)
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None


class Hold:
    """The source's KVSETs for the keys that move, kept while the owner flips (module
    doc). ``moves(key)``: whether a key moves (the new routing gives it to another
    shard)."""

    def __init__(self, moves, seq: int, max_bytes: int = HOLD_MAX_BYTES):
        self.moves = moves
        self.seq = seq
        """The source's sequence when the hold began: no later update is under prefix."""
        self.frames: list[list[bytes]] = []
        self.bytes = 0
        self.max_bytes = max_bytes
        self.failed = ""
        self.started_at = time.monotonic()
        self.opened: list[int] = []
        """The shards whose ``Forwarder`` the hold opened (closed if it is released)."""
        self.sealed = False
        """The flip may be under way (``seal``): the hold ends only with the new routing
        or an explicit release, never by itself (``expired``)."""

    def expired(self, now: float, after_s: float = HOLD_SAFETY_S) -> bool:
        """An unsealed hold older than ``after_s``: its supervisor is gone (it would have
        released or sealed it within its bound); the server applies what it held."""
        return not self.sealed and now - self.started_at > after_s

    def keep(self, frames: list[bytes]) -> None:
        size = sum(map(len, frames))
        if self.bytes + size > self.max_bytes:
            if not self.failed:
                self.failed = f"more than {self.max_bytes} bytes of writes held"
            return
        self.frames.append(frames)
        self.bytes += size

    def stats(self) -> dict:
        return {"seq": self.seq, "held": len(self.frames), "sealed": self.sealed, "bytes": self.bytes, "failed": self.failed,
                "age_s": round(time.monotonic() - self.started_at, 3)}


SUBSCRIBED_WAIT_S = 2.0
"""How long a ``Forwarder`` waits for every collector's subscription before it sends."""


def _reader_state(reader) -> str:
    """What a failure message says of a ``zio.AsyncSocket``: messages read, paused, and
    whether messages wait in it now (a reader that missed its wake-up)."""
    if reader is None or reader.sock.closed:
        return "closed"
    try:
        waiting = bool(reader.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
    except zmq.ZMQError:
        waiting = False
    return (f"{reader.received} read, paused {reader.paused}, "
            f"messages waiting {waiting}, late reads {reader.late_reads}")


class Forwarder:
    """KVSETs for a prefix that moved away, sent on to its new shard's collectors (P+2 of
    both servers of the pair, as a client sends them): first the writes held during the
    move, then any that clients still routing by the old epoch send here. An XPUB, so
    nothing is sent before the collectors' subscriptions arrived (until then they wait,
    in order)."""

    def __init__(self, ctx: zmq.Context, collectors: list[str], security):
        self._sock = zmq.asyncio.Context.shadow(ctx).socket(zmq.XPUB)
        self._sock.linger = 0
        self._sock.sndhwm = 0
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # each collector's subscription
        security.connect_side(self._sock)
        for endpoint in collectors:
            self._sock.connect(endpoint)
        self.collectors = collectors
        self._waiting: list[list[bytes]] | None = []
        self.forwarded = 0
        self._task = asyncio.get_running_loop().create_task(self._open(len(collectors)))

    async def _open(self, count: int) -> None:
        try:
            async with asyncio.timeout(SUBSCRIBED_WAIT_S):
                for _ in range(count):
                    await self._sock.recv()  # one collector's subscription
        except TimeoutError:
            log.warning("move: not every collector of %s subscribed within %g s; "
                        "forwarding anyway", self.collectors, SUBSCRIBED_WAIT_S)
        waiting, self._waiting = self._waiting, None
        for frames in waiting or ():
            self._send(frames)
        log.info("move: forwarding to %s (%d writes waited)", self.collectors,
                 len(waiting or ()))

    def send(self, frames: list[bytes]) -> None:
        if self._waiting is not None:
            self._waiting.append(frames)
        else:
            self._send(frames)

    def _send(self, frames: list[bytes]) -> None:
        self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        self.forwarded += 1

    def close(self) -> None:
        self._task.cancel()
        self._sock.close(linger=0)

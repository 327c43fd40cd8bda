"""A Binary Star server's map, as the pair sees it: its term history, and the copy its
follower keeps (``PairMap`` is the ``clonemap.shards.replica.ReplicaSink`` of a pair's passive).

* **Terms.** Each takeover starts a term; the history ``(term, first sequence)`` of the
  map's terms is saved beside its data (``DataDir.save_terms``) and compared by a
  restarted server with its peer's (``clonemap.shards.persist.fork_point``): updates of its own
  that the active's map never had are kept in a ``dropped-*`` file, never served.
* **The copy.** The active's updates are applied with their sequences, logged, kept for
  resumes (a client that fails over resumes instead of taking a snapshot) and their
  UUIDs remembered (a resend is applied once). A whole copy (``install``) replaces the
  store, the history, the applied UUIDs and the generation; a durable server rewrites its
  data directory from it (``Persistence.replace``).
* **Needs-peer** (``bstar`` rule 8): a server whose map was unreadable (moved aside) serves
  only after it has installed and written its peer's; the snapshot of the installed map
  being whole on disk ends the rule (``on_compacted``).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from clonemap.shards.common.proto import chp
from clonemap.shards.persist.recovery import fork_point
from clonemap.shards.store import Store

if TYPE_CHECKING:
    from clonemap.shards.server import ShardServer

log = logging.getLogger("clonemap.shards.pair")


class PairMap:
    """One Binary Star server's map (see the module doc)."""

    def __init__(self, shard: str, *, term: Callable[[], int | None],
                 drop_parked: Callable[[], None], peer_copied: Callable[[], None]):
        """``term()``: the pair's current Binary Star term (None before it starts);
        ``drop_parked()``: what waits for the passive is never published (the map is
        replaced); ``peer_copied()``: the needs-peer rule ends (``bstar`` rule 8)."""
        self.shard = shard
        self._term, self._drop_parked, self._peer_copied = term, drop_parked, peer_copied
        self.server: ShardServer | None = None
        """The server whose map this is (``attach``)."""
        self.history: list[tuple[int, int]] = []
        """``(term, first sequence)`` for each takeover the map went through, oldest
        first."""
        self.recovered_term = 0
        self.saved_term = 0
        self.dropped_updates = 0
        self.needs_peer = False
        """The map was unreadable (moved aside): serve only after installing the peer's."""
        self.install_job = None
        """The compaction writing the map installed from the active (``install``)."""

    def attach(self, server: "ShardServer") -> None:
        self.server = server

    def took_over(self, term: int) -> None:
        """This term's updates start after the current sequence (what a restarted peer
        compares its log with)."""
        self.history.append((term, self.server.store.seq + 1))
        self.save_terms()

    def resumable(self, term: int, current: int, since: int) -> bool:
        """A client's updates up to ``since`` came from an active of ``term``: are they all
        in this map? In the current term, yes. From an earlier term, only those before
        the first sequence of the next term in this map's history: an active may have
        published an update its passive never received (replication is asynchronous);
        the passive that took over then gave that sequence to another update, and a
        resume from it would leave the client holding the lost one (a full snapshot,
        ``resume=0``, replaces it). A term this map does not know (later than its own,
        or one missing from its history: its updates may be missing here) is never
        resumed."""
        if term == current:
            return True
        known = False
        for took, first in self.history:
            if took == term:
                known = True
            elif took > term:
                return known and since < first
        return False

    @property
    def seq(self) -> int:
        return self.server.store.seq

    def apply(self, msg: chp.Kvpub, expiry_s: float | None) -> None:
        """The active's update, applied here with its sequence and logged; kept for
        resumes, so a client that fails over to this server resumes instead of taking a
        snapshot, and its UUID, so that a resend is applied once."""
        server = self.server
        server.store.apply(msg.key, msg.value, expiry_s)
        if msg.props and chp.STAGED in msg.props:  # a key a move stages on the shard
            server.note_staged(msg.key, msg.value)
        resendable = chp.is_resendable(msg.uuid)
        if server.persist is not None:  # the active's stream, with its sequences
            server.log_applied(msg.seq, msg.key, msg.value, expiry_s,
                               msg.uuid if resendable else b"")
        server.remember(msg.seq, msg.key, msg.uuid, msg.props, msg.value)
        if resendable:
            server.applied.add(msg.uuid, msg.seq)

    def staged_ranges(self, frames: list[bytes]) -> None:
        """The active's HUGZ that names staged sequences: this replica had them all."""

    def install(self, store: Store, generation: str = "",
                history: tuple[tuple[int, int], ...] = (), uuids: list = ()) -> None:
        """The replica is complete: serve ``store``, whose map is the active's
        ``generation`` (kept when the active sent none), term ``history`` and applied
        ``uuids`` (``[uuid, seq, ...]``, as of ``store.seq``). A durable
        server rewrites its data directory from it; updates of its own that the active's
        map never had (``persist.fork_point``) are kept in a ``dropped-*`` file."""
        server = self.server
        old_seq = server.store.seq
        self._drop_parked()
        server.replace_store(store, uuids)
        if server.persist is not None:
            fork = fork_point(self.history, list(history)) if history else None
            dropped_from = fork if fork is not None and fork <= old_seq else None
            replaced = server.persist.replace(store, generation or server.generation,
                                              dropped_from, server.applied.generations())
            if replaced is None:  # a disk error (reported: this server stops)
                return
            dropped, self.install_job = replaced
            if dropped:
                self.dropped_updates += dropped
                log.warning("shard %s: %d updates of this server's map (sequence %d..%d, "
                            "never in the active's map) were dropped; kept in %s/dropped-*",
                            self.shard, dropped, dropped_from, old_seq, server.persist.path)
        if history:
            self.history = list(history)
            self.save_terms()
        if generation and generation != server.generation:
            log.info("shard %s: map generation %s (the active's; was %s)", self.shard,
                     generation, server.generation)
            server.generation = generation

    def on_compacted(self, job) -> None:
        """A snapshot is whole on disk. The one that wrote the map installed from the
        active ends the ``needs-peer`` rule: this server holds a valid copy again."""
        if job is not self.install_job:
            return
        self.install_job = None
        if self.needs_peer and self.server.persist is not None:
            from clonemap.shards.persist.recovery import peer_copy_written

            peer_copy_written(self.server.persist.path)
            self.needs_peer = False
            self._peer_copied()
            log.warning("shard %s: the peer's map (%d keys, sequence %d) is written here: "
                        "this server holds a valid copy again", self.shard, len(self.server.store),
                        self.server.store.seq)

    def recovered(self, term: int, history: list[tuple[int, int]],
                  needs_peer: bool = False) -> None:
        """Before ``start``: the Binary Star term and term history persisted with the map
        just recovered (the start-up election compares (term, sequence)); ``needs_peer``:
        the directory's map was unreadable and moved aside (``bstar`` rule 8)."""
        self.recovered_term = self.saved_term = term
        self.history = list(history)
        self.needs_peer = needs_peer

    def save_terms(self) -> None:
        term = self._term()
        if self.server is None or self.server.persist is None or term is None:
            return
        self.saved_term = term
        try:
            self.server.persist.save_terms(term, self.history)
        except OSError as exc:
            log.error("shard %s: cannot save the term in %s: %s", self.shard,
                      self.server.persist.path, exc)

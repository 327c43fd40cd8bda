"""The snapshot (or resume) a shard agent is receiving from its current server.

The agent's DEALER delivers KVSYNC* then KTHXBAI (12/CHP). Each KVSYNC under the subtree
goes into fresh maps (values, properties, each key's sequence); one outside the subtree,
or one that does not decode, is counted and dropped. At KTHXBAI:

* a snapshot of which nothing could be applied (every KVSYNC malformed or outside the
  subtree) is ``SnapshotRejected``: nothing of it is installed, and the machine paces the
  next request like a timeout;
* a resume (``state.resuming``) is merged: with ``resume=1`` the updates after the
  agent's sequence are applied to a copy of its installed map (an empty value is a
  delete); with ``resume=0`` the server sent a whole snapshot instead (its deletes
  dropped);
* then ``SnapshotDone(seq, generation)``, and the agent installs ``take()``.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from clonemap.shards.common import zio
from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.proto import chp
from clonemap.client import shard_machine as sm

if TYPE_CHECKING:
    from clonemap.client.agent_view import AgentView

log = logging.getLogger("clonemap.client.agent")

_Kvsync = chp.Kvsync
_decode_snapshot = chp.decode_snapshot_liberal
_RESERVED = chp.RESERVED_KEYS
_RESERVED_WORDS = tuple(sorted(_RESERVED))
_take_rows = zio.compiled_function("take_rows")
"""The compiled path's row taker (None on the pure path, or an extension built before it)."""
_unpack_seq = chp.unpack_seq


class Incoming:
    """What one agent is receiving (see the module doc)."""

    def __init__(self, agent: "AgentView"):
        self.agent = agent
        self.map: dict[bytes, bytes] | None = None
        """The snapshot being received (None: none asked for, or it was rejected)."""
        self.props: dict[bytes, bytes] = {}
        self.seqs: dict[bytes, int] = {}
        self.messages = 0
        """Messages read on the DEALER (KVSYNC and KTHXBAI, valid or not): the agent's
        tick sees a snapshot still arriving by it."""
        self._base = 0
        """``messages`` when the current request went out."""
        self._dropped = 0
        self._first_error = ""
        self.rejected = 0
        self.resumes = self.resume_updates = self.resumes_refused = 0
        self.term: int | None = None
        """The ``term=`` of the last KTHXBAI (None: it named none)."""
        self.epoch = 0
        """The routing epoch its server followed when it took the request (KTHXBAI
        ``epoch=``; 0: not said)."""
        self.adopting = False
        """The request was an adoption (``adopt=``): rows with an empty value are
        deletes, as in a resume, until the KTHXBAI says whether it was answered."""
        self.adopted = False
        """The KTHXBAI said ``adopted=1``: the rows are the updates after the added
        shard's copy, on top of the keys the client holds in its other parts."""
        self.adoptions = 0
        self.adoption_rows = 0
        """The updates after the added shards' copies that adoptions received."""
        self.adoptions_refused = 0
        """Adoptions answered with a whole snapshot (a part was behind the copy, or the
        shard no longer had what it needed to check)."""
        self.whole = False
        """The map received is a whole snapshot (not a resume's merge, not an adoption)."""
        self._max_key = agent.limits.max_key
        self._max_value = agent.limits.max_value

    def begin(self, adopting: bool = False) -> None:
        """A request went out: receive into fresh maps (``adopting``: an adoption)."""
        self.map, self.props, self.seqs = {}, {}, {}
        self.term = None
        self.epoch = 0
        self.adopting, self.adopted = adopting, False
        self.whole = True
        self._base, self._dropped = self.messages, 0
        self._first_error = ""

    def take(self) -> tuple[dict, dict, dict]:
        """The received maps (values, properties, sequences), to install."""
        out = (self.map if self.map is not None else {}), self.props, self.seqs
        self.map, self.props, self.seqs = None, {}, {}
        return out

    def on_message(self, frames: list[bytes]) -> sm.Event | None:
        """A message on the DEALER: KVSYNC or KTHXBAI (hot path during a sync). The common
        KVSYNC (our servers': frames 2 and 3 empty, an 8-byte sequence, an ASCII key in the
        subtree within the limits, not a command word) is taken here without a decoder
        call; anything else goes through ``chp.decode_snapshot`` (``_on_message``), which
        names what is wrong."""
        incoming = self.map
        if incoming is not None and len(frames) == 5:
            key, seq, uuid, props, value = frames
            agent = self.agent
            if (not uuid and not props and len(seq) == 8 and key.startswith(agent.subtree)
                    and 0 < len(key) <= self._max_key and len(value) <= self._max_value
                    and key not in _RESERVED and key.isascii()):
                self.messages += 1
                if value or agent.state.resuming or self.adopting:  # a resume's delete
                    incoming[key] = value
                    self.seqs[key] = _unpack_seq(seq)[0]
                return None
        return self._on_message(frames)

    def take_rows(self, handle: int, limit: int) -> tuple[int, list[bytes] | None] | None:
        """The DEALER's ``bulk`` (``zio.AsyncSocket``): on the compiled path, while a
        snapshot is being received, up to ``limit`` of the rows ``on_message`` would take
        without a decoder call go into the maps in one C call (``_zframes.take_rows``,
        the same checks); the first other message comes back for ``on_message``. None:
        nothing to take this way (no sync in progress, or the pure path)."""
        incoming = self.map
        if incoming is None or _take_rows is None:
            return None
        agent = self.agent
        n, frames = _take_rows(handle, limit, zio.MAX_FRAMES, incoming, self.seqs,
                               agent.subtree, self._max_key, self._max_value, _RESERVED_WORDS,
                               agent.state.resuming or self.adopting)
        self.messages += n
        return n, frames

    def _on_message(self, frames: list[bytes]) -> sm.Event | None:
        agent = self.agent
        self.messages += 1
        incoming = self.map
        if incoming is None:
            agent.drops.drop("unexpected_snapshot", f"shard {agent.name}: no sync in progress")
            return None
        try:
            msg = _decode_snapshot(frames, agent.limits)
        except ProtocolError as exc:
            if frames and frames[0] != chp.KTHXBAI:
                self._dropped += 1
                self._first_error = self._first_error or str(exc)
            agent.drops.drop(exc.reason, f"shard {agent.name} DEALER: {exc}")
            return None
        subtree = agent.subtree
        if msg.__class__ is _Kvsync:
            key = msg.key
            if not key.startswith(subtree):
                self._dropped += 1
                agent.drops.drop("outside_subtree", f"shard {agent.name}: KVSYNC {key[:60]!r}")
            elif msg.value or agent.state.resuming or self.adopting:  # (a delete)
                incoming[key] = msg.value
                self.seqs[key] = msg.seq
                if msg.props:
                    self.props[key] = msg.props
            return None
        if msg.subtree != subtree and msg.subtree:
            # (an empty KTHXBAI subtree is the reference C server's: tolerated)
            agent.drops.drop("wrong_subtree", f"shard {agent.name}: KTHXBAI for "
                             f"{msg.subtree!r}, asked {subtree!r}")
            return None
        arrived = self.messages - self._base - 1  # KVSYNCs (not KTHXBAI)
        if arrived and self._dropped == arrived:
            self.rejected += 1
            reason = (f"{arrived} KVSYNC from {agent.server}, none valid (first: "
                      f"{self._first_error or 'outside the subtree'})")
            log.error("shard %s: snapshot rejected: %s", agent.name, reason)
            self.map = None  # nothing of it is installed
            agent.link.close_dealer()
            return sm.SnapshotRejected(reason)
        reply = chp.kthxbai_info(msg.props)
        if reply.refused:  # nothing of the subtree may be read by this identity
            if agent.on_read_refused is not None:
                agent.on_read_refused(agent)
            self.map = None
            return sm.SnapshotRejected(f"{agent.server} refused the snapshot: this "
                                       "client's identity may read nothing of "
                                       f"{subtree!r}")
        agent.narrowed = reply.narrowed
        self.term = reply.term
        self.epoch = reply.epoch
        if self.adopting:
            if reply.adopted and agent.lenders_intact():
                self.adopted = True
                self.whole = False
                self.adoptions += 1
                self.adoption_rows += arrived
            elif reply.adopted:  # a part it counted on took a snapshot since: ask again
                self.map = None
                agent.link.close_dealer()
                return sm.SnapshotRejected("an adoption answered after a part it counted "
                                           "on was replaced: a whole snapshot instead")
            else:  # a whole snapshot instead: its empty values are nothing
                self._merge_resume(False, arrived)
                self.resumes_refused -= 1  # (not a resume)
                self.adoptions_refused += 1
        elif agent.state.resuming:
            self._merge_resume(reply.resumed is True, arrived)
        return sm.SnapshotDone(msg.seq, agent.link.generation)

    def _merge_resume(self, resumed: bool, arrived: int) -> None:
        """At the KTHXBAI of a resume request: the updates after our sequence applied on
        a copy of the installed map (``resume=1``), or, when the server could not resume
        (``resume=0``), the full snapshot it sent instead (its deletes dropped)."""
        agent = self.agent
        incoming, props_in, seqs_in = self.map, self.props, self.seqs
        if not resumed:
            self.map = {k: v for k, v in incoming.items() if v}
            self.props = {k: p for k, p in props_in.items() if incoming.get(k)}
            self.seqs = {k: s for k, s in seqs_in.items() if incoming.get(k)}
            self.resumes_refused += 1
            return
        self.whole = False
        merged, props, seqs = dict(agent.map), dict(agent.props), dict(agent.seqs)
        for key, value in incoming.items():
            if value:
                merged[key] = value
                seqs[key] = seqs_in[key]
                if key in props_in:
                    props[key] = props_in[key]
                else:
                    props.pop(key, None)
            else:
                merged.pop(key, None)
                props.pop(key, None)
                seqs.pop(key, None)
        self.map, self.props, self.seqs = merged, props, seqs
        self.resumes += 1
        self.resume_updates += arrived
        log.info("shard %s: resumed with %d updates after sequence %d", agent.name, arrived,
                 agent.last_seq)

    def stats(self) -> dict:
        return {"snapshots_rejected": self.rejected, "adoptions": self.adoptions,
                "adoption_rows": self.adoption_rows,
                "adoptions_refused": self.adoptions_refused,
                "resumes": self.resumes,
                "resume_updates": self.resume_updates, "resumes_refused": self.resumes_refused}

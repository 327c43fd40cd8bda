"""The reactor's outbox: what a server has applied (and logged) but not yet published.

This is where a new maintainer reads **when an update may be published**. A write is
applied to the store, logged, and its KVPUB goes into the outbox (``add``, or the hot
path's ``updates += ...``); the reply a writer asked for goes in behind it (``reply``).
After the collector's batch, and at the end of any loop turn that applied outside one,
the reactor (``ShardServer.flush``) writes the log (and fsyncs it under ``fsync:
always``), then takes the outbox as one ``Batch`` (``take``) and asks its role what
happens to it. The role answers with a value:

* ``PUBLISH``: the KVPUBs go out in one burst, in sequence order, then the replies: an
  acknowledgement is never ahead of the update it reports, nor of its log write.
* ``HOLD``: the batch goes back (``restore``) and waits for the next flush: a leased
  server past its lease's deadline publishes nothing (``clonemap.shards.leased``).
* ``PARKED``: the role keeps the batch until the passive confirms it holds every update
  in it (synchronous replication, ``clonemap.shards.sync_link``), and publishes it then
  through the reactor's ``publish_batch``; the outbox counts it as parked meanwhile.

A standalone server, a relay and a pair without a lease never gate: every batch is
published. A batch whose log write failed is never published (``drop_replies``: its
writers are not answered, the server stops on its disk error).

``published_seq`` is the last sequence subscribers have been sent: the store's sequence
less what waits here or is parked. HUGZ announce it, never an update that is not out.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

KVPUB_FRAMES = 5
"""Frames of one KVPUB in ``Batch.updates``: key, sequence, UUID, properties, value
(``clonemap.shards.history.WIDTH``)."""


class Verdict(enum.Enum):
    """What a role decides for a batch (see the module doc)."""

    PUBLISH = "publish"
    HOLD = "hold"
    PARKED = "parked"


@dataclass(slots=True)
class Batch:
    """One flush's worth of the outbox."""

    last_seq: int
    """The store's sequence when the batch was taken: every update in it is at or below."""
    updates: list[bytes] = field(default_factory=list)
    """KVPUBs as one flat list of frames, ``KVPUB_FRAMES`` to an update, in order."""
    replies: list[list[bytes]] = field(default_factory=list)
    """KVREPLYs, each with the writer's identity first, in the order decided."""
    at: float = 0.0
    """When it was taken (the caller's clock)."""

    @property
    def count(self) -> int:
        """How many updates it holds."""
        return len(self.updates) // KVPUB_FRAMES

    def __bool__(self) -> bool:
        return bool(self.updates or self.replies)


class Outbox:
    """Updates and replies waiting for their flush, and the count of those parked."""

    __slots__ = ("updates", "replies", "parked")

    def __init__(self) -> None:
        self.updates: list[bytes] = []
        """Flat KVPUB frames (the hot path extends it in place: no tuple per update)."""
        self.replies: list[list[bytes]] = []
        self.parked = 0
        """Updates taken in a batch that a role parked (``park``) and has not yet
        published or dropped (``unpark``)."""

    def add(self, key: bytes, seq_frame: bytes, uuid: bytes, props: bytes,
            value: bytes) -> None:
        """One applied update's KVPUB, behind everything already here."""
        self.updates += key, seq_frame, uuid, props, value

    def reply(self, frames: list[bytes]) -> None:
        """A KVREPLY (identity first), sent after this flush's KVPUBs."""
        self.replies.append(frames)

    def __bool__(self) -> bool:
        return bool(self.updates or self.replies)

    @property
    def pending(self) -> int:
        """Updates waiting for the next flush."""
        return len(self.updates) // KVPUB_FRAMES

    def take(self, last_seq: int, at: float = 0.0) -> Batch:
        """Everything waiting, as one batch; the outbox is empty after."""
        batch = Batch(last_seq, self.updates, self.replies, at)
        self.updates, self.replies = [], []
        return batch

    def restore(self, batch: Batch) -> None:
        """A held batch goes back in front of whatever was added since."""
        if batch.updates:
            self.updates[:0] = batch.updates
        if batch.replies:
            self.replies[:0] = batch.replies

    def drop_replies(self) -> int:
        """The batch's log write failed: nobody is answered (the updates stay unpublished
        with the map, which the server stops serving). How many replies were dropped."""
        dropped = len(self.replies)
        self.replies = []
        return dropped

    def park(self, batch: Batch) -> None:
        """A role keeps ``batch`` until the passive holds it."""
        self.parked += batch.count

    def unpark(self, count: int) -> None:
        """``count`` parked updates were published or dropped."""
        self.parked = max(0, self.parked - count)

    def published_seq(self, store_seq: int) -> int:
        """The last sequence subscribers were sent, with the store at ``store_seq``."""
        return store_seq - len(self.updates) // KVPUB_FRAMES - self.parked

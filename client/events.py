"""What a client tells the application about its shards' servers: ``FailoverInfo`` (a
shard moved to another server of its pair: ``on_failover``) and ``ResetInfo`` (a shard's
server holds another map than the one this client had: data was lost: ``on_reset``), and
the policies for a loss (``reset_policy``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from clonemap.client.collector import ServerAddress
from clonemap.client.shard_machine import KEPT

__all__ = ["KEPT", "FailoverInfo", "KeyMeta", "ResetInfo"]


class ResetInfo(NamedTuple):
    """A shard's server holds another map than the one this client had: data was lost
    (both servers of a pair died, a standalone server restarted, or the new active did
    not have the last updates). Reported once per loss (``on_reset``)."""
    shard: str
    server: ServerAddress
    reason: str
    old_generation: str
    new_generation: str
    """Map generations (our servers announce them in HUGZ; "" when unknown)."""
    old_seq: int
    new_seq: int
    keys_before: int
    keys_after: int
    keys_lost: int
    """Keys this client held that the new map does not have."""
    changed: int
    """Keys whose value differs or that are new in the new map."""
    policy: str
    """"accept": the new map is installed; "keep": the old copy stays, read-only."""

    def describe(self) -> str:
        gens = (f"generation {self.old_generation or '?'} -> {self.new_generation or '?'}, "
                if self.old_generation != self.new_generation else "")
        return (f"shard {self.shard}: DATA LOSS at {self.server}: {self.reason} "
                f"({gens}sequence {self.old_seq} -> {self.new_seq}): {self.keys_lost} of "
                f"{self.keys_before} keys lost, {self.changed} new or changed; "
                f"reset_policy={self.policy!r}")


class FailoverInfo(NamedTuple):
    """A shard moved to another server of its pair (``on_failover`` callback).

    Reported twice per failover: when the shard switches (``resumed`` False: the old
    server was ``silent_s`` seconds silent, or refused or never answered the snapshot
    requests, as ``reason`` says), and when it has resumed (``resumed`` True: the new
    server's snapshot is installed; ``gap_s`` is the time from the last message heard
    from ``old`` to that moment; ``removed`` keys vanished and ``changed`` keys were new or
    different in the new snapshot, all told to watches). A chain of switches (the first
    server tried refused) reports each switch, and one ``resumed`` from the first ``old``.
    """
    shard: str
    old: ServerAddress
    new: ServerAddress
    reason: str
    silent_s: float
    resumed: bool = False
    gap_s: float | None = None
    removed: int = 0
    changed: int = 0


@dataclass(frozen=True)
class KeyMeta:
    """A key's metadata as this client holds it (``AsyncClone.meta``)."""
    key: str
    seq: int
    """The sequence of the write that last changed it (what ``if_seq`` compares)."""
    expires: float | None
    """Its absolute expiry (epoch seconds), None if it has no TTL."""
    props: dict[str, str]
    """The properties its value came with."""
    shard: str

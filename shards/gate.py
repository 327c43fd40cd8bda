"""The rights a server enforces at its entrances, by the User-Id each message carries.

A cluster with named identities (``security.clients``; ``clonemap.shards.common.rights``)
starts its servers and relays with ``--rights FILE``: every identity's read, write and
deny prefixes. ``Gate`` compiles each identity's role once into a ``Scope`` of byte
prefixes and answers, per message:

* the collector: may this writer write this key (``Scope.may_write``, cached per key);
* the snapshot service: which keys of a subtree this requester may read
  (``Scope.snapshot``: all of them, some, checked row by row, or none: refused);
* the publisher, whose XPUB applies subscriptions itself (``ZMQ_XPUB_MANUAL``): the
  prefixes a subscription becomes (``Scope.cover``): exactly the keys it asked for that
  the subscriber may read, never one more.

The cluster's own pairs (User-Id ``server``, the shared ``client``) and a cluster
without CURVE hold every right: ``Gate.scope`` answers None for them, and they take the
paths they took before rights existed. A User-Id this server does not know (a key
admitted under a newer config) holds no right.

Every refusal is counted by identity (``stats``), and the first of each kind is logged.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.proto import chp
from clonemap.shards.common.rights import RESERVED, Access, Rights, decide, longest_prefix

log = logging.getLogger("clonemap.shards.gate")

CACHE_KEYS = 65_536
"""Key starts whose write (or read) decision a scope remembers; past this the cache
starts over. A decision depends only on a key's first ``Scope.depth`` bytes (the longest
rule), so a role of a few prefixes has a few such starts: every check is a hit."""
MAX_COVER = 4_096
"""The most prefixes one subscription may become: a deny inside a readable subtree costs
up to 255 prefixes per byte of its depth. A subscription that would need more is
refused (never applied wider)."""

ALL, SOME, NONE = "all", "some", "none"
"""What a snapshot of a subtree holds for a requester (``Scope.snapshot``)."""

_HUGZ = chp.HUGZ


class Scope:
    """One identity's rights, compiled to byte prefixes (see the module doc)."""

    def __init__(self, name: str, rights: Rights):
        self.name = name
        self.rights = rights
        self.read = tuple(p.encode() for p in rights.read)
        self.write = tuple(p.encode() for p in rights.write)
        self.deny = tuple(p.encode() for p in rights.deny)
        self.writable: dict[bytes, bool] = {}
        """Decisions made, by key start (``may_write``): the collector reads it inline."""
        self._readable: dict[bytes, bool] = {}
        self.depth = max(map(len, self.read + self.write + self.deny), default=0)
        """The longest rule: no byte of a key past it changes a decision."""
        self.reads_anything = bool(self.read)

    # ------------------------------------------------------------------ keys
    def _cached(self, cache: dict[bytes, bool], grants: tuple[bytes, ...],
                key: bytes) -> bool:
        start = key[:self.depth]
        got = cache.get(start)
        if got is None:
            if len(cache) >= CACHE_KEYS:
                cache.clear()
            got = cache[start] = decide(start, grants, self.deny)
        return got

    def may_write(self, key: bytes) -> bool:
        return self._cached(self.writable, self.write, key)

    def may_read(self, key: bytes) -> bool:
        return self._cached(self._readable, self.read, key)

    def why_not(self, key: bytes, verb: str) -> str:
        """Why this identity may not ``verb`` (``read``/``write``) ``key``: the deny
        prefix that wins, or that no prefix grants it; and what it may."""
        grants = self.write if verb == "write" else self.read
        denied = longest_prefix(key, self.deny)
        shown = key[:80].decode("utf-8", "replace")
        if denied >= 0 and denied >= longest_prefix(key, grants):
            prefix = next(p for p in self.deny if len(p) == denied and key.startswith(p))
            return (f"forbidden: identity {self.name!r} may not {verb} {shown!r}: denied by prefix "
                    f"{prefix.decode('utf-8', 'replace')!r}")
        mine = " ".join(repr(p.decode("utf-8", "replace")) for p in grants) or "nothing"
        return (f"forbidden: identity {self.name!r} may not {verb} {shown!r}: no {verb} prefix "
                f"covers it (it may {verb} {mine})")

    # ------------------------------------------------------------------ subtrees
    def cover(self, topic: bytes) -> list[bytes] | None:
        """The prefixes that hold exactly the keys under ``topic`` this identity may
        read (``[topic]`` when it may read all of them, ``[]`` when none), or None when
        that takes more than ``MAX_COVER`` prefixes. A key that is itself the start of a
        deeper rule (``/a`` when ``/a/`` is denied) is left out: a prefix cannot take a
        key without the keys that extend it."""
        rules = [(p, True) for p in self.read] + [(p, False) for p in self.deny]
        out: list[bytes] = []
        if not self._cover(topic, rules, out):
            return None
        return out

    def _cover(self, p: bytes, rules: list[tuple[bytes, bool]], out: list[bytes]) -> bool:
        here = decide(p, self.read, self.deny)
        deeper = [(r, g) for r, g in rules if len(r) > len(p) and r.startswith(p)]
        if all(g == here for _, g in deeper):
            if here:
                out.append(p)
            return len(out) <= MAX_COVER
        by_byte: dict[int, list[tuple[bytes, bool]]] = {}
        for rule in deeper:
            by_byte.setdefault(rule[0][len(p)], []).append(rule)
        for byte in range(256):
            child = p + bytes((byte,))
            if byte in by_byte:
                if not self._cover(child, by_byte[byte], out):
                    return False
            elif here:
                out.append(child)
            if len(out) > MAX_COVER:
                return False
        return True

    def snapshot(self, subtree: bytes) -> str:
        """``ALL``: every key under ``subtree`` is readable; ``NONE``: not one is;
        ``SOME``: some are (the stream checks each row, ``may_read``)."""
        cover = self.cover(subtree)
        if cover == [subtree]:
            return ALL
        if cover == []:
            return NONE
        return SOME

    def subscription(self, topic: bytes) -> list[bytes] | None:
        """What a subscription to ``topic`` becomes on the publisher: its ``cover``, and
        ``HUGZ`` when the topic would take them and this identity may read anything
        (HUGZ carry no data); None when refused (too wide a cover)."""
        if topic == _HUGZ:
            return [topic] if self.reads_anything else []
        cover = self.cover(topic)
        if cover is None:
            return None
        if (_HUGZ.startswith(topic) and self.reads_anything
                and not any(_HUGZ.startswith(prefix) for prefix in cover)):
            cover.append(_HUGZ)
        return cover


NOTHING = Rights()
NOTHING_SCOPE = Scope("?", NOTHING)
"""A requester whose rights were not recorded: it may read nothing (never widened)."""


class Gate:
    """Every identity's ``Scope`` and the refusals counted by identity (the module doc).
    ``enforcing`` is False when the cluster names no identity: nothing is checked."""

    def __init__(self, access: Access | None = None, source: str = ""):
        self.access = access or Access({})
        self.source = source
        """The rights file it was loaded from ("" : none)."""
        self.enforcing = bool(self.access.identities) or bool(source)
        """A server started with a rights file checks rights until it stops, even when a
        reload names no identity (then identities hold no right: never every right)."""
        self.version = 0
        self.loaded_at = 0.0
        """When (epoch s) this server applied this version of the rights."""
        self._scopes: dict[str, Scope] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.reloads_failed = 0
        self.connections_closed = 0
        self.logged: set[tuple[str, str]] = set()

    @classmethod
    def load(cls, path: str | Path) -> "Gate":
        """The rights file a supervisor writes (``write_rights``); ``ConfigError``
        naming it when it cannot be read."""
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
            access = Access.from_doc(doc)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{path}: cannot read the rights file: {exc}",
                              field="--rights") from None
        gate = cls(access, str(path))
        gate.version = int(doc.get("version", 0))
        gate.loaded_at = time.time()
        return gate

    def take_counts(self, older: "Gate") -> None:
        """Keep ``older``'s counts (a reload resets none of them)."""
        self.counts = older.counts
        self.logged = older.logged
        self.reloads_failed = older.reloads_failed
        self.connections_closed = older.connections_closed

    def scope(self, user_id: str | None) -> Scope | None:
        """None: every right (no CURVE, the cluster's own pairs, or nothing enforced);
        else the identity's compiled rights (no right for an unknown name)."""
        if not self.enforcing or user_id is None or user_id in RESERVED:
            return None
        scope = self._scopes.get(user_id)
        if scope is None:
            rights = self.access.identities.get(user_id, NOTHING)
            scope = self._scopes[user_id] = Scope(user_id, rights)
        return scope

    def count(self, user_id: str, what: str, detail: str = "") -> None:
        """One refusal (or narrowing) of ``what`` for ``user_id``; the first of each
        kind is logged with ``detail``."""
        mine = self.counts.setdefault(user_id, {})
        mine[what] = mine.get(what, 0) + 1
        if (user_id, what) not in self.logged:
            self.logged.add((user_id, what))
            log.warning("access: %s (%s; later ones are counted in stats' access)",
                        detail or f"{what} for {user_id!r}", what)

    def stats(self) -> dict:
        return {"enforcing": self.enforcing, "version": self.version,
                "loaded_at": self.loaded_at, "reloads_failed": self.reloads_failed,
                "connections_closed": self.connections_closed,
                "identities": len(self.access.identities),
                "by_identity": {name: dict(c) for name, c in sorted(self.counts.items())},
                "refused_writes": sum(c.get("writes_refused", 0)
                                      for c in self.counts.values())}


def write_rights(path: str | Path, access: Access, version: int = 1) -> Path:
    """Write ``access`` as the rights file servers and relays load (``--rights``):
    atomically (a temporary file renamed over it), mode 0600."""
    import os

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    doc = {"version": version, **access.to_doc()}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(doc, out, indent=1, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    return path

"""Who may do what: named client identities, their roles, and the rights a role grants.

A config names identities (``security.clients``: ``NAME: {role: ROLE}``) and roles
(``security.roles``: ``ROLE: {read: [PREFIX...], write: [...], deny: [...], admin: BOOL}``).
Each identity has a CURVE key pair of its own (``supervisor keygen``); the ZAP handler
names a connection by its identity, and every message it sends carries that name as its
User-Id (``clonemap.shards.common.security``).

A key's right is decided by the most specific prefix that starts it: the longest of the
role's ``read`` (for reading) or ``write`` (for writing) prefixes and its ``deny``
prefixes. A deny of the same length wins; no prefix at all means no right. ``""``
starts every key. ``admin`` is the right to the control commands that change the
cluster (stop, restart, kill, and reading servers' logs).

Two User-Ids are not identities and hold every right, so that configs without
``security.clients`` run as before: ``server`` (the servers' and supervisors' pair) and
``client`` (the shared client pair). Without CURVE there is no User-Id: everyone is
such a client.

Enforced: ``admin`` by the control plane (``clonemap.supervisor.services``); the read and
write rights by every server and relay at each entrance (``clonemap.shards.gate``), from
the rights file ``supervisor start`` writes for them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from clonemap.shards.common.security import CLIENT, SERVER

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""An identity's or a role's name (it names key files too)."""
RESERVED = (SERVER, CLIENT)
"""User-Ids that are not identities (the cluster's own pairs)."""


@dataclass(frozen=True)
class Rights:
    """What one role grants (see the module doc)."""

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    admin: bool = False

    def may_read(self, key: str) -> bool:
        return decide(key, self.read, self.deny)

    def may_write(self, key: str) -> bool:
        return decide(key, self.write, self.deny)

    def describe(self) -> str:
        """One line: ``read /a/ /b/; write /a/; deny /a/x/; admin``."""
        parts = [f"{word} {' '.join(p or '(every key)' for p in prefixes)}"
                 for word, prefixes in (("read", self.read), ("write", self.write),
                                        ("deny", self.deny)) if prefixes]
        if self.admin:
            parts.append("admin")
        return "; ".join(parts) or "nothing"


EVERY_RIGHT = Rights(read=("",), write=("",), admin=True)
"""The rights of the cluster's own pairs (``server``, the shared ``client``)."""


def longest_prefix(key, prefixes) -> int:
    """The length of the longest of ``prefixes`` that starts ``key``; -1 for none. Keys
    and prefixes are both ``str`` (a config's rights) or both ``bytes`` (a server's
    compiled ones, ``clonemap.shards.gate``)."""
    best = -1
    for prefix in prefixes:
        if len(prefix) > best and key.startswith(prefix):
            best = len(prefix)
    return best


def decide(key, grants, deny) -> bool:
    """Whether ``grants`` give ``key`` (the module doc): the most specific prefix
    decides, a deny of the same length wins, no prefix is no right."""
    return longest_prefix(key, grants) > longest_prefix(key, deny)


@dataclass(frozen=True)
class Access:
    """Every identity's rights, by User-Id (what a control service asks), and the role
    each has (its name, for ``describe``)."""

    identities: Mapping[str, Rights]
    roles: Mapping[str, str] = field(default_factory=dict)

    def rights_of(self, user_id: str | None) -> Rights | None:
        """The rights of a connection named ``user_id`` by the ZAP handler: every right
        for none (no CURVE) and for the cluster's own pairs; None for a name this config
        does not know (a key admitted by a stale config: no right)."""
        if user_id is None or user_id in RESERVED:
            return EVERY_RIGHT
        return self.identities.get(user_id)

    def may_admin(self, user_id: str | None) -> bool:
        rights = self.rights_of(user_id)
        return rights is not None and rights.admin

    def changed(self, newer: "Access") -> set[str]:
        """The identities whose rights differ in ``newer`` (changed, added or removed)."""
        mine, theirs = self.identities, newer.identities
        return {name for name in set(mine) | set(theirs) if mine.get(name) != theirs.get(name)}

    def to_doc(self) -> dict:
        """Every identity's rights as JSON-able data (the rights file servers load)."""
        return {"identities": {name: {"role": self.roles.get(name, ""), "read": list(r.read),
                                      "write": list(r.write), "deny": list(r.deny),
                                      "admin": r.admin}
                               for name, r in sorted(self.identities.items())}}

    @classmethod
    def from_doc(cls, doc: dict) -> "Access":
        """``to_doc``'s data back (``ValueError``/``TypeError``/``KeyError`` if malformed)."""
        identities, roles = {}, {}
        for name, each in doc["identities"].items():
            if not NAME_RE.match(name) or name in RESERVED:
                raise ValueError(f"{name!r} is not an identity's name")
            prefixes = {word: tuple(str(p) for p in each.get(word, ()))
                        for word in ("read", "write", "deny")}
            identities[name] = Rights(**prefixes, admin=bool(each.get("admin", False)))
            roles[name] = str(each.get("role", ""))
        return cls(identities, roles)

    def describe(self) -> dict[str, dict]:
        """Each identity: its role and rights (``supervisor validate``)."""
        return {name: {"role": self.roles.get(name, ""), "read": list(r.read),
                       "write": list(r.write), "deny": list(r.deny), "admin": r.admin,
                       "rights": r.describe()}
                for name, r in sorted(self.identities.items())}


ENFORCED = ("identities: every server and relay enforces the roles' read, write and deny "
            "rights (writes, snapshots, resumes, subscriptions), the control plane admin "
            "(stop, restart, kill, logs)")
"""What a config with identities is told (``supervisor validate``, ``start``'s log)."""

OPEN = Access({})
"""No named identities: every admitted peer holds every right (``client``, ``server``)."""

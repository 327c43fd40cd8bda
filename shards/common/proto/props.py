"""Properties: the ``name=value\n`` lines of a CHP message's frame 3, and what our
extensions put there on a KTHXBAI (``kthxbai_props``). ``clonemap.shards.common.proto.chp``
re-exports every name here; this module imports nothing of it."""
from __future__ import annotations

from typing import NamedTuple

from clonemap.shards.common.errors import ProtocolError

RESUMED = b"resume=1\n"
FULL_AFTER_RESUME = b"resume=0\n"
NARROWED = b"narrowed=1\n"
"""A KTHXBAI whose snapshot (or resume) left out keys its requester may not read."""
ADOPTED = b"adopted=1\n"
"""A KTHXBAI that answers an adoption (``adopt=``): the updates after the copy that made
the shard, to apply on the keys the requester holds already."""
STAGED = b"staged=1\n"
"""A KVPUB of a key a move copies to a shard that already serves (resharding): the shard
stages the copy in its store (logged, replicated to its passive) before it owns the key.
Our clients never apply it (they hold the key from its owner, and take it from there at
the flip); a strict 12/CHP peer sees an ordinary update. Its deletes, when the move rolls
back, carry it too."""
REFUSED_READ = b"refused=read\n"
"""An empty KTHXBAI that refuses a snapshot of a subtree its requester may read nothing
of (``clonemap.shards.gate``)."""


def _fail(message: str, reason: str) -> ProtocolError:
    return ProtocolError(f"12/CHP message: {message}", protocol="12/CHP", command="",
                         reason=reason)


def parse_props(props: bytes) -> dict[str, str]:
    """``b"ttl=5\\nowner=a=b\\n"`` -> ``{"ttl": "5", "owner": "a=b"}`` (split on the first '=')."""
    out: dict[str, str] = {}
    if not props:
        return out
    for line in props.decode("utf-8").split("\n"):
        if line:
            name, _, value = line.partition("=")
            out[name] = value
    return out


def format_props(props: dict[str, str] | None) -> bytes:
    """The inverse of ``parse_props``. Rejects names with '=' or newlines, values with newlines."""
    if not props:
        return b""
    parts = []
    for name, value in props.items():
        name, value = str(name), str(value)
        if not name or "=" in name or "\n" in name or "\n" in value:
            raise _fail(f"property {name!r}={value!r} cannot be encoded", "bad_props")
        parts.append(f"{name}={value}\n")
    return "".join(parts).encode("utf-8")


def in_subtree(key: bytes, subtree: bytes) -> bool:
    """Whether ``key`` lies under ``subtree`` (the empty subtree holds every key)."""
    return key.startswith(subtree)


def drop_props(props: bytes, names: tuple[bytes, ...]) -> bytes:
    """Validated ``props`` (``name=value\\n`` lines) without the lines named ``names``."""
    starts = tuple(name + b"=" for name in names)
    if not any(start in props for start in starts):
        return props
    return b"".join(line + b"\n" for line in props.split(b"\n")[:-1]
                    if not line.startswith(starts))


def kthxbai_props(resumed: bool | None = None, term: int = 0, epoch: int = 0) -> bytes:
    """The properties of a KTHXBAI that answers a request with our extension frame (a
    plain ICANHAZ gets none, as 12/CHP has it): ``resume=1``/``resume=0`` for a resume
    request, and ``term=<T>`` (T > 0): a pair's Binary Star term, a standalone
    process's own. The client sends that term with its next resume, and a server resumes
    only a client whose updates are all in its own map (``clonemap.shards.roles``, ``resumable``)."""
    props = b"" if resumed is None else (RESUMED if resumed else FULL_AFTER_RESUME)
    if term:
        props += b"term=%d\n" % term
    if epoch:  # the routing epoch the server followed when it took the request
        props += b"epoch=%d\n" % epoch
    return props


class KthxbaiInfo(NamedTuple):
    resumed: bool | None
    """True/False: ``resume=1``/``resume=0``; None: not a reply to a resume."""
    term: int | None
    """The server's Binary Star term (``term=``), None if not given."""
    narrowed: bool = False
    """Keys the requester may not read were left out (``narrowed=1``)."""
    refused: bool = False
    """The requester may read nothing of the subtree (``refused=read``): no row came."""
    epoch: int = 0
    """The routing epoch the server followed when it took the request (``epoch=``; 0:
    not said)."""
    adopted: bool = False
    """An adoption was answered (``adopted=1``): the rows are the updates after the copy."""


def kthxbai_info(props: bytes) -> KthxbaiInfo:
    """What a KTHXBAI's properties say (``kthxbai_props``); unreadable values read as
    absent."""
    if not props:
        return KthxbaiInfo(None, None)
    fields = parse_props(props)
    resume = fields.get("resume")
    try:
        term = int(fields["term"]) if "term" in fields else None
    except ValueError:
        term = None
    try:
        epoch = int(fields.get("epoch", "0"))
    except ValueError:
        epoch = 0
    return KthxbaiInfo(None if resume is None else resume == "1", term,
                       fields.get("narrowed") == "1", fields.get("refused") == "read",
                       epoch, fields.get("adopted") == "1")

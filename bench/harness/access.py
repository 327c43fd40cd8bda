"""The security modes the benchmarks compare in one run (``bench curve``, ``bench fanout
--security``): ``plain`` TCP, ``curve`` (CURVE on every socket, the shared client pair)
and ``roles`` (CURVE plus access control, ``clonemap.shards.gate``: the load presents the
named identity ``bench``, whose rights every message is checked against)."""
from __future__ import annotations

import os

MODES = ("plain", "curve", "roles")
IDENTITY = "bench"
RIGHTS_FILE = "rights.json"


def make_keys(keys_dir: str | os.PathLike, rights: dict) -> None:
    """The cluster's pairs, the ``bench`` identity's pair, and the rights file that
    gives it ``rights`` (``read``, ``write``, ``deny``: lists of prefixes)."""
    from clonemap.shards.common.rights import Access, Rights
    from clonemap.shards.common.security import create_identity_keys, create_keys
    from clonemap.shards.gate import write_rights

    create_keys(keys_dir)
    create_identity_keys(keys_dir, [IDENTITY])
    granted = Rights(**{word: tuple(prefixes) for word, prefixes in rights.items()})
    write_rights(os.path.join(keys_dir, RIGHTS_FILE),
                 Access({IDENTITY: granted}, {IDENTITY: "bench"}))


def server_args(mode: str, keys_dir: str | os.PathLike) -> tuple[str, ...]:
    """A server's extra arguments in ``mode`` (keys made by ``make_keys``)."""
    if mode == "plain":
        return ()
    extra = ("--keys-dir", str(keys_dir))
    if mode == "roles":
        extra += ("--rights", os.path.join(keys_dir, RIGHTS_FILE))
    return extra


def identity(mode: str) -> str:
    """The identity the load presents in ``mode`` ("" : the shared client pair)."""
    return IDENTITY if mode == "roles" else ""

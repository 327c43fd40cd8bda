"""The root of every error clonemap raises, and the axes below it.

``ClonemapError`` is the one root; subclasses also derive from the matching builtin so a
caller may catch either (``except TimeoutError`` works for ``Timeout``). Errors carry
structured fields (shard, endpoint, sequence...) as attributes, not only in the text.
Exit codes for every command line (``chp``, ``supervisor``, ``python -m clonemap.shards``) are
decided in one place: ``Exit``.
"""
from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    """The exit codes of every clonemap command, one table."""

    OK = 0
    FAILED = 1
    """The operation failed or is not possible now (``status``: not every server
    RUNNING; ``kill`` of a FAILED server; a Binary Star fatal verdict)."""
    USAGE = 2
    """Bad arguments, a bad config, key, value, endpoint or SHARD/ROLE."""
    PORT_IN_USE = 3
    TIMEOUT = 4
    """Nobody answered before the deadline."""
    SLOW = 5
    """A watch fell behind (a slow consumer)."""
    NOT_FOUND = 6
    """No such key, no such server."""
    DISK = 7
    """A shard server stopped on a disk error (ENOSPC, EIO, EROFS, a failed fsync): it
    acknowledges nothing more, its peer serves, and the supervisor restarts it (without
    counting it as a crash) until its disk works again."""
    CONFLICT = 8
    """A conditional write was not applied: the key's sequence is not the one asked
    (``chp set --if-seq``/``--create``, ``chp del --if-seq``)."""
    FORBIDDEN = 9
    """The caller's identity does not hold the right (a write or a read outside its role's
    prefixes; a control command that changes the cluster, from an identity whose role
    lacks ``admin``)."""
    INTERRUPTED = 130


class ClonemapError(Exception):
    """Root of all clonemap errors."""

    exit_code = Exit.FAILED


class ProtocolError(ClonemapError, ValueError):
    """A message on the wire does not follow its protocol.

    ``protocol`` names the spec ("12/CHP", "18/MDP"), ``command`` the command if it was
    recognised, and ``reason`` a short machine-readable tag used as a drop-counter key.
    """

    def __init__(self, message: str, *, protocol: str = "", command: str = "",
                 reason: str = "malformed"):
        super().__init__(message)
        self.protocol = protocol
        self.command = command
        self.reason = reason


class ConfigError(ClonemapError, ValueError):
    """A configuration does not fit its schema or this host. ``field`` is the dotted path."""

    exit_code = Exit.USAGE

    def __init__(self, message: str, *, field: str = ""):
        super().__init__(message)
        self.field = field


class MissingExtra(ConfigError, ImportError):
    """A part of clonemap was used whose dependencies are not installed: the client alone
    is ``pip install clonemap``; ``extra`` names what adds the rest (``config`` to read a
    cluster config, ``metrics``, ``server`` for servers, relays and the supervisor)."""

    def __init__(self, what: str, extra: str, missing: list[str]):
        super().__init__(f"{what} needs clonemap's {extra!r} extra: pip install "
                         f"'clonemap[{extra}]' (missing: {', '.join(missing)})",
                         field=extra)
        self.extra = extra
        self.missing = missing


def require_extra(what: str, extra: str, modules: tuple[str, ...]) -> None:
    """Raise ``MissingExtra`` unless every one of ``modules`` can be imported."""
    from importlib.util import find_spec

    missing = [name for name in modules if find_spec(name) is None]
    if missing:
        raise MissingExtra(what, extra, missing)


CONFIG_MODULES = ("yaml", "pydantic", "psutil")
"""What the ``config`` extra installs: reading and planning a cluster config."""
SERVER_MODULES = (*CONFIG_MODULES, "prometheus_client", "rich")
"""What the ``server`` extra installs: servers, relays and the supervisor."""


class PortInUse(ClonemapError, OSError):
    """A port the process must bind is taken."""

    exit_code = Exit.PORT_IN_USE

    def __init__(self, message: str, *, endpoint: str = ""):
        super().__init__(message)
        self.endpoint = endpoint


class Timeout(ClonemapError, TimeoutError):
    """A deadline passed. ``what`` says what was awaited."""

    exit_code = Exit.TIMEOUT

    def __init__(self, message: str, *, what: str = "", deadline_s: float | None = None):
        super().__init__(message)
        self.what = what
        self.deadline_s = deadline_s


class SlowConsumer(ClonemapError):
    """A bounded queue between an agent and user code overflowed; ``dropped`` counts."""

    exit_code = Exit.SLOW

    def __init__(self, message: str, *, dropped: int = 0, shard: str = "",
                 delivered: int = 0):
        super().__init__(message)
        self.dropped = dropped
        self.shard = shard
        self.delivered = delivered
        """How many changes the consumer had taken before it fell behind (a watch)."""



class HandshakeRefused(ClonemapError, PermissionError):
    """A peer refused this process's ZeroMQ security handshake: waiting longer would not
    help. ``cause`` is one of ``HANDSHAKE_CAUSES``; ``endpoint`` the peer. The text says
    what a Python caller passes; the command lines say their own options (``chp``:
    ``--keys``/``--config``; ``supervisor``: a CONFIG or ``$CLONEMAP_KEYS``)."""

    def __init__(self, endpoint: str, cause: str):
        super().__init__(f"{endpoint}: {HANDSHAKE_CAUSES[cause]}")
        self.endpoint = endpoint
        self.cause = cause


HANDSHAKE_CAUSES = {
    "curve_required": "the cluster requires CURVE and this client has no keys (pass "
                      "keys=DIR or config=CONFIG)",
    "key_refused": "the server refused this client's key (it is not one of the "
                   "cluster's: use the keys `supervisor keygen` wrote for it)",
    "wrong_server_key": "the CURVE handshake failed: these keys are not this cluster's "
                        "(its server.key differs)",
    "curve_off": "the server does not use CURVE but this client offered it (drop the keys)",
}
"""Why a handshake failed, in words (``HandshakeRefused``); decided by
``clonemap.shards.common.handshake.cause_of``."""


def os_error_text(exc: OSError) -> str:
    """An OS error as an operator reads it: ``ENOSPC: No space left on device`` (the
    errno's name, then its text)."""
    import errno

    name = errno.errorcode.get(exc.errno, exc.errno) if exc.errno is not None else None
    return f"{name}: {exc.strerror or exc}"

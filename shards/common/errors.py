"""The root of every error clonemap raises, and the axes below it.

``ClonemapError`` is the one root; subclasses also derive from the matching builtin so a
caller may catch either (``except TimeoutError`` works for ``Timeout``). Errors carry
structured fields (shard, endpoint, sequence...) as attributes, not only in the text.
Exit codes for the command-line tools are decided in one place: ``EXIT_CODES``.
"""
from __future__ import annotations


class ClonemapError(Exception):
    """Root of all clonemap errors."""

    exit_code = 1


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

    exit_code = 2

    def __init__(self, message: str, *, field: str = ""):
        super().__init__(message)
        self.field = field


class PortInUse(ClonemapError, OSError):
    """A port the process must bind is taken."""

    exit_code = 3

    def __init__(self, message: str, *, endpoint: str = ""):
        super().__init__(message)
        self.endpoint = endpoint


class Timeout(ClonemapError, TimeoutError):
    """A deadline passed. ``what`` says what was awaited."""

    exit_code = 4

    def __init__(self, message: str, *, what: str = "", deadline_s: float | None = None):
        super().__init__(message)
        self.what = what
        self.deadline_s = deadline_s


class SlowConsumer(ClonemapError):
    """A bounded queue between an agent and user code overflowed; ``dropped`` counts."""

    exit_code = 5

    def __init__(self, message: str, *, dropped: int = 0, shard: str = ""):
        super().__init__(message)
        self.dropped = dropped
        self.shard = shard


EXIT_CODES = {
    "ok": 0,
    "error": ClonemapError.exit_code,
    "usage": 64,
    "config": ConfigError.exit_code,
    "port_in_use": PortInUse.exit_code,
    "timeout": Timeout.exit_code,
    "slow_consumer": SlowConsumer.exit_code,
    "not_found": 6,
}

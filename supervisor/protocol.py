"""The supervisor's control services as both sides see them: status codes, server
targets (``SHARD/ROLE``), log-line limits and the name of each server's stats service.
The services are ``clonemap.supervisor.services``; the commands' client side is
``clonemap.supervisor.control``.
"""
from __future__ import annotations

import re

OK, BAD_REQUEST, FORBIDDEN, NOT_FOUND, CONFLICT = b"200", b"400", b"403", b"404", b"409"
DEFAULT_LOG_LINES = 50
MAX_LOG_LINES = 10000
TARGET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}/(primary|backup)$")


def stats_service(shard: str, role: str) -> str:
    return f"shard.{shard}.{role}"


def check_target(text: str) -> str:
    """``"s0/primary"`` as given, or ValueError saying what a target looks like."""
    text = text.strip()
    if not TARGET_RE.fullmatch(text):
        raise ValueError(f"{text!r} is not SHARD/ROLE; expected a shard name, a slash "
                         "and primary or backup, such as s0/primary")
    return text

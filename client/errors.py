"""Client-specific errors, under the package root ``shards.errors.ClonemapError``."""
from __future__ import annotations

from shards.errors import ClonemapError


class NotRunning(ClonemapError, RuntimeError):
    """The client was used before ``start()`` or after ``close()``."""

"""Setup functions the worker processes of test_workers.py import by name (a spawned
process imports its handler; a test module's local function would not travel)."""
from __future__ import annotations

import os
import time
from pathlib import Path


def record(out_dir: str):
    """Append every change this worker sees to ``<out_dir>/<pid>.log``: kind, key, value."""
    path = Path(out_dir) / f"{os.getpid()}.log"
    f = path.open("a", buffering=1)

    def handle(change) -> None:
        value = change.value.decode() if isinstance(change.value, bytes) else ""
        f.write(f"{change.kind} {change.key} {value}\n")
    return handle


def slow(delay_s: float):
    """Take ``delay_s`` per change: a worker that cannot keep up."""
    def handle(change) -> None:
        time.sleep(delay_s)
    return handle


def flaky():
    """Raise on every key ending in 7; handle the others."""
    def handle(change) -> None:
        if change.kind == "put" and change.key.endswith("7"):
            raise ValueError(f"no {change.key}")
    return handle


def broken():
    raise RuntimeError("cannot open the database")

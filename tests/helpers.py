"""Helpers the test modules share (one home; fixtures are in ``conftest.py``).

* ``run_async``: an async test body on a uvloop loop, with a deadline.
* ``wait_stderr``: a child's stderr line, awaited (``Proc.wait_stderr``: its index).
* ``fill_disk``: a filler file that leaves about N bytes free on a small filesystem.
* ``watch_until``: a watch's changes up to the first that matches.
"""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any, Coroutine, TypeVar

import uvloop

T = TypeVar("T")

DEADLINE_S = 20.0


def run_async(coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
    """Run ``coro`` on a fresh uvloop loop (as the client runs), failing after
    ``timeout_s``."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(asyncio.wait_for(coro, timeout_s))


def wait_stderr(proc, text: str, timeout_s: float = DEADLINE_S, start: int = 0) -> int:
    """The index of ``proc``'s first stderr line (from ``start``) holding ``text``."""
    return proc.wait_stderr(text, start, timeout_s)


def acknowledged(writers: dict) -> dict[str, str]:
    """Stop every ``ledger_client.py write`` process in ``writers`` (prefix -> its
    process) and collect its ledger: each key it reported acknowledged, and its value
    (the key's number after the prefix)."""
    out = {}
    for prefix, proc in writers.items():
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "\n".join(proc.stderr[-20:])
        for line in proc.stdout:
            if line.startswith("ACK "):
                key = line.split()[1]
                out[key] = key[len(prefix):]
    return out


def fill_disk(disk: Path, leave: int) -> Path:
    """A filler file that leaves about ``leave`` bytes free on ``disk``."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    filler = disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


async def watch_until(watch, pred, timeout_s: float = DEADLINE_S) -> list:
    """Changes from ``watch`` up to and including the first that satisfies ``pred``;
    fails (saying what it saw) after ``timeout_s`` or if the watch ends first."""
    seen: list = []
    try:
        async with asyncio.timeout(timeout_s):
            async for change in watch:
                seen.append(change)
                if pred(change):
                    return seen
    except TimeoutError:
        raise AssertionError(f"watch: no matching change within {timeout_s} s; "
                             f"saw {seen}") from None
    raise AssertionError(f"watch ended; saw {seen}")

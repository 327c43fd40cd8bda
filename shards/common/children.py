"""Child processes run from synchronous code: their output lines, their end, their death.

One piece for the supervisor, the benchmarks, the demo and the tests, which all start
``python -m ...`` children, wait for a line such as ``READY ...`` and end them by PID:

* ``LinePump``: a daemon thread reads one of a child's pipes line by line, keeps every
  line in ``lines`` and (optionally) queues it for ``wait_for``;
* ``terminate``: SIGTERM, a grace period, then SIGKILL (SIGCONT first on request: a
  stopped process cannot act on SIGTERM); returns the exit code;
* ``die_with_parent``: a ``preexec_fn`` that has the kernel send the child SIGTERM when
  its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), optionally pinning it to cores.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable

from clonemap.shards.common import libc

_PR_SET_PDEATHSIG = 1
_LINUX = sys.platform.startswith("linux")
_prctl = libc.function("prctl") if _LINUX else None  # (before any fork: preexec_fn calls it)


class LinePump:
    """Reads ``stream`` (a child's stdout or stderr, bytes) on a daemon thread."""

    def __init__(self, stream: IO[bytes], *, queued: bool = True):
        self.lines: list[str] = []
        self.ended = False
        """The stream closed (the child exited, or closed it)."""
        self._queue: "queue.Queue[str | None] | None" = queue.Queue() if queued else None
        self._changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream: IO[bytes]) -> None:
        q = self._queue
        changed = self._changed
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with changed:
                self.lines.append(line)
                changed.notify_all()
            if q is not None:
                q.put(line)
        stream.close()
        with changed:
            self.ended = True
            changed.notify_all()
        if q is not None:
            q.put(None)  # end of stream

    def wait_index(self, match: Callable[[str], bool], start: int = 0,
                   timeout_s: float = 15.0) -> int | None:
        """The index of the first line at or after ``start`` that ``match``es, waiting
        for lines as they come (the reader thread notifies); None if the stream ended
        first. Raises ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        i = start
        with self._changed:
            while True:
                while i < len(self.lines):
                    if match(self.lines[i]):
                        return i
                    i += 1
                if self.ended:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no matching line within {timeout_s} s")
                self._changed.wait(remaining)

    def wait_for(self, match: Callable[[str], bool], timeout_s: float) -> str | None:
        """The next queued line that ``match``es; None if the stream ended first (the
        child exited). Raises ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                return None
            if match(line):
                return line
        raise TimeoutError(f"no matching line within {timeout_s} s")


def terminate(popen: subprocess.Popen, grace_s: float = 5.0, *, kill_wait_s: float = 5.0,
              resume: bool = False) -> int | None:
    """End ``popen`` by its PID: SIGTERM, wait ``grace_s``, then SIGKILL and wait
    ``kill_wait_s``. ``resume`` sends SIGCONT first. Returns the exit code."""
    if popen.poll() is None:
        try:
            if resume:
                os.kill(popen.pid, signal.SIGCONT)
            os.kill(popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.kill(popen.pid, signal.SIGKILL)
            popen.wait(kill_wait_s)
    return popen.returncode


def die_with_parent(parent_pid: int | None = None, cores: tuple[int, ...] = (),
                    background: bool = False) -> Callable[[], None] | None:
    """A ``preexec_fn`` (runs in the child between fork and exec: a C call and os calls,
    no locks): SIGTERM when the parent dies; exit at once if it is already gone; pin to
    ``cores`` if given. ``background``: the child starts at background CPU priority
    (``clonemap.shards.common.cpu_priority``): under ``SCHED_IDLE`` where it could come
    back (asked of this process, before the fork: its capabilities are the child's), and
    its autogroup at nice 19 where it leads a session of its own (``start_new_session``:
    the session is made before this runs); its interpreter's start and imports then take
    only the CPU that the rest leave. None where ``prctl`` does not exist and nothing is
    to be pinned."""
    parent_pid = os.getpid() if parent_pid is None else parent_pid
    if not _LINUX and not cores:
        return None
    idle, nice = False, b""
    if background:
        from clonemap.shards.common import cpu_priority

        idle = cpu_priority.can_return()
        nice = b"%d" % cpu_priority.AUTOGROUP_NICE

    def setup() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os._exit(1)
        if cores:
            os.sched_setaffinity(0, cores)
        if idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        if background and os.getsid(0) == os.getpid():
            try:  # (no privilege needed for 0 to 19; the root group refuses: left as is)
                group = os.open("/proc/self/autogroup", os.O_WRONLY)
                try:
                    os.write(group, nice)
                finally:
                    os.close(group)
            except OSError:
                pass

    return setup

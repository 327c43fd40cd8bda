"""One planned server and its successive runs: the process object owns its I/O (spawn,
the stdout pump, the pidfd that says it exited, its log file, rotation, signals), while
``clonemap.supervisor.runner.Runner`` decides (states, restarts, the policy).

* Pinning: the child is pinned between fork and exec (``sched_setaffinity`` in
  ``preexec_fn``, ``clonemap.shards.common.children.die_with_parent``), so every thread it starts
  inherits the planned cores; it also pins itself with ``--cpus``.
* No orphans: between fork and exec the child asks the kernel for SIGTERM when the
  supervisor dies (``prctl(PR_SET_PDEATHSIG)``).
* Own process group: a terminal's Ctrl-C goes to the supervisor alone.
* Exits are events: the child's pidfd is watched by the event loop (no polling).
* Output: stdout is a pipe read line by line (every line is copied to the log); stderr
  goes straight to ``RUN_DIR/logs/<shard>-<role>.log``, where the supervisor also writes
  its own ``--- supervisor:`` lines.
* Log rotation (copy-truncate, as the server holds its log open): a log over
  ``max_bytes`` is copied to ``<log>.1`` (older copies shift up to ``.<keep>``, the
  oldest is dropped) and truncated in place; the server's O_APPEND writes continue at
  the new end. Lines written between the copy and the truncation (microseconds) are lost.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

from clonemap.shards.common.children import die_with_parent
from clonemap.shards.common.config_values import format_cores
from clonemap.shards.common.placement import ServerPlan
from clonemap.supervisor.policy import Run, describe_exit

STARTING, RUNNING, BACKOFF, FAILED, STOPPING, STOPPED = (
    "STARTING", "RUNNING", "BACKOFF", "FAILED", "STOPPING", "STOPPED")


class ServerProcess:
    """One planned server and its successive runs."""

    def __init__(self, plan: ServerPlan, argv: list[str], log_path: Path):
        self.plan = plan
        self.argv = argv
        self.log_path = log_path
        self.name = plan.name
        self.state = STOPPED
        self.reason = "not started"
        self.history: list[Run] = []
        self.popen: subprocess.Popen | None = None
        self.pid: int | None = None
        self.ready: asyncio.Event = asyncio.Event()
        self.exited: asyncio.Event = asyncio.Event()
        self.exited.set()
        self.stop_requested = False
        self.restart_at: float | None = None
        self.stats: dict = {}
        self.stats_at: float | None = None
        self.updates_per_s: float | None = None
        self.disk_error = ""
        """Why its last run stopped on a disk error (its ``DISK_ERROR`` line), until a
        later run is READY."""
        self.disk_errors = 0
        """Runs that stopped on a disk error, since the supervisor started."""
        self.unreadable = ""
        """Its data directory could not be read at a start (its ``UNREADABLE`` line)."""
        self._restart_handle: asyncio.TimerHandle | None = None
        self.lock = asyncio.Lock()  # one operator command at a time per server
        self._pidfd: int | None = None
        self._out_buf = b""
        self._log = None

    # ----------------------------------------------------------------- I/O
    def spawn(self, on_line: Callable[["ServerProcess", str], None],
              on_exit: Callable[["ServerProcess", subprocess.Popen, int], None],
              background: bool = False) -> None:
        """Start a run: the child (in a session of its own, pinned and bound to die with
        this process between fork and exec), its stdout read line by line on the loop
        (each line copied to the log, then ``on_line``), and its pidfd watched
        (``on_exit`` once it has exited, with everything it printed read). Raises
        ``OSError`` if it cannot start."""
        loop = asyncio.get_running_loop()
        self.open_log()
        popen = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=self._log.fileno(), close_fds=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            # a session of its own: a terminal's Ctrl-C reaches the supervisor only, and
            # under the kernel's autogroup each server is a CPU group of its own, whose
            # weight an added shard's lowers while it copies (``cpu_priority``)
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid(), self.plan.cores, background))
        self.popen, self.pid = popen, popen.pid
        fd = popen.stdout.fileno()
        os.set_blocking(fd, False)
        self._out_buf = b""
        loop.add_reader(fd, self._read_stdout, popen, on_line)
        self._pidfd = os.pidfd_open(popen.pid)
        loop.add_reader(self._pidfd, self._reap, popen, on_line, on_exit)

    def _read_stdout(self, popen: subprocess.Popen,
                     on_line: Callable[["ServerProcess", str], None]) -> None:
        if popen.stdout is None or popen.stdout.closed:
            return
        try:
            data = os.read(popen.stdout.fileno(), 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_stdout(popen)
            return
        buf = self._out_buf + data
        *lines, self._out_buf = buf.split(b"\n")
        if self._log is not None and lines:
            self._log.write(b"".join(line + b"\n" for line in lines))
            self._log.flush()
        for line in lines:
            if self.popen is popen:
                on_line(self, line.decode("utf-8", "replace"))

    @staticmethod
    def _close_stdout(popen: subprocess.Popen) -> None:
        if popen.stdout is not None and not popen.stdout.closed:
            try:
                asyncio.get_running_loop().remove_reader(popen.stdout.fileno())
            except (ValueError, RuntimeError):
                pass
            popen.stdout.close()

    def _reap(self, popen: subprocess.Popen, on_line, on_exit) -> None:
        loop = asyncio.get_running_loop()
        if self._pidfd is not None:
            loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        code = popen.wait()  # the pidfd is readable: the child has exited
        self._read_stdout(popen, on_line)  # whatever it printed last
        self._close_stdout(popen)
        self.popen, self.pid = None, None
        on_exit(self, popen, code)

    def send(self, sig: int) -> None:
        """A signal to the current run (none: nothing)."""
        if self.popen is not None:
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:
                pass

    def kill_now(self) -> None:
        """SIGKILL the current run and reap it, blocking (the loop is gone)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def schedule_restart(self, delay_s: float, now: float, spawn: Callable[[], None]) -> None:
        self.restart_at = now + delay_s
        self._restart_handle = asyncio.get_running_loop().call_later(delay_s, spawn)

    def cancel_restart(self) -> None:
        if self._restart_handle is not None:
            self._restart_handle.cancel()
        self._restart_handle = None
        self.restart_at = None

    def open_log(self) -> None:
        if self._log is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")

    def close_log(self, last_note: str = "") -> None:
        if self._log is not None:
            if last_note:
                self.note(last_note)
            self._log.close()
            self._log = None

    @property
    def restarts(self) -> int:
        return max(0, len(self.history) - 1)

    @property
    def last_exit(self) -> str | None:
        for run in reversed(self.history):
            if run.exited_at is not None:
                return describe_exit(run)
        return None

    def note(self, text: str) -> None:
        """A ``--- supervisor:`` line in this server's log."""
        if self._log is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._log.write(f"{stamp} --- supervisor: {text}\n".encode())
            self._log.flush()

    def rotate_log(self, max_bytes: int, keep: int) -> bool:
        """Copy-truncate this server's log if it is ``max_bytes`` or more (see the module
        doc). Returns whether it rotated."""
        if self._log is None or keep < 1:
            return False
        fd = self._log.fileno()
        if os.fstat(fd).st_size < max_bytes:
            return False
        path = self.log_path
        for i in range(keep - 1, 0, -1):
            older = path.with_name(f"{path.name}.{i}")
            if older.exists():
                os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
        os.ftruncate(fd, 0)
        self.note(f"log rotated; the previous lines are in {path.name}.1")
        return True

    def describe(self, now: float) -> dict:
        """This server as JSON-able data (the status row; stats come from its service)."""
        p = self.plan
        stats = self.stats
        out = {"shard": p.shard, "role": p.role, "name": self.name, "state": self.state,
               "reason": self.reason, "pid": self.pid, "cores": list(p.cores),
               "cores_text": format_cores(p.cores), "nic": p.nic, "address": p.address,
               "port": p.port, "restarts": self.restarts, "last_exit": self.last_exit,
               "disk_error": self.disk_error, "disk_errors": self.disk_errors,
               "unreadable": self.unreadable,
               "log": str(self.log_path),
               "restart_in_s": (round(max(0.0, self.restart_at - now), 3)
                                if self.restart_at is not None else None),
               "bstar": _bstar_state(stats), "seq": stats.get("seq"),
               "keys": stats.get("keys"), "updates_per_s": self.updates_per_s,
               "stats_age_s": (round(now - self.stats_at, 3)
                               if self.stats_at is not None else None)}
        if stats:
            out["stats"] = stats
        return out

    def clear_stats(self) -> None:
        """Forget the figures of the current run: it starts, stopped serving or exited."""
        self.stats, self.stats_at, self.updates_per_s = {}, None, None

    def set_stats(self, stats: dict, now: float) -> None:
        """Fresh figures from the server's own stats service; updates/s from the change
        of its ``updates`` (or ``seq``) counter since the previous figures."""
        if stats.get("pid") not in (None, self.pid):
            return  # an answer from the previous run
        if self.state != RUNNING or self.disk_error:
            # an answer sent before this run stopped serving (its disk error, its exit)
            # arriving after: it would show a Binary Star state the server left
            return
        counter = stats.get("updates", stats.get("seq"))
        old = self.stats.get("updates", self.stats.get("seq"))
        if (self.stats_at is not None and counter is not None and old is not None
                and now > self.stats_at and counter >= old):
            self.updates_per_s = round((counter - old) / (now - self.stats_at), 1)
        self.stats, self.stats_at = stats, now


def _bstar_state(stats: dict) -> str | None:
    for key in ("bstar", "bstar_state", "state"):
        value = stats.get(key)
        if isinstance(value, dict):
            value = value.get("state")
        if isinstance(value, str):
            return value.upper()
    if "active" in stats and stats.get("role") == "standalone":
        return "ACTIVE" if stats["active"] else "INACTIVE"
    if str(stats.get("role", "")).startswith("relay"):
        return "RELAY" if stats.get("active") else "SYNCING"
    return None

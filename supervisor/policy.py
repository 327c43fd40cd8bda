"""Restart policy: ``decide(history, now, cfg) -> Action``, pure (no clock, no processes).

The supervisor keeps, per server, the history of its runs (``Run``: when it started,
when and how it exited, whether it was asked to stop, whether an operator started it)
and asks this module what to do whenever a run ends, and again whenever it wants (the
answer only depends on its arguments, so asking twice is harmless)::

    last run                                           action
    none yet                                           Restart(0)       "not started yet"
    still running                                      Running
    exited after a stop was requested                  Leave            (stopped on purpose)
    exited with a code in cfg.give_up_exit_codes       GiveUp           (bad config or
      (2 = usage or ConfigError: a restart cannot fix them)              arguments)
    exited with Exit.DISK (7: a disk error)            Restart(delay_s) never GiveUp:
                                                       retried until the disk works, the
                                                       delay capped at disk_retry_cap_s
    the crash_limit-th crash within crash_window_s     GiveUp           "crashed 5 times in
      (counted back from the last exit)                                  60 s": FAILED
    any other exit (any code, 0 included, or a signal) Restart(delay_s)

    delay_s = min(backoff_cap_s, backoff_initial_s * backoff_factor ** (streak - 1)),
              counted from the exit (less whatever time has passed since)
    streak  = crashes in a row, counting back from the last one, stopping after a run
              that lasted stable_after_s or more (a long healthy run resets the back-off)

Decisions:

* A crash is any exit nobody asked for, whatever its exit code: a shard server is meant
  to run until stopped. A ``supervisor kill`` (SIGKILL drill) is not a requested stop, so
  it is restarted and counts as a crash.
* GiveUp is sticky: the crash window is measured back from the last exit, not from
  ``now``, so waiting does not turn a FAILED server back into a restart. Only a run with
  ``manual=True`` (an operator's ``supervisor restart``, or the initial start) begins a
  fresh count: runs before the latest manual start are ignored.
* exit code 3 (PortInUse) is retried with back-off: the port may be freed; if not, the
  crash limit ends it.
* exit code 7 (``Exit.DISK``: a full, read-only or failing disk, or a failed fsync) is not
  a crash: the server stopped on purpose so that its peer serves, and it must come back
  by itself once space returns (no operator restart), so it is retried for as long as it
  takes, every ``disk_retry_cap_s`` at most, and never counts towards FAILED.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Sequence, Union

from clonemap.shards.common.errors import Exit

BACKOFF_INITIAL_S = 0.5
BACKOFF_FACTOR = 2.0
BACKOFF_CAP_S = 30.0
CRASH_LIMIT = 5
CRASH_WINDOW_S = 60.0
STABLE_AFTER_S = 10.0
DISK_RETRY_CAP_S = 5.0
GIVE_UP_EXIT_CODES = frozenset({Exit.USAGE})
_EXIT_MEANING = {Exit.USAGE: "usage or configuration error"}


@dataclass(frozen=True, slots=True)
class Run:
    """One run of a server. ``exit_code`` follows Popen: negative means killed by -code."""

    started_at: float
    exited_at: float | None = None
    exit_code: int | None = None
    stop_requested: bool = False
    manual: bool = False


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    backoff_initial_s: float = BACKOFF_INITIAL_S
    backoff_factor: float = BACKOFF_FACTOR
    backoff_cap_s: float = BACKOFF_CAP_S
    crash_limit: int = CRASH_LIMIT
    crash_window_s: float = CRASH_WINDOW_S
    stable_after_s: float = STABLE_AFTER_S
    give_up_exit_codes: frozenset[int] = GIVE_UP_EXIT_CODES
    disk_retry_cap_s: float = DISK_RETRY_CAP_S

    def __post_init__(self):
        problems = []
        if not self.backoff_initial_s >= 0:
            problems.append(f"backoff_initial_s {self.backoff_initial_s!r} must be >= 0")
        if not self.backoff_factor >= 1:
            problems.append(f"backoff_factor {self.backoff_factor!r} must be >= 1")
        if not self.backoff_cap_s >= self.backoff_initial_s:
            problems.append(f"backoff_cap_s {self.backoff_cap_s!r} must be >= "
                            f"backoff_initial_s")
        if self.crash_limit < 1:
            problems.append(f"crash_limit {self.crash_limit!r} must be >= 1")
        if not self.crash_window_s > 0:
            problems.append(f"crash_window_s {self.crash_window_s!r} must be > 0")
        if not self.stable_after_s > 0:
            problems.append(f"stable_after_s {self.stable_after_s!r} must be > 0")
        if problems:
            raise ValueError("; ".join(problems))


DEFAULT_POLICY = PolicyConfig()


# ------------------------------------------------------------------------- actions

@dataclass(frozen=True, slots=True)
class Restart:
    delay_s: float
    attempt: int       # crashes in a row so far (0 for the first start)
    reason: str


@dataclass(frozen=True, slots=True)
class Running:
    pass


@dataclass(frozen=True, slots=True)
class Leave:
    reason: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


Action = Union[Restart, Running, Leave, GiveUp]


def describe_exit(run: Run) -> str:
    """``"exited with code 1"``, ``"killed by SIGKILL"``, ``"running"``."""
    if run.exited_at is None:
        return "running"
    code = run.exit_code
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def backoff_s(streak: int, cfg: PolicyConfig = DEFAULT_POLICY) -> float:
    """The delay before restart number ``streak`` of a crash streak (1 = first crash)."""
    if streak < 1:
        return 0.0
    delay = cfg.backoff_initial_s
    for _ in range(streak - 1):  # a loop, not **, so a huge streak cannot overflow
        delay *= cfg.backoff_factor
        if delay >= cfg.backoff_cap_s:
            return cfg.backoff_cap_s
    return min(delay, cfg.backoff_cap_s)


def decide(history: Sequence[Run], now: float, cfg: PolicyConfig = DEFAULT_POLICY) -> Action:
    """What to do about a server whose runs, oldest first, are ``history``."""
    if not history:
        return Restart(0.0, 0, "not started yet")
    last = history[-1]
    if last.exited_at is None:
        return Running()
    if last.stop_requested:
        return Leave(f"stopped on request ({describe_exit(last)})")
    if last.exit_code in cfg.give_up_exit_codes:
        meaning = _EXIT_MEANING.get(last.exit_code, "fatal exit code")
        return GiveUp(f"{describe_exit(last)} ({meaning}): a restart cannot fix it")
    first = 0
    for i in range(len(history) - 1, -1, -1):
        if history[i].manual:
            first = i
            break
    runs = history[first:]
    if last.exit_code == Exit.DISK:
        streak = 0
        for run in reversed(runs):
            if run.exit_code != Exit.DISK:
                break
            streak += 1
        delay = min(backoff_s(streak, cfg), cfg.disk_retry_cap_s)
        return Restart(max(0.0, delay - max(0.0, now - last.exited_at)), streak,
                       f"disk error; retried until the disk works (try {streak})")
    window_start = last.exited_at - cfg.crash_window_s
    crashes = sum(1 for r in runs if r.exited_at is not None and not r.stop_requested
                  and r.exited_at >= window_start and r.exit_code != Exit.DISK)
    if crashes >= cfg.crash_limit:
        return GiveUp(f"crashed {crashes} times in {cfg.crash_window_s:g} s "
                      f"(last: {describe_exit(last)})")
    streak = 0
    for run in reversed(runs):
        if run.exited_at is None or run.stop_requested:
            break
        streak += 1
        if run.exited_at - run.started_at >= cfg.stable_after_s:
            break
    delay = backoff_s(streak, cfg)
    waited = max(0.0, now - last.exited_at)
    return Restart(max(0.0, delay - waited), streak,
                   f"{describe_exit(last)}; restart {streak} in a row")

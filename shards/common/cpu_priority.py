"""This process's CPU priority for background work: every one of its threads under the
kernel's ``SCHED_IDLE`` policy (``background(True)``), and back to ``SCHED_OTHER``.

A thread under ``SCHED_IDLE`` weighs 3 against a normal thread's 1,024 (sched(7)): on a
busy core it gets about 0.3% of the time, and a normal thread that wakes takes the core
from it at once. A shard that a routing change adds copies its keys in the CPU the
serving shards and their clients leave (``supervisor reshard --copy-priority``). At
``nice 19`` it would still take about 1.5%.

That holds among the threads of one CPU group. Under the kernel's autogroup (on in many
distributions) each session is a group, weighed against the others by the group's own
nice value, whatever its threads' policies: a ``SCHED_IDLE`` loop in one session took half
of a core from a busy loop in another here. So a server that leads its own session (the
supervisor starts each so) also sets its group's nice to 19 (``autogroup_nice``), which
needs no privilege, and back to 0.

Going back needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` soft limit of 20 (the kernel
treats leaving ``SCHED_IDLE`` as raising the priority), so a process goes to the
background only where it can come back (``can_return``): a server left idle after the
copy would serve its shard on leftovers. Linux only; elsewhere nothing changes.
"""
from __future__ import annotations

import os
import resource

_CAP_SYS_NICE = 23
"""The capability's bit in ``CapEff`` (linux/capability.h)."""


def can_return() -> bool:
    """Whether this process may leave ``SCHED_IDLE`` once in it."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    if soft == resource.RLIM_INFINITY or soft >= 20:
        return True
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def threads() -> list[int]:
    """The thread ids of this process (Linux: ``/proc/self/task``)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # (0: the calling thread)


def background(on: bool) -> str:
    """Every thread of this process to ``SCHED_IDLE`` (``on``) or back to ``SCHED_OTHER``
    (threads it starts later inherit their creator's). "" once done, else why not (this
    process could not come back: nothing is changed; or the kernel refused)."""
    if not hasattr(os, "SCHED_IDLE"):
        return "this platform has no SCHED_IDLE"
    if on and not can_return():
        return ("not at background priority: leaving it again would need CAP_SYS_NICE "
                "or RLIMIT_NICE 20")
    policy = os.SCHED_IDLE if on else os.SCHED_OTHER
    refused = ""
    for tid in threads():
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:
            refused = refused or f"thread {tid}: {exc.strerror or exc}"
    return refused


AUTOGROUP_NICE = 19
"""The nice value of this process's autogroup while in the background."""
COPY_PRIORITIES = ("idle", "normal")
"""``supervisor reshard --copy-priority``: an added shard's servers copy in the
background (``idle``), or as any server (``normal``)."""


def _own_autogroup_nice() -> int | None:
    """The nice value of this process's own autogroup; None where it has none
    (``own_autogroup``)."""
    if os.getsid(0) != os.getpid():
        return None
    try:  # (empty for the kernel's root group: init, or a process in init's session)
        with open("/proc/self/autogroup", "rb") as group:
            return int(group.read().split()[-1])
    except (OSError, ValueError, IndexError):  # (a kernel without autogroup; the root group)
        return None


def own_autogroup() -> bool:
    """Whether this process leads its session, and so has a kernel autogroup of its own
    (Linux with ``CONFIG_SCHED_AUTOGROUP``): its nice value weighs this process's
    threads against other sessions' (sched(7), "The autogroup feature"). Not init, nor a
    session leader the kernel left in its root group: that group's nice cannot be set."""
    return _own_autogroup_nice() is not None


def autogroup_nice(nice: int) -> str:
    """This process's autogroup to ``nice`` (0 to 19 need no privilege). "" once done or
    where it has none of its own (``own_autogroup``), else why not (``EAGAIN``: the kernel
    takes one change per 100 ms from a process without ``CAP_SYS_ADMIN``)."""
    if not own_autogroup():
        return ""
    try:
        with open("/proc/self/autogroup", "wb", buffering=0) as group:
            group.write(b"%d" % nice)
    except OSError as exc:
        return f"autogroup nice {nice}: {exc.strerror or exc}"
    return ""


def started_in_background() -> bool:
    """Whether this process was started at background CPU priority
    (``clonemap.shards.common.children.die_with_parent``): its thread under
    ``SCHED_IDLE``, or its own autogroup at ``AUTOGROUP_NICE`` (a nice an operator gave
    a session of their own is theirs: a server leaves it alone)."""
    return is_background() or _own_autogroup_nice() == AUTOGROUP_NICE


def is_background(pid: int = 0) -> bool:
    """Whether ``pid``'s thread (0: the calling one) runs under ``SCHED_IDLE``."""
    return hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(pid) == os.SCHED_IDLE

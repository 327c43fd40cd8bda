"""``clonemap.shards.common.cpu_priority``: every thread of a process to ``SCHED_IDLE`` and
back, as the kernel reports it per thread (``/proc/self/task``), and a process that could
not come back (no ``CAP_SYS_NICE``, ``RLIMIT_NICE`` 0) left as it is, with the reason."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from clonemap.shards.common import cpu_priority


def _policies() -> dict[int, int]:
    return {tid: os.sched_getscheduler(tid) for tid in cpu_priority.threads()}


def test_every_thread_goes_to_the_background_and_comes_back():
    assert cpu_priority.can_return(), "the suite runs as root (CAP_SYS_NICE)"
    stop = threading.Event()
    started = [threading.Thread(target=stop.wait) for _ in range(3)]
    for t in started:
        t.start()
    try:
        assert set(_policies().values()) == {os.SCHED_OTHER}
        assert cpu_priority.background(True) == ""
        policies = _policies()
        assert len(policies) >= 4 and set(policies.values()) == {os.SCHED_IDLE}, policies
        later = threading.Thread(target=stop.wait)  # (a thread started now inherits it)
        later.start()
        started.append(later)
        assert os.sched_getscheduler(later.native_id) == os.SCHED_IDLE
        assert cpu_priority.is_background()
        assert cpu_priority.background(False) == ""
        assert set(_policies().values()) == {os.SCHED_OTHER}
        assert not cpu_priority.is_background()
    finally:
        cpu_priority.background(False)
        stop.set()
        for t in started:
            t.join()


_AS_NOBODY = """
import json, os, resource
from clonemap.shards.common import cpu_priority  # (before the interpreter's files are out of reach)
limit = int(os.environ["NICE_LIMIT"])
resource.setrlimit(resource.RLIMIT_NICE, (limit, limit))
os.setgid(65534)
os.setuid(65534)
went = cpu_priority.background(True)
now = os.sched_getscheduler(0)
back = cpu_priority.background(False)
print(json.dumps({"can_return": cpu_priority.can_return(), "went": went, "now": now,
                  "back": back, "after": os.sched_getscheduler(0)}))
"""


def test_a_process_that_could_not_come_back_stays_at_normal_priority():
    """Not root, ``RLIMIT_NICE`` 0 (the default): it refuses, saying why, and changes
    nothing (a server left idle after its copy would serve on leftovers). (A limit of 20
    cannot be tried here: raising the hard limit needs ``CAP_SYS_RESOURCE``, which this
    host's root lacks.)"""
    if os.geteuid() != 0:
        pytest.fail("the suite runs as root: this test drops to another user")
    out = subprocess.run([sys.executable, "-c", _AS_NOBODY], capture_output=True,
                         text=True, timeout=30, check=True,
                         env={**os.environ, "NICE_LIMIT": "0"})
    got = json.loads(out.stdout)
    assert not got["can_return"]
    assert "CAP_SYS_NICE" in got["went"] and got["now"] == os.SCHED_OTHER
    assert got["back"] == "" and got["after"] == os.SCHED_OTHER


_AUTOGROUP = """
import json
from clonemap.shards.common import cpu_priority
def group():  # (the kernel prints nothing for the root group, where init's session is)
    with open("/proc/self/autogroup") as f:
        return (f.read().split() or [""])[-1]
before = group()
went = cpu_priority.autogroup_nice(19)
during = group()
back = cpu_priority.autogroup_nice(0)
print(json.dumps({"own": cpu_priority.own_autogroup(), "before": before, "went": went,
                  "during": during,
                  "back": back, "after": group()}))
"""


@pytest.mark.parametrize("own_session", [True, False])
def test_a_session_leader_weighs_its_own_autogroup_and_no_other(own_session):
    """A process that leads its session (a server, as the supervisor starts it) sets its
    autogroup's nice to 19 and back to 0. One that does not would set its whole
    session's (the caller's terminal, a test runner): it leaves it alone, whatever group
    that session is in: a runner under init's session (a CI container) is in the kernel's
    root group, whose ``/proc/self/autogroup`` is empty."""
    if not os.path.exists("/proc/self/autogroup"):  # (a kernel without autogroup)
        assert not cpu_priority.own_autogroup() and cpu_priority.autogroup_nice(19) == ""
        return
    out = subprocess.run([sys.executable, "-c", _AUTOGROUP], capture_output=True,
                         text=True, timeout=30, check=True, start_new_session=own_session)
    got = json.loads(out.stdout)
    assert got["own"] is own_session and got["went"] == got["back"] == ""
    unchanged = (got["before"], got["before"])
    assert (got["during"], got["after"]) == (("19", "0") if own_session else unchanged), got


_STARTED = """
import json, os
from clonemap.shards.common import cpu_priority
try:
    with open("/proc/self/autogroup") as f:
        group = (f.read().split() or [""])[-1]
except FileNotFoundError:  # (a kernel without autogroup)
    group = None
print(json.dumps({"started": cpu_priority.started_in_background(), "group": group,
                  "policy": os.sched_getscheduler(0)}))
"""


@pytest.mark.parametrize("background", [True, False])
def test_a_child_started_in_the_background_runs_so_from_its_first_instruction(background):
    """``die_with_parent(..., background=True)``, the ``preexec_fn`` of an added shard's
    server (``supervisor.runner.add_shard``): the child's interpreter starts under
    ``SCHED_IDLE`` with its session's autogroup at nice 19, and the server sees it
    (``started_in_background``: its ``in_background`` from the start, so that it comes
    back when told). Without it, nothing changes."""
    from clonemap.shards.common.children import die_with_parent

    grouped = os.path.exists("/proc/self/autogroup")
    out = subprocess.run([sys.executable, "-c", _STARTED], capture_output=True, text=True,
                         timeout=30, check=True, start_new_session=True,
                         preexec_fn=die_with_parent(os.getpid(), (), background))
    got = json.loads(out.stdout)
    assert got == ({"started": True, "group": "19" if grouped else None,
                    "policy": os.SCHED_IDLE} if background else
                   {"started": False, "group": "0" if grouped else None,
                    "policy": os.SCHED_OTHER}), got


def test_a_session_an_operator_niced_is_not_taken_for_the_background():
    """A server that leads a session whose autogroup its operator set to another nice
    (here 5) was not started in the background: it will not set that nice back to 0."""
    if not os.path.exists("/proc/self/autogroup"):
        assert not cpu_priority.started_in_background()
        return

    def nice_5() -> None:  # (between fork and exec, in the new session)
        group = os.open("/proc/self/autogroup", os.O_WRONLY)
        os.write(group, b"5")
        os.close(group)

    out = subprocess.run([sys.executable, "-c", _STARTED], capture_output=True, text=True,
                         timeout=30, check=True, start_new_session=True, preexec_fn=nice_5)
    assert json.loads(out.stdout) == {"started": False, "group": "5",
                                      "policy": os.SCHED_OTHER}, out.stdout

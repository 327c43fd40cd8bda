"""How the supervisor tells an added shard's servers that still start from ones that are
stuck (``clonemap.supervisor.runner.progress``): the time their main threads ran, to
the nanosecond, and whether one of them waits for a core. Real processes in each state:
a process at background priority on a saturated host runs a few milliseconds a second
(measured here beside four busy loops: 4 ms every 1.5-2 s), less than the 10 ms tick in
which user and system time are counted, so the earlier measure saw no progress in 0.3 s
and the growth was refused ("did not start") with four test workers on two cores."""
from __future__ import annotations

import signal
import time
import types

from clonemap.supervisor.runner import Progress, progress

SPIN = "while True: pass"


def _look(proc) -> tuple[float, bool]:
    return progress([proc])


def _wait_state(proc, states: set[str]) -> None:
    """Until the kernel reports ``proc`` in one of ``states`` (``/proc/PID/stat``)."""
    while True:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in states:
                return
        time.sleep(0.005)


def test_a_busy_process_is_runnable_and_its_time_grows_below_a_tick(procs):
    busy = procs.python("-c", SPIN)
    _wait_state(busy, {"R"})
    ran, runnable = _look(busy)
    assert runnable
    while True:  # (nanoseconds: any run at all shows, not only a 10 ms tick's worth)
        later, _ = _look(busy)
        if later != ran:
            break
    assert later > ran


def test_a_sleeping_or_stopped_process_is_neither_runnable_nor_progressing(procs):
    # (asleep once it said so: not caught in a wait of its interpreter's start)
    idle = procs.python("-c", "import time; print('asleep', flush=True); time.sleep(60)",
                        ready="asleep")
    _wait_state(idle, {"S"})
    first = _look(idle)
    assert first[1] is False and _look(idle) == first
    spinning = procs.python("-c", SPIN)
    _wait_state(spinning, {"R"})
    spinning.signal(signal.SIGSTOP)
    try:
        _wait_state(spinning, {"T"})
        stopped = _look(spinning)
        assert stopped[1] is False and _look(spinning) == stopped
        # (together: their times add up, and neither waits for a core)
        both = progress([idle, spinning])
        assert both == (first[0] + stopped[0], False)
    finally:
        spinning.signal(signal.SIGCONT)


def test_a_process_that_is_gone_or_never_started_counts_nothing(procs):
    gone = procs.python("-c", "pass")
    assert gone.wait(30) == 0
    assert progress([gone, types.SimpleNamespace(pid=None)]) == (0.0, False)


def test_a_look_says_whether_the_time_grew_since_the_last_one(procs):
    busy = procs.python("-c", SPIN)
    _wait_state(busy, {"R"})
    watch = Progress([busy])
    while not watch.look()[0]:  # (it runs: its time grows between two looks)
        pass
    busy.signal(signal.SIGSTOP)
    try:
        _wait_state(busy, {"T"})
        watch.look()  # (what it ran before it stopped)
        assert watch.look() == (False, False)
    finally:
        busy.signal(signal.SIGCONT)

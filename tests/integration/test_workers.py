"""client.workers: a watch handed to worker processes, routed by key, against a real
shard server. What is checked: every change of a key reaches one worker, in the order the
client applied them; markers reach every worker; a worker that cannot keep up fails the
watch by its rules (SlowConsumer, counted), never silently; a handler that raises is
counted and its worker goes on; a bad setup is a clear error; every worker process is
ended by PID.
"""
from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from clonemap.client.api import Clone
from clonemap.client.workers import Workers
from clonemap.shards.common.errors import SlowConsumer

HEARTBEAT_S = 0.2
DEADLINE_S = 30.0


@pytest.fixture
def server(procs, port_base):
    procs.python("-m", "clonemap.shards", "--port", str(port_base), "--heartbeat-s", str(HEARTBEAT_S),
                 "--log-level", "warning", ready="READY")
    return f"tcp://127.0.0.1:{port_base}"


def gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                   for p in pids)


def test_each_key_goes_to_one_worker_in_order_and_markers_to_all(server, tmp_path):
    with Clone(server, silence_timeout_s=3 * HEARTBEAT_S) as clone:
        for i in range(50):                 # in the map before the watch: a snapshot chunk
            clone.set(f"/w/k{i:03d}", b"0")
        clone.set("/w/k000", b"0", wait=True)
        with Workers(clone, "/w/", "workers_handlers:record", workers=3,
                     args=(str(tmp_path),)) as pool:
            for n in range(1, 21):          # 20 rounds over 50 keys, values counting up
                for i in range(50):
                    clone.set(f"/w/k{i:03d}", str(n).encode())
            clone.set("/w/k049", b"20", wait=True)   # once more: the last write is known
            total = 50 * 21 + 1
            deadline = time.monotonic() + DEADLINE_S
            while sum(pool.handled) < total and time.monotonic() < deadline:
                pool.wait_idle(0.5)
            stats = pool.stats()
            pids = pool.pids
        assert gone(pids), "close() ends every worker process"
    assert sum(stats["handled"]) == total and stats["errors"] == [0, 0, 0]
    assert stats["handed"] == stats["handled"] and all(stats["handled"])
    logs = {p.stem: p.read_text().splitlines() for p in Path(tmp_path).glob("*.log")}
    assert len(logs) == 3
    owner: dict[str, str] = {}
    for pid, lines in logs.items():
        assert lines.count("synced /w/ ") == 1, (pid, lines[:3])   # every worker, once
        seen: dict[str, list[int]] = {}
        for line in lines:
            kind, key, value = line.split(" ")
            if kind != "put":
                continue
            assert owner.setdefault(key, pid) == pid, f"{key} reached two workers"
            seen.setdefault(key, []).append(int(value))
        for key, values in seen.items():   # a key's changes in the order they were made
            assert values == sorted(values) and values[-1] == 20, (key, values)
    assert len(owner) == 50
    index = {str(pid): i for i, pid in enumerate(pids)}
    assert all(pool.worker_of(k.encode()) == index[pid] for k, pid in owner.items())


def test_a_worker_that_cannot_keep_up_fails_the_watch_with_the_counts(server):
    errors: list[BaseException] = []
    with Clone(server, silence_timeout_s=3 * HEARTBEAT_S) as clone:
        pool = Workers(clone, "/s/", "workers_handlers:slow", workers=1, args=(0.02,),
                       batch=4, queue_batches=1, capacity=20, on_error=errors.append,
                       stop_timeout_s=2.0)
        try:
            for i in range(3000):
                clone.set(f"/s/{i}", b"x")
            deadline = time.monotonic() + DEADLINE_S
            while pool.error is None and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(SlowConsumer):
                pool.wait_idle(1.0)
            assert errors and errors[0] is pool.error
            assert "fell behind" in str(pool.error) and pool.error.dropped > 0
            # bounded: what the workers hold is at most two batches of 4 per worker pipe
            # end plus the one being handled; the rest was dropped and counted
            assert sum(pool.handed) <= 3000 - pool.error.dropped
            pids = pool.pids
        finally:
            pool.close()
        assert gone(pids)


def test_a_handler_that_raises_is_counted_and_its_worker_goes_on(server):
    with Clone(server, silence_timeout_s=3 * HEARTBEAT_S) as clone:
        with Workers(clone, "/f/", "workers_handlers:flaky", workers=2) as pool:
            for i in range(100):
                clone.set(f"/f/{i}", b"v")
            clone.set("/f/99", b"w", wait=True)   # a second change of /f/99: 101 in all
            deadline = time.monotonic() + DEADLINE_S
            while sum(pool.handled) < 101 and time.monotonic() < deadline:
                pool.wait_idle(0.5)
            assert sum(pool.handled) == 101 and sum(pool.errors) == 10
            assert pool.error is None


def test_a_bad_setup_is_a_clear_error_and_leaves_no_process(server):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with Clone(server, silence_timeout_s=3 * HEARTBEAT_S) as clone:
        with pytest.raises(ValueError, match="module-level function"):
            Workers(clone, "", lambda: print, workers=1)
        with pytest.raises(ModuleNotFoundError):
            Workers(clone, "", "no_such_module:setup", workers=1)
        with pytest.raises(ValueError, match="module:function"):
            Workers(clone, "", "workers_handlers", workers=1)
        with pytest.raises(RuntimeError, match="cannot open the database"):
            Workers(clone, "", "workers_handlers:broken", workers=2)
    after = {p.pid for p in psutil.Process().children(recursive=True)
             if p.status() != "zombie"}
    assert after <= before


# The caller, in a process of its own: a client and a pool of two workers; it prints their
# PIDs, then waits to be killed.
CALLER = r'''
import sys, threading
sys.path.insert(0, sys.argv[2])
from clonemap.client.api import Clone
from clonemap.client.workers import Workers

clone = Clone(sys.argv[1], silence_timeout_s=0.6)
pool = Workers(clone, "/gone/", "workers_handlers:flaky", workers=2)
print("PIDS", *pool.pids, flush=True)
threading.Event().wait()
'''


# The same caller, which then forks a child (no exec) that lives on after it.
FORKING_CALLER = CALLER.replace("threading.Event().wait()", '''import os, signal
child = os.fork()
if child == 0:
    signal.pause()
    os._exit(0)
print("CHILD", child, flush=True)
threading.Event().wait()''')


def test_workers_end_when_the_process_that_started_them_is_killed(server, procs):
    """SIGKILL of the caller (no ``close()``): each worker sees its lifeline's end of file
    and exits. (Before, they waited on their pipes for ever, children of init.)"""
    caller = procs.python("-c", CALLER, server, str(Path(__file__).parent), ready="PIDS",
                          timeout_s=DEADLINE_S)
    pids = [int(p) for p in next(line for line in caller.stdout
                                 if line.startswith("PIDS")).split()[1:]]
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids), pids
    workers = [psutil.Process(p) for p in pids]
    caller.popen.kill()
    caller.popen.wait(10)
    gone_, alive = psutil.wait_procs(workers, timeout=DEADLINE_S)
    assert not alive, [p.pid for p in alive]


def test_a_child_forked_by_the_caller_does_not_keep_the_workers_alive(server, procs):
    """The caller forks (``os.fork``, no exec: a copy of its file descriptors, lifelines
    included), then is killed. The child lives on, and the workers still end: the child
    closed its copies of the lifelines at the fork. (Until 2026-12-01 they lived as long
    as the child.)"""
    caller = procs.python("-c", FORKING_CALLER, server, str(Path(__file__).parent),
                          ready="CHILD", timeout_s=DEADLINE_S)
    lines = list(caller.stdout)
    pids = [int(p) for p in next(line for line in lines if line.startswith("PIDS")).split()[1:]]
    child = psutil.Process(int(next(line for line in lines
                                    if line.startswith("CHILD")).split()[1]))
    try:
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids), pids
        workers = [psutil.Process(p) for p in pids]
        caller.popen.kill()
        caller.popen.wait(10)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        gone_, alive = psutil.wait_procs(workers, timeout=DEADLINE_S)
        assert not alive, [p.pid for p in alive]
        assert child.is_running()  # (it outlived them: its copies did not hold them)
    finally:
        child.kill()  # ours: the caller we started forked it
        child.wait(10)

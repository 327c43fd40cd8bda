"""The status row of a server that reported a disk error, before its exit is seen.

A server that stops on a disk error prints ``DISK_ERROR`` and then exits; the
supervisor reads the line before it reaps the process. In between (milliseconds on
an idle host, longer on a loaded one) a stats answer the server sent while it was still
ACTIVE may arrive. CI once caught exactly that: ``status`` named the stopped primary
ACTIVE right after its ``DISK ERROR`` event, while the backup was taking over.

The interleaving is forced here with a real child on the supervisor's real runner: it
prints READY, then DISK_ERROR when the test signals it, and stays alive (as a server
finishing its close would) until it is stopped.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from test_supervisor_cli import write_config

from clonemap.shards.common.config import load_config
from clonemap.shards.common.hostfacts import local_host_facts
from clonemap.shards.common.placement import plan
from clonemap.supervisor.process import RUNNING
from clonemap.supervisor.runner import Runner, ServerArgs

CHILD = r"""
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
print(f"READY shard host=127.0.0.1 port=1 pid={os.getpid()} role=primary", flush=True)
signal.sigwait({signal.SIGUSR1})
print("DISK_ERROR shard=s0 role=primary port=1 EIO: Input/output error (test)", flush=True)
signal.sigwait({signal.SIGUSR1})  # until SIGTERM from the runner's stop
"""


def _runner(tmp_path: Path, events: list[str], seen: asyncio.Event) -> Runner:
    config, control = write_config(tmp_path, "1shard.yaml")
    the_plan = plan(load_config(str(config)), local_host_facts(), source=str(config))

    def on_event(text: str) -> None:
        events.append(text)
        if "DISK ERROR" in text:
            seen.set()

    runner = Runner(the_plan, tmp_path / "run", ServerArgs(control=control, heartbeat_s=1.0,
                                                            parent_pid=os.getpid()),
                    on_event=on_event)
    for proc in runner.servers.values():
        proc.argv = [sys.executable, "-c", CHILD]
    return runner


@pytest.mark.timeout(60)
def test_a_server_that_reported_a_disk_error_shows_no_binary_star_state(tmp_path):
    async def scenario() -> None:
        events: list[str] = []
        seen = asyncio.Event()
        runner = _runner(tmp_path, events, seen)
        try:
            assert await runner.start_all(timeout_s=20) == []
            proc = runner.servers["s0/primary"]
            active = {"pid": proc.pid, "role": "primary", "bstar_state": "ACTIVE", "seq": 7}
            proc.set_stats(active, runner.clock())
            assert proc.describe(runner.clock())["bstar"] == "ACTIVE"

            os.kill(proc.pid, signal.SIGUSR1)  # it prints DISK_ERROR, and does not exit
            await asyncio.wait_for(seen.wait(), 20)
            row = proc.describe(runner.clock())
            assert row["state"] == RUNNING and row["pid"] is not None  # not reaped yet
            assert row["disk_error"].startswith("EIO") and row["disk_errors"] == 1
            assert row["bstar"] is None, row  # what it said before no longer holds
            assert row["seq"] is None and row["stats_age_s"] is None

            proc.set_stats(active, runner.clock())  # that run's late answer
            assert proc.describe(runner.clock())["bstar"] is None

            other = runner.servers["s0/backup"]  # a server without the error still takes them
            other.set_stats({"pid": other.pid, "bstar_state": "PASSIVE"}, runner.clock())
            assert other.describe(runner.clock())["bstar"] == "PASSIVE"
        finally:
            await runner.stop_all()
        assert all(p.pid is None for p in runner.servers.values())

    asyncio.run(scenario())

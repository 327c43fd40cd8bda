"""A growth whose added shard, copying at background CPU priority (the default), is
starved of CPU: beside four test workers on two cores such a server runs a few
milliseconds a second, and a step the supervisor asked of it went unanswered past the
supervisor's wait (5 s), so the growth was rolled back ("RequestTimeout: MDP request to
service 'shard.s2.primary' ... no reply within 5 s"). The supervisor now waits on a
server of its own host at background priority while it runs or waits for a core
(``clonemap.supervisor.resharding``'s ``_patience``; a stopped one still fails the step:
``test_a_frozen_source_peer_fails_the_move_before_any_write_is_held``).

The starvation is made, not hoped for: at *started* both of the added shard's servers go
into a CPU cgroup of their own (the kernel's CFS bandwidth control) allowed 1 ms of CPU a
second, runnable but held, and stay there until the supervisor says it waits on them."""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import pytest

from clonemap.shards.common.routing import ShardMap
from test_durable_cluster import settled
from test_routing_epoch import (_growth_ready, _reshard, at_epoch,
                                each_key_once_on_its_owner)
from test_supervisor_cli import cli, wait_status

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")


@contextlib.contextmanager
def starved(pids: list[int], name: str):
    """``pids`` in a CPU cgroup allowed 1 ms each second (cgroup v1's ``cpu`` controller,
    else v2's ``cpu.max``), made for the block and removed after it, the processes back
    where they were."""
    if (V1 / "cpu.cfs_quota_us").exists():
        root = V1
        group = V1 / name
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("1000000")
        (group / "cpu.cfs_quota_us").write_text("1000")
    else:
        assert "cpu" in (V2 / "cgroup.controllers").read_text().split(), \
            "this test needs a CPU cgroup controller (v1 or v2), as root"
        root = V2
        group = V2 / name
        group.mkdir()
        (group / "cpu.max").write_text("1000 1000000")
    try:
        for pid in pids:
            (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):  # (one that ended)
                (root / "cgroup.procs").write_text(str(pid))
        group.rmdir()


pytestmark = pytest.mark.timeout(240)


def _growth_at_started(procs, tmp_path):
    """A 2-shard cluster with 200 keys, and its growth to 3 shards waiting at *started*,
    the supervisor's wait for each reply 0.5 s (5 s for users)."""
    config, control, sup, _, three, ledger = _growth_ready(
        procs, tmp_path, "started", 200, pause=True, env={"CLONEMAP_RESHARD_ASK_S": "0.5"})
    reshard = _reshard(procs, config, three)
    sup.wait_line("RESHARD_PAUSED phase=started", timeout_s=60)
    rows = wait_status(control, lambda r: sum(n.startswith("s2/") for n in r) == 2)
    added = [r["pid"] for n, r in rows.items() if n.startswith("s2/")]
    return config, control, sup, reshard, ledger, added


def _waits_on_it(sup, reshard, mark: int) -> None:
    """The supervisor says it waits on an added server that has not answered."""
    try:
        at = sup.wait_stderr("at background priority has not answered yet", start=mark,
                             timeout_s=60)
    except AssertionError as exc:  # (what the change said, if it ended meanwhile)
        raise AssertionError(f"reshard: {reshard.stdout[-3:]} {reshard.stderr[-3:]}\n"
                             f"{exc}") from None
    assert re.search(r"s2/\w+ at background priority has not answered yet \("
                     r"(waiting for a core|it ran meanwhile)\); waiting on",
                     sup.stderr[at]), sup.stderr[at]


def test_an_added_shard_starved_of_cpu_while_it_copies_is_waited_on_not_rolled_back(
        procs, tmp_path, zctx):
    config, control, sup, reshard, ledger, added = _growth_at_started(procs, tmp_path)
    mark = len(sup.stderr)
    with starved(added, f"clonemap-test-{os.getpid()}"):
        (tmp_path / "run" / "reshard.continue").touch()
        _waits_on_it(sup, reshard, mark)
    assert reshard.wait(120) == 0, reshard.stdout[-5:] + reshard.stderr[-5:]
    assert "routing epoch 2" in "\n".join(reshard.stdout), reshard.stdout
    rows = wait_status(control, lambda r: len(r) == 6 and settled(r))
    each_key_once_on_its_owner(zctx, rows, ledger, ShardMap(3))


def test_an_operator_aborts_a_growth_that_waits_on_a_starved_added_shard(
        procs, tmp_path, zctx):
    """The wait has no bound of its own (a starved server is not a stuck one), so
    ``supervisor reshard --abort`` ends it at its next look, the servers still starved:
    the change rolls back, nothing lost."""
    config, control, sup, reshard, ledger, added = _growth_at_started(procs, tmp_path)
    mark = len(sup.stderr)
    with starved(added, f"clonemap-test-{os.getpid()}"):
        (tmp_path / "run" / "reshard.continue").touch()
        _waits_on_it(sup, reshard, mark)
        asked = cli("reshard", str(config), "--abort")
        assert asked.returncode == 0 and "rolls back" in asked.stdout, asked.stderr
        assert reshard.wait(60) == 1, reshard.stdout[-5:]  # (its servers still starved)
    # the wait ended at its first look after the abort: no server waited on after it
    aborted = sup.wait_stderr("reshard: abort asked in phase", start=mark)
    assert not [line for line in sup.stderr[aborted:] if "has not answered yet" in line]
    assert any("aborted by the operator" in line for line in reshard.stderr), (
        reshard.stderr[-3:])
    rows = wait_status(control, lambda r: len(r) == 4 and settled(r) and at_epoch(1)(r))
    each_key_once_on_its_owner(zctx, rows, ledger, ShardMap(2))

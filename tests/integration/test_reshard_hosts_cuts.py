"""A host cut off in the middle of a growth across hosts (network namespaces, a real
etcd, one supervisor per host), or etcd stopped at the seal: each key ends with exactly
one owner, accepting writes, with every acknowledged write there. The cluster and its
helpers are ``test_reshard_hosts``'s; the tests live apart so that the suite's workers
run them beside that module's long one.
"""
from __future__ import annotations

import pytest

from test_reshard_hosts import TwoHosts
from test_operations import frozen
from conftest import wait_until
from clonemap.shards.common.routing import ShardMap


@pytest.mark.parametrize("phase,epoch,fault", [("copied", 1, "isolate"),
                                               ("sealed", 3, "isolate"),
                                               ("committed", 2, "cut")])
def test_a_host_cut_off_in_the_middle_of_a_growth_leaves_one_owner_per_key(
        hosts, tmp_path, phase, epoch, fault):
    """Host a's supervisor runs a growth whose added shard has its primary on b; at a
    phase of the move (paused there by ``CLONEMAP_RESHARD_PAUSE_AT``, deterministic)
    host b is cut off from everyone (its link down).

    - ``copied``: the hold cannot reach s1's active on b: the growth rolls back, and
      the routing stays at epoch 1;
    - ``sealed`` (every source holds the moving keys' writes, past the point where a
      hold ends by itself): the commit cannot reach s2's active on b: the old routing
      comes back as epoch 3, the sources on a are released, and s1's active on b, cut
      off from etcd, loses its lease: s1's backup on a takes over, released too;
    - ``committed`` (s2's active on b took the keys), with ``cut``: only a and b cannot
      reach each other (``ip route add prohibit``: the requests a sent b are refused,
      not kept for later), and b keeps etcd. The flip goes on, epoch 2 in etcd; b's
      servers keep their leases and do not hear it from a, and s1's active on b keeps
      its sealed hold. b's supervisor follows epoch 2 from etcd within a heartbeat and
      gives it to them, with the word to forget the keys that moved and to forward what
      they held.

    In the first two, b's supervisor never got the word to drop s2's primary: once the
    link is back it finds that change no longer under way in etcd and drops it, and the
    growth, run again, completes. Every server
    of every pair ends at one epoch, holding only the keys its shard owns, and every
    acknowledged write is on its one owner."""
    cluster = TwoHosts(hosts, tmp_path, env_a={"CLONEMAP_RESHARD_PAUSE_AT": phase})
    try:
        cluster.writer("k")
        cluster.wait_acks("k", 40)
        sup_a, sup_b = cluster.supervisors["a"], cluster.supervisors["b"]
        _, three, change = cluster.start_growth("a", f"RESHARD_PAUSED phase={phase}")
        if phase == "copied":  # one change at a time, whichever host is asked
            other = cluster.reshard(cluster.write("other.yaml", cluster.grown()), via="b")
            assert other.returncode == 1, other.stdout + other.stderr
            assert "another change of the routing is under way (host a: " in other.stderr
        if fault == "isolate":
            hosts.isolate("b")
        else:
            hosts.cut("a", "b")
        (cluster.run_dir("a") / "reshard.continue").touch()
        code = change.wait(90)
        said = "\n".join(change.stdout + change.stderr)
        if phase == "committed":
            assert code == 0 and "routing epoch 2" in said, said
        else:
            assert code == 1, said
            assert ("rolled back" if phase == "copied" else
                    "the old routing is back as epoch 3") in said, said
        # (isolate) the pairs' servers on a take over once b's leases lapse; (cut) b
        # serves on: writes go on
        cluster.wait_acks("k", 20)
        if fault == "cut":  # b follows etcd, cut or not
            cluster.wait_servers_at(epoch, 3, on="b")
        hosts.heal()
        if phase != "committed":
            sup_b.wait_stderr("shard 2 dropped here", 0, 30)
            cluster.wait_epoch(epoch)
            assert cluster.etcd_routing()["routing"]["shards"] == 2
            change = cluster.reshard_past(three, phase)
            assert change.wait(90) == 0, "\n".join(change.stdout + change.stderr)
            epoch += 1
        cluster.wait_epoch(epoch)
        cluster.wait_servers_at(epoch, 6)
        cluster.wait_acks("k", 20)

        cluster.lose_nothing(cluster.grown()["shards"], ShardMap(3))
    finally:
        cluster.stop()


def test_an_etcd_that_does_not_answer_at_the_seal_keeps_no_write_past_the_hold_bound(
        hosts, tmp_path):
    """The change's record goes to etcd inside the hold, before the seal. Host a's
    supervisor pauses a growth at *held* (the sources hold the moving keys' writes), and
    etcd is stopped (SIGSTOP: it takes connections and answers nothing; its client
    waits 2 s) until that attempt's writes are released. Each attempt gives etcd only
    what is left of the hold's bound, then releases the holds and tries again (before,
    the hold lasted the client's 2 s, and the writes waited as long); after the last the
    growth rolls back. A record that etcd takes once it runs again is removed. With etcd
    back the growth, run again, completes, and every acknowledged write is on its one
    owner. (etcd runs between the attempts, and the pairs' leases are 6 s: on a slower
    2-core host, with 2 s leases, a source's active missed two renewals in the two
    attempts' stops and fenced itself, and the change rolled back for its source, not
    for its record.)"""
    from clonemap.supervisor.resharding import HOLD_ATTEMPTS

    cluster = TwoHosts(hosts, tmp_path, env_a={"CLONEMAP_RESHARD_PAUSE_AT": "held"},
                       lease_s=6)
    try:
        cluster.writer("k")
        cluster.wait_acks("k", 40)
        sup_a = cluster.supervisors["a"]
        _, three, change = cluster.start_growth("a", "RESHARD_PAUSED phase=held")
        go_on = cluster.run_dir("a") / "reshard.continue"
        seen = 0
        for attempt in range(HOLD_ATTEMPTS):  # (each attempt pauses at held again)
            with frozen([cluster.etcd.member.pid]):  # (SIGCONT once released, whatever came)
                go_on.touch()
                seen = sup_a.wait_stderr("the writes are released", seen, 30) + 1
            if attempt < HOLD_ATTEMPTS - 1:
                sup_a.wait_line("RESHARD_PAUSED phase=held", 30)
        code = change.wait(60)
        said = "\n".join(change.stdout + change.stderr)
        assert code == 1 and "not applied" in said, said
        released = [line for line in sup_a.stderr if "the writes are released" in line]
        assert len(released) == HOLD_ATTEMPTS, released
        # (an attempt's catch-up could use the bound first on a loaded host; the record
        # is what etcd, stopped, never answers)
        assert any("etcd did not take the move's record within" in line
                   for line in released), released
        cluster.wait_epoch(1)
        cluster.wait_acks("k", 20)  # (the pairs' leases renewed once etcd runs)
        # a record etcd read from a socket once it ran again (the client had given up on
        # it) is its supervisor's own, found while it runs no change: removed; and the
        # claim that could not be given back while etcd was stopped ends with its lease
        wait_until(lambda: cluster.etcd_key("move") is None and
                   cluster.etcd_key("change") is None,
                   "etcd without a change's record or claim", timeout_s=20)

        change = cluster.reshard_past(three, "held")
        assert change.wait(90) == 0, "\n".join(change.stdout + change.stderr)
        cluster.wait_epoch(2)
        cluster.wait_servers_at(2, 6)
        cluster.wait_acks("k", 20)
        cluster.lose_nothing(cluster.grown()["shards"], ShardMap(3))
    finally:
        cluster.stop()


def test_an_etcd_that_does_not_take_the_epoch_leaves_the_change_to_be_settled(
        hosts, tmp_path):
    """Host a's supervisor pauses a growth at *committed*: the targets took the new
    routing, and etcd has yet to. etcd is stopped (SIGSTOP), so the epoch's
    compare-and-swap gets no answer: the command fails (exit 1), and its record stays
    in etcd on purpose (the holds are sealed; this supervisor does not remove it as a
    late put). Once etcd runs again and the change's claim lapses, a supervisor settles
    it from the record: every target committed, so epoch 2 goes to etcd and every server
    follows (or etcd takes the swap it read before it stopped: epoch 2 too); nothing
    acknowledged is lost and no record is left."""
    cluster = TwoHosts(hosts, tmp_path, env_a={"CLONEMAP_RESHARD_PAUSE_AT": "committed"})
    try:
        cluster.writer("k")
        cluster.wait_acks("k", 40)
        _, _, change = cluster.start_growth("a", "RESHARD_PAUSED phase=committed")
        with frozen([cluster.etcd.member.pid]):
            (cluster.run_dir("a") / "reshard.continue").touch()
            code = change.wait(60)
        said = "\n".join(change.stdout + change.stderr)
        assert code == 1 and "did not take epoch 2" in said, said
        # (etcd may also take the compare-and-swap it reads from its socket once it runs
        # again: the same epoch 2, and the record is then settled already)
        cluster.wait_epoch(2, timeout_s=40)
        assert cluster.etcd_routing()["routing"]["epoch"] == 2
        cluster.wait_servers_at(2, 6)
        wait_until(lambda: cluster.etcd_key("move") is None,
                   "etcd without a change's record", timeout_s=20)
        cluster.wait_acks("k", 20)
        cluster.lose_nothing(cluster.grown()["shards"], ShardMap(3))
    finally:
        cluster.stop()

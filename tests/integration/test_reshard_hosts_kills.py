"""A supervisor killed past the seal of a change across hosts (network namespaces, a
real etcd): the other host's supervisor settles the change from its record in etcd once
the dead one's claim lapses, the sealed holds end, and nothing acknowledged is lost.
Pairs failed over across the hosts at the flip: the change goes on. The cluster and its
helpers are ``test_reshard_hosts``'s.
"""
from __future__ import annotations

import signal

import pytest

from test_reshard_hosts import TwoHosts
from clonemap.shards.common.routing import ShardMap

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("phase,epoch,config", [("sealed", 3, "two.yaml"),
                                                ("committed", 2, "three.yaml")])
def test_a_supervisor_killed_past_the_seal_is_settled_by_the_other_host(
        hosts, tmp_path, phase, epoch, config):
    """Host a's supervisor runs a growth and is killed (SIGKILL; its servers go with
    it) once it reached ``phase`` (``CLONEMAP_RESHARD_STOP_AT``: deterministic). The
    holds are sealed: s1's active on b holds the moving keys' writes, and no hold that
    is sealed ends by itself. Once a's claim on the change lapses in etcd, b's
    supervisor settles the change from its record there: ``sealed``, s2's active (on
    b) did not take the new routing, and the routing before comes back as epoch 3;
    ``committed``, it did, and epoch 2 goes to etcd. b's servers follow: the hold ends
    (applied, or forwarded to s2), and what moved is forgotten. Host a's supervisor,
    started again with the config of etcd's routing, follows it; every acknowledged
    write is on its one owner."""
    cluster = TwoHosts(hosts, tmp_path, env_a={"CLONEMAP_RESHARD_STOP_AT": phase})
    try:
        cluster.writer("k")
        cluster.wait_acks("k", 40)
        sup_a, sup_b = cluster.supervisors["a"], cluster.supervisors["b"]
        _, _, change = cluster.start_growth("a", f"RESHARD_STOPPED phase={phase}")
        sup_a.signal(signal.SIGKILL)
        assert sup_a.wait(30) == -signal.SIGKILL
        assert change.wait(60) != 0  # its supervisor is gone
        settled = sup_b.wait_stderr("settled here", 0, 30)
        assert ("goes forward" if phase == "committed" else
                f"back as epoch {epoch}") in sup_b.stderr[settled], sup_b.stderr[settled]
        assert cluster.etcd_routing()["routing"]["epoch"] == epoch
        cluster.wait_acks("k", 20)  # b's servers serve every shard meanwhile

        cluster.config = tmp_path / config
        cluster.supervisors["a"] = cluster._supervisor("a", None)
        assert cluster.supervisors["a"].wait_line("READY supervisor", 60).startswith("READY")
        cluster.wait_epoch(epoch)
        shards = cluster.grown()["shards"][:2 if phase == "sealed" else 3]
        cluster.wait_servers_at(epoch, 2 * len(shards))
        cluster.wait_acks("k", 20)

        cluster.lose_nothing(shards, ShardMap(len(shards)))
    finally:
        cluster.stop()


def test_failovers_across_hosts_at_the_flip_leave_one_owner_and_lose_nothing(
        hosts, tmp_path):
    """A growth run through host a's supervisor waits at *flipped*
    (``CLONEMAP_RESHARD_PAUSE_AT``): the targets route by the new epoch, the sources
    still hold the moving keys' writes. The added shard's active, then a source's (each
    on whichever host runs it), is killed with ``supervisor kill``; each pair fails over
    across the hosts. The change goes on: the new epoch in etcd, every server on it, and
    every acknowledged write of a writer that ran throughout on its one owner."""
    cluster = TwoHosts(hosts, tmp_path, env_a={"CLONEMAP_RESHARD_PAUSE_AT": "flipped"})
    try:
        cluster.writer("k")
        cluster.wait_acks("k", 40)
        grown, _, change = cluster.start_growth("a", "RESHARD_PAUSED phase=flipped")
        cluster.fail_over(grown["shards"][2])
        cluster.fail_over(grown["shards"][0])
        (cluster.run_dir("a") / "reshard.continue").touch()
        assert change.wait(90) == 0, "\n".join(change.stdout + change.stderr)
        cluster.wait_epoch(2)
        assert cluster.etcd_routing()["routing"]["shards"] == 3
        cluster.wait_servers_at(2, 6)
        cluster.wait_acks("k", 20)
        acked = cluster.lose_nothing(grown["shards"], ShardMap(3))
        assert any(ShardMap(3).owner(k) == 2 for k in acked), "the added shard took none"
    finally:
        cluster.stop()

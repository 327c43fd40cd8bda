"""The routing of a cluster over several hosts in a real etcd
(``clonemap.supervisor.routing_state.SharedRouting``): it only moves forward, of two
supervisors that race with the same epoch one wins and the other reads the winner's,
one change at a time under a claim that lapses with its holder, a change's record, and a
start refused with a clear error when etcd does not answer."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import EtcdServer, free_port_base
from clonemap.shards.common.config import load_config
from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.hostfacts import local_host_facts
from clonemap.shards.common.placement import plan
from clonemap.shards.common.routing import ShardMap
from clonemap.supervisor import routing_state
from clonemap.supervisor.routing_state import SharedRouting

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


def shared(etcd: EtcdServer, cluster: str) -> SharedRouting:
    return SharedRouting(f"etcd://{etcd.host}:{etcd.port}", cluster)


def test_the_routing_only_moves_forward_and_names_its_config(etcd):
    routing = shared(etcd, "forward")
    assert routing.read() == (None, "", 0)
    first = ShardMap(2, epoch=1)
    assert routing.advance(first, "/cfg/two.yaml") == first
    held, config, revision = routing.read()
    assert (held, held.epoch, config) == (first, 1, "/cfg/two.yaml") and revision > 0
    later = ShardMap(3, {0: ["/p/"]}, epoch=2)
    assert routing.advance(later, "/cfg/three.yaml") == later
    # an older epoch, or the same epoch again with another routing, changes nothing
    for stale in (ShardMap(2, epoch=1), ShardMap(4, epoch=2)):
        got = routing.advance(stale, "/cfg/stale.yaml")
        assert (got, got.epoch) == (later, 2)
    assert routing.read()[:2] == (later, "/cfg/three.yaml")


def test_two_supervisors_racing_with_one_epoch_agree_on_one_routing(etcd):
    """Eight threads, each its own client, advance to eight routings under epoch 2 at
    once (a barrier): every one gets back the same routing, the one etcd holds."""
    shared(etcd, "race").advance(ShardMap(2, epoch=1))
    barrier = threading.Barrier(8)
    got: dict[int, ShardMap] = {}

    def one(i: int) -> None:
        mine = shared(etcd, "race")
        barrier.wait()
        got[i] = mine.advance(ShardMap(2, {i % 2: [f"/t{i}/"]}, epoch=2), f"/cfg/{i}.yaml")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    held, config, _ = shared(etcd, "race").read()
    assert len(got) == 8 and all(m == held and m.epoch == 2 for m in got.values())
    winner = next(i for i in range(8) if ShardMap(2, {i % 2: [f"/t{i}/"]}) == held)
    assert config == f"/cfg/{winner}.yaml"


def test_one_change_at_a_time_and_a_claim_lapses_with_its_holder(etcd):
    routing = shared(etcd, "claims")
    lease, holder = routing.claim("host a: /cfg/three.yaml", 10)
    assert lease and holder == "" and routing.claimed()
    assert routing.claim("host b: /cfg/four.yaml", 10) == (0, "host a: /cfg/three.yaml")
    assert routing.keep(lease)
    routing.release(lease)
    assert not routing.claimed()
    # a holder that dies (no keepalive): its claim ends with its lease's TTL
    lease, _ = routing.claim("host b: /cfg/four.yaml", 1)
    assert lease
    deadline = time.monotonic() + 10
    while routing.claimed():  # each check a round trip to etcd
        assert time.monotonic() < deadline, "the claim outlived its 1 s lease"
    lease, _ = routing.claim("host a: again", 10)
    assert lease
    routing.release(lease)


def test_a_change_s_record_is_kept_until_cleared(etcd):
    routing = shared(etcd, "record")
    assert routing.read_move() is None
    doc = {"from": ShardMap(2).describe(), "to": ShardMap(3, epoch=2).describe(),
           "targets": {"2": {"s2/primary": "tcp://10.0.0.2:5555"}}}
    at = routing.write_move(doc)
    assert at and routing.read_move_at() == (doc, at)
    routing.clear_move()
    assert routing.read_move() is None


def test_a_change_s_record_is_written_only_under_its_claim(etcd):
    """The record of a change about to seal is written only while its supervisor's claim
    holds: once its lease lapsed (revoked here: what an expiry does), and the more so
    once another supervisor claimed the next change, the record is refused, so that a
    supervisor that missed its renewals cannot seal a change beside another one. And a
    supervisor clears only its own record: the one written at its revision."""
    routing = shared(etcd, "claimed-record")
    doc = {"from": ShardMap(2).describe(), "to": ShardMap(3, epoch=2).describe(),
           "targets": {}}
    lease, _ = routing.claim("host a: /cfg/three.yaml", 10)
    mine = routing.write_move(doc, lease)
    assert mine and routing.read_move_at() == (doc, mine)
    routing.release(lease)  # (lapsed: gone from etcd, as at the end of its TTL)
    assert not routing.write_move(doc, lease)
    other, _ = routing.claim("host b: /cfg/four.yaml", 10)
    assert other and other != lease
    assert not routing.write_move(doc, lease)
    assert not routing.keep(lease)  # what the lapsed supervisor's renewal hears
    theirs_doc = dict(doc, host="b")
    theirs = routing.write_move(theirs_doc, other)
    assert theirs > mine
    # a, rolling back, clears its record: b's stays
    assert not routing.clear_move(mine)
    assert routing.read_move_at() == (theirs_doc, theirs)
    assert routing.clear_move(theirs) and routing.read_move() is None
    routing.release(other)


def _two_host_config(path: Path, etcd_port: int) -> Path:
    base = free_port_base(4)
    path.write_text(yaml.safe_dump({
        "cluster": "away", "data_dir": "data",
        "hosts": {"a": {"control": f"tcp://127.0.0.1:{base}"},
                  "b": {"control": "tcp://127.0.0.2:5555"}},
        "coordination": {"etcd": [f"127.0.0.1:{etcd_port}"]},
        "shards": [{"name": "s0", "primary": {"at": "a", "host": "127.0.0.1", "port": base + 1},
                    "backup": {"at": "b", "host": "127.0.0.2", "port": 6000}}]}))
    return path


def test_a_start_across_hosts_is_refused_while_etcd_does_not_answer(tmp_path):
    config = _two_host_config(tmp_path / "away.yaml", free_port_base(2))
    the_plan = plan(load_config(str(config)), local_host_facts(), host="a")
    with pytest.raises(ConfigError, match="did not answer .* keeps its routing epoch "
                                          "there; start etcd first"):
        routing_state.settle(tmp_path / "run", the_plan, str(config))


def test_a_start_takes_etcd_s_later_routing_and_refuses_an_old_config_naming_the_new(
        etcd, tmp_path):
    """Host a was away while the cluster changed (etcd holds epoch 3, set by a config
    with a pin); its run directory says epoch 1 and its server persisted. Started with
    the old config it is refused, naming the config that set the routing; started with
    that config, it takes epoch 3."""
    config = _two_host_config(tmp_path / "away.yaml", etcd.port)
    old = plan(load_config(str(config)), local_host_facts(), host="a")
    run = tmp_path / "run"
    run.mkdir()  # (``supervisor start`` makes it first)
    assert routing_state.settle(run, old, str(config)).routing.epoch == 1
    (run / "data" / "s0-primary").mkdir(parents=True)  # its server persisted keys
    pinned = tmp_path / "pinned.yaml"
    doc = yaml.safe_load(config.read_text())
    doc["shards"][0]["prefixes"] = ["/p/"]
    pinned.write_text(yaml.safe_dump(doc))
    new = plan(load_config(str(pinned)), local_host_facts(), host="a")
    shared(etcd, "away").advance(new.routing.shard_map().with_epoch(3), str(pinned))
    with pytest.raises(ConfigError, match=f"routes keys otherwise.*set by {pinned}"):
        routing_state.settle(run, old, str(config))
    assert routing_state.settle(run, new, str(pinned)).routing.epoch == 3
    assert routing_state.read(run).epoch == 3

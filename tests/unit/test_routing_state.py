"""Where a cluster's routing epoch comes from at ``supervisor start``
(``clonemap.supervisor.routing_state.settle``) and at a server's start
(``clonemap.shards.persist.routing.settle``): real files in a temporary directory."""
from __future__ import annotations

import dataclasses
import json

import pytest

from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.placement import load_plan
from clonemap.shards.common.routing import ShardMap
from clonemap.shards.persist import CorruptLog
from clonemap.shards.persist import routing as server_routing
from clonemap.supervisor import routing_state
from conftest import ROOT

pytestmark = pytest.mark.unit


def _plan(pins=None, data_dir="data"):
    plan = load_plan(ROOT / "configs" / "2shard.yaml")
    prefixes = tuple(tuple((pins or {}).get(i, ())) for i in range(2))
    return dataclasses.replace(plan, data_dir=data_dir,
                               routing=dataclasses.replace(plan.routing, prefixes=prefixes))


def test_the_run_directory_keeps_the_epoch_and_refuses_another_routing(tmp_path):
    first = routing_state.settle(tmp_path, _plan())
    assert first.routing.epoch == 1
    assert routing_state.read(tmp_path) == ShardMap(2)
    # what a reshard committed: the same config routes as epoch 3 from now on
    routing_state.write(tmp_path, "two", ShardMap(2, {1: ["/t/"]}, epoch=3))
    again = routing_state.settle(tmp_path, _plan({1: ["/t/"]}))
    assert again.routing.epoch == 3 and again.routing.shard_map().pins == {"/t/": 1}
    # the old config: its servers persist keys placed by epoch 3's routing
    with pytest.raises(ConfigError, match="routes keys otherwise") as info:
        routing_state.settle(tmp_path, _plan())
    assert "epoch 3: 2 shards, /t/ -> 1" in str(info.value)
    # nothing persists: the config's routing is the next epoch
    fresh = routing_state.settle(tmp_path, _plan(data_dir=None))
    assert fresh.routing.epoch == 4 and routing_state.read(tmp_path).epoch == 4
    (tmp_path / routing_state.ROUTING_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="not a routing file"):
        routing_state.settle(tmp_path, _plan())


def test_a_server_follows_the_newer_of_its_argument_and_its_directory(tmp_path):
    later = ShardMap(2, {1: ["/t/"]}, epoch=2)
    assert server_routing.settle(tmp_path, later, 1) is later  # written
    assert server_routing.read_routing(tmp_path) == (1, later)
    assert server_routing.settle(tmp_path, ShardMap(2), 1).epoch == 2  # older given
    newest = ShardMap(2, epoch=5)
    assert server_routing.settle(tmp_path, newest, 1) is newest  # newer given: taken
    assert server_routing.read_routing(tmp_path)[1].epoch == 5
    with pytest.raises(ConfigError, match="another cluster"):
        server_routing.settle(tmp_path, ShardMap(2, {0: ["/x/"]}, epoch=5), 1)
    with pytest.raises(ConfigError, match="shard 1's data"):
        server_routing.settle(tmp_path, newest, 0)
    (tmp_path / "routing").write_text(json.dumps({"shard_index": 1, "routing": {}}))
    with pytest.raises(CorruptLog):
        server_routing.read_routing(tmp_path)


@pytest.mark.parametrize("took,epoch,pins", [
    ((), 1, {}),                       # no target committed: nothing changed
    ((0, 1), 2, {"/t/": 1, "/u/": 0}),  # every target committed: the change goes forward
    ((1,), 3, {}),                     # torn: the routing before it, one epoch later
])
def test_a_flip_cut_short_goes_forward_only_when_every_target_took_its_keys(
        tmp_path, took, epoch, pins):
    """``move.json`` records a flip before any target commits; a target that committed
    keeps the new epoch in its data directory (one of its two servers is enough)."""
    before = ShardMap(2)
    routing_state.write(tmp_path, "two", before)
    after = ShardMap(2, {1: ["/t/"], 0: ["/u/"]}, epoch=2)
    routing_state.write_move(tmp_path, before, after,
                             {0: ["s0-primary", "s0-backup"], 1: ["s1-primary", "s1-backup"]})
    for t in took:
        (tmp_path / "data" / f"s{t}-backup").mkdir(parents=True)
        server_routing.settle(tmp_path / "data" / f"s{t}-backup", after, t)
    config = _plan({1: ["/t/"], 0: ["/u/"]}) if epoch == 2 else _plan()
    settled = routing_state.settle(tmp_path, config)
    assert settled.routing.epoch == epoch and routing_state.read(tmp_path).epoch == epoch
    assert routing_state.read(tmp_path).pins == pins
    assert not (tmp_path / routing_state.MOVE_FILE).exists()


def test_a_recorded_flip_leaves_nothing_to_decide(tmp_path):
    after = ShardMap(2, {1: ["/t/"]}, epoch=2)
    routing_state.write_move(tmp_path, ShardMap(2), after, {1: ["s1-primary"]})
    routing_state.write(tmp_path, "two", after)  # the run directory took it: done
    assert routing_state.settle(tmp_path, _plan({1: ["/t/"]})).routing.epoch == 2
    assert not (tmp_path / routing_state.MOVE_FILE).exists()
    (tmp_path / routing_state.MOVE_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="not a move record"):
        routing_state.settle(tmp_path, _plan({1: ["/t/"]}))

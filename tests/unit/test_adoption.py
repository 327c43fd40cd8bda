"""The client's adoption of the keys a routing change copied to an added shard
(``clonemap.client.adoption``, driven by ``ShardAgent.start_adoption``), on real agents
that are never started: the loop's turns forced by calling ``run`` with a budget. Each
key is in exactly one part after every turn; a key the new shard wrote meanwhile keeps
its value there; a lender about to be replaced gives everything at once (``run()``);
the end clears the lending."""
from __future__ import annotations

import gc

from clonemap.client.adoption import Adoption
from clonemap.client.agent import ShardAgent
from clonemap.shards.common import zio


def part(name: str, keys: dict[bytes, bytes], props: dict[bytes, bytes] | None = None
         ) -> ShardAgent:
    agent = ShardAgent(None, ["tcp://127.0.0.1:5999"], name=name)  # (never started)
    agent.map.update(keys)
    agent.props.update(props or {})
    agent.seqs.update({k: 100 + i for i, k in enumerate(keys)})
    return agent


def adopting(agent: ShardAgent, lenders: tuple, owns) -> Adoption:
    agent.lending = lenders
    agent.lent_at = [(o, o.snapshots) for o in lenders]
    adoption = Adoption(lenders, lambda keys: [k for k in keys if owns(k)],
                        agent._take_adopted, agent._adopted)
    agent.adoption = adoption
    return adoption


def test_keys_move_a_budget_at_a_time_each_in_one_part_and_the_new_shards_writes_stay():
    s0 = part("s0", {b"/a/%d" % i: b"v%d" % i for i in range(10)}, {b"/a/3": b"expires=9\n"})
    s1 = part("s1", {b"/b/%d" % i: b"w%d" % i for i in range(10)})
    s2 = part("s2", {b"/a/5": b"newer"})  # written on s2 since its copy (an update)
    owned = lambda key: key[-1:] in b"3579"  # noqa: E731 - what the routing gives s2
    adoption = adopting(s2, (s0, s1), owned)
    for _ in range(6):
        adoption.run(4)
        # (/a/5 is in s0 too only because this test put it there: a client's update
        # from s2 re-homes it at once; the adoption drops such a stale copy)
        keys = [k for k in [*s0.map, *s1.map, *s2.map] if k != b"/a/5"]
        assert len(keys) == len(set(keys)) == 19
        if adoption.done:
            break
    assert adoption.done and s2.lending == () and s2.lent_at == [] and s2.adoption is None
    assert s2.map == {b"/a/3": b"v3", b"/a/5": b"newer", b"/a/7": b"v7", b"/a/9": b"v9",
                      b"/b/3": b"w3", b"/b/5": b"w5", b"/b/7": b"w7", b"/b/9": b"w9"}
    assert s2.props == {b"/a/3": b"expires=9\n"} and not s0.props
    assert not any(owned(k) for k in [*s0.map, *s1.map])
    assert not any(owned(k) for k in [*s0.seqs, *s1.seqs])  # their old sequences went
    assert b"/a/3" not in s2.seqs  # no sequence of the new shard yet: meta() says 0
    assert adoption.moved == 7  # (/a/5 was the new shard's already: the stale one dropped)


def test_a_lender_about_to_be_replaced_gives_everything_at_once():
    s0 = part("s0", {b"/a/%d" % i: b"v" for i in range(1000)})
    s2 = part("s2", {})
    adoption = adopting(s2, (s0,), lambda key: key.endswith(b"7"))
    adoption.run(10)
    assert not adoption.done
    # the lender's keys, as the adoption began: no garbage collection walks them
    # (compiled: a list taken off the collector's lists; pure: a tuple, walked once)
    walked = adoption.queue[-1][1]
    assert len(walked) == 1000
    assert not gc.is_tracked(walked) if zio.COMPILED else isinstance(walked, tuple)
    adoption.run()  # (``AsyncClone._lent_out``: before the lender's map is replaced)
    assert adoption.done and len(s2.map) == 100 and not any(k.endswith(b"7") for k in s0.map)
    adoption.run(10)  # finished: nothing more
    assert len(s2.map) == 100 and adoption.moved == 100 and s2.lending == ()


def test_an_adoption_with_no_lender_left_starts_nothing():
    s2 = part("s2", {})
    s2.lent_at = [(part("s0", {}), 0)]
    s2.start_adoption(lambda key: True)  # (its claim found no lender)
    assert s2.adoption is None and s2.lent_at == []


def test_a_lender_whose_map_grows_and_shrinks_meanwhile_gives_what_it_held():
    """What the adoption walks is the lenders' keys as they were at its start, apart
    from each lender's map, which grows and shrinks between its turns (a staying key
    written, another deleted): each moving key is taken once, the staying ones stay."""
    s0 = part("s0", {b"/a/%d" % i: b"v%d" % i for i in range(100)})
    s2 = part("s2", {})
    owned = lambda key: key.endswith(b"7")  # noqa: E731
    adoption = adopting(s2, (s0,), owned)
    adoption.run(10)
    s0.map[b"/new/1"] = b"n"
    del s0.map[b"/a/50"]
    while not adoption.done:
        adoption.run(10)
    assert s2.map == {b"/a/%d" % i: b"v%d" % i for i in range(100) if owned(b"/a/%d" % i)}
    assert b"/new/1" in s0.map and b"/a/50" not in s0.map
    assert not any(owned(k) for k in s0.map)

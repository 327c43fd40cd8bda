"""A client's options (``clonemap.client.options``): defaults, checks and the agents' part in one
place; a wrong value is refused when the options are made, naming the option."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from clonemap.shards.common.proto import chp
from clonemap.client import shard_machine as sm
from clonemap.client.options import (AUTO, AgentOptions, ClientOptions, KVSET_QUEUE_MAX, MAX_LAG_S,
                            SUB_RCVHWM, SYNC_BUFFER_MAX)


def test_the_defaults_are_the_documented_ones():
    opts = ClientOptions()
    assert (opts.subtree, opts.codec, opts.via, opts.silence_timeout_s) == ("", "bytes",
                                                                            "servers", AUTO)
    assert (opts.slow_policy, opts.reset_policy, opts.max_lag_s) == ("resync", "accept",
                                                                     MAX_LAG_S)
    agent = opts.agent(6.0)
    assert agent == AgentOptions(silence_timeout_s=6.0, max_lag_s=MAX_LAG_S)
    assert (agent.sync_buffer_max, agent.kvset_queue_max, agent.sub_rcvhwm) == (
        SYNC_BUFFER_MAX, KVSET_QUEUE_MAX, SUB_RCVHWM)


@pytest.mark.parametrize("field, value, words", [
    ("subtree", b"/x/", "subtree is a str"),
    ("via", "carrier-pigeon", "via is 'servers' or 'relays'"),
    ("timeout_s", 0, "timeout_s must be > 0"),
    ("heartbeat_s", -1.0, "heartbeat_s must be > 0 or None"),
    ("silence_timeout_s", "soon", "silence_timeout_s must be > 0 or None"),
    ("max_lag_s", 0, "max_lag_s must be > 0 or None"),
    ("io_threads", 0, "io_threads is None, 'per_shard' or 1..64"),
    ("io_threads", True, "io_threads is None"),
    ("slow_policy", "ignore", "slow_policy is one of resync, die"),
    ("reset_policy", "merge", "reset_policy is one of accept, keep"),
    ("sync_buffer_max", 0, "sync_buffer_max must be a whole number >= 1"),
    ("watch_capacity", 2.5, "watch_capacity must be a whole number >= 1"),
    ("sync_timeout_s", float("nan"), "sync_timeout_s must be > 0"),
])
def test_a_wrong_value_is_refused_naming_its_option(field, value, words):
    with pytest.raises((ValueError, TypeError), match=words.replace("(", r"\(")):
        ClientOptions(**{field: value})


def test_only_key_must_lie_under_the_subtree():
    with pytest.raises(ValueError, match="outside the subtree"):
        ClientOptions(subtree="/a/", only_key="/b/k")
    assert ClientOptions(subtree="/a/", only_key="/a/k").only_key == "/a/k"


def test_given_replaces_fields_and_lists_the_options_for_a_wrong_keyword():
    base = ClientOptions(subtree="/orders/", timeout_s=30.0)
    opts = ClientOptions.given(base, "Clone()", timeout_s=5.0)
    assert (opts.subtree, opts.timeout_s) == ("/orders/", 5.0)
    assert ClientOptions.given(base, "Clone()") is base
    assert ClientOptions.given(None, "Clone()") == ClientOptions()
    with pytest.raises(TypeError, match=r"Clone\(\): no option 'sync_timeout' \(the options: "
                                        r".*sync_timeout_s"):
        ClientOptions.given(None, "Clone()", sync_timeout=1.0)
    with pytest.raises(TypeError, match="options is a ClientOptions, not dict"):
        ClientOptions.given({"timeout_s": 1.0}, "Clone()")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):  # checked on replace too
        ClientOptions.given(base, "Clone()", timeout_s=-1)


def test_options_are_frozen_and_the_agents_part_carries_every_agent_field():
    opts = ClientOptions(sync_timeout_s=1.5, connect_timeout_s=2.5, sync_buffer_max=10,
                         kvset_queue_max=11, sub_rcvhwm=12, max_lag_s=None,
                         reset_policy="keep", resume=False, limits=chp.Limits())
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.timeout_s = 1.0  # type: ignore[misc]
    agent = opts.agent(None)
    for f in dataclasses.fields(AgentOptions):
        if f.name != "silence_timeout_s":
            assert getattr(agent, f.name) == getattr(opts, f.name), f.name
    machine = agent.machine(servers=2, contiguous=False)
    assert machine == sm.Config(servers=2, contiguous=False, sync_timeout_s=1.5,
                                connect_timeout_s=2.5, silence_timeout_s=None, resume=False)


def test_the_options_module_does_not_import_zmq():
    code = "import sys, client.options; print('zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr

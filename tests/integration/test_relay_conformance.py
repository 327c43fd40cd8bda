"""12/CHP server conformance, run against a relay: every test of
``test_server_conformance`` that takes the ``server`` fixture, here served by a relay
(``python -m clonemap.shards.relay``) in front of a real Binary Star pair. The raw-socket peer
talks to the relay's P, P+1 and P+2 only; what it writes goes through the relay to the
pair and comes back with the shard's sequences; TTL expiries are the pair's, published
through the relay. A relay must be indistinguishable from a standalone server here.
"""
from __future__ import annotations

import pytest

from conftest import free_port_base
from test_pair import ACTIVE, PASSIVE, Watcher
from test_pair import start_server as start_pair_server
from test_server_conformance import (  # noqa: F401  (collected here, with our fixture)
    test_a_50k_key_snapshot_arrives_whole, test_a_blocked_snapshot_does_not_stall_publishing,
    test_a_new_server_has_an_empty_snapshot_at_sequence_zero,
    test_a_non_ascii_key_and_a_large_value_are_republished_unchanged,
    test_a_second_server_on_the_same_ports_exits_3,
    test_a_signal_stops_the_server_with_exit_code_0,
    test_a_subscriber_hears_nothing_about_keys_outside_its_subtree,
    test_an_absolute_expires_property_is_honoured,
    test_an_empty_value_deletes_the_key_and_is_published,
    test_each_kvset_becomes_a_kvpub_with_the_next_sequence_echoing_uuid_and_properties,
    test_hugz_does_not_consume_a_sequence, test_hugz_when_idle_carries_the_server_clock,
    test_many_clients_snapshot_at_once, test_ready_line_names_host_port_and_pid,
    test_rewriting_without_ttl_cancels_the_expiry_and_expiries_come_in_order,
    test_snapshot_of_a_subtree_holds_only_its_keys, test_snapshot_of_the_whole_map,
    test_snapshot_plus_later_kvpubs_rebuild_the_map_while_updates_keep_arriving,
    test_ttl_expiry_deletes_the_key_and_publishes_an_empty_kvpub,
    test_two_requests_on_one_connection_are_answered_in_order)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(procs, port_base, zctx):
    """A pair on free ports, then a relay of it on ``port_base`` (what the tests use)."""
    primary, backup = free_port_base(4), free_port_base(4)
    start_pair_server(procs, primary, "primary", backup)
    start_pair_server(procs, backup, "backup", primary)
    Watcher(zctx, primary).wait_state(ACTIVE)
    Watcher(zctx, backup).wait_state(PASSIVE)
    return procs.python("-m", "clonemap.shards.relay", "--port", str(port_base), "--heartbeat-s", "0.2",
                        "--upstream", f"127.0.0.1:{primary},127.0.0.1:{backup}",
                        ready="READY")

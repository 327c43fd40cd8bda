"""Cluster configs, host facts and placement: every error names the field, what was given
and what the host has; shipped configs validate; `supervisor validate` as a subprocess."""
from __future__ import annotations

import json
import socket
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, free_port_base
from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.config import load_config, parse_config
from clonemap.shards.common.config_values import format_cores, parse_cores
from clonemap.shards.common.hostfacts import HostFacts, load_host_facts, local_host_facts, probe_port
from clonemap.shards.common.placement import check_ports_free, load_plan, plan

FACTS_16 = ROOT / "configs" / "hosts" / "16core-2nic.yaml"
SHIPPED = {"1shard.yaml": 1, "2shard.yaml": 2, "4shard.yaml": 4, "short.yaml": 1}


def host(cores=(0, 1, 2, 3), **nics) -> HostFacts:
    nics = nics or {"lo": ("127.0.0.1",), "eth0": ("10.0.0.5",), "eth1": ("10.1.0.5",),
                    "dummy0": ()}
    return HostFacts(cores=tuple(cores), nics=nics, source="facts.yaml", local=False)


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def config_error(data) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="c.yaml")
    return info.value


def plan_error(data, facts: HostFacts | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        plan(parse_config(data), facts or host())
    return info.value


# ---------------------------------------------------------------- schema and defaults

def test_short_config_fills_every_default():
    cfg = parse_config({"shards": 4, "port_base": 6000})
    assert cfg.cluster == "clonemap"
    assert cfg.control == "tcp://127.0.0.1:5555"
    assert (cfg.control_address, cfg.control_port) == ("127.0.0.1", 5555)
    assert cfg.heartbeat_s == 1.0 and cfg.silence_timeout_s == 3.0
    assert [s.name for s in cfg.shards] == ["s0", "s1", "s2", "s3"]
    assert [(s.primary.port, s.backup.port) for s in cfg.shards] == [
        (6000, 6010), (6020, 6030), (6040, 6050), (6060, 6070)]
    for shard in cfg.shards:
        for server in (shard.primary, shard.backup):
            assert (server.host, server.nic, server.cores) == ("127.0.0.1", None, "auto")
            assert server.port_from_base
    assert parse_config({"shards": 1, "heartbeat_s": 0.5}).silence_timeout_s == 1.5


def test_defaults_section_applies_unless_a_server_sets_its_own():
    cfg = parse_config({"shards": [{"primary": {"host": "10.0.0.5", "cores": [1]}}, {}],
                        "defaults": {"nic": "eth1", "cores": "2-3"}})
    p0, b0 = cfg.shards[0].primary, cfg.shards[0].backup
    assert (p0.host, p0.nic, p0.cores) == ("10.0.0.5", None, (1,))
    assert (b0.host, b0.nic, b0.cores) == (None, "eth1", (2, 3))
    assert (p0.port, b0.port) == (6000, 6010)


def test_io_threads_fall_back_to_the_defaults_and_reach_every_command_line():
    """``io_threads``: a server's own, else ``defaults.io_threads``, else libzmq's one;
    relays take ``relays.io_threads``. The supervisor passes ``--io-threads`` to servers
    and relays that have more than one; a value outside 1..64 names its field."""
    from clonemap.supervisor.runner import ServerArgs, relay_argv, server_argv

    cfg = parse_config({"shards": [{"primary": {"io_threads": 4}}, {}],
                        "defaults": {"io_threads": 2},
                        "relays": {"per_shard": 1, "io_threads": 3}})
    the_plan = plan(cfg, host())
    s0, s1 = the_plan.shards
    assert (s0.primary.io_threads, s0.backup.io_threads, s1.primary.io_threads) == (4, 2, 2)
    assert {r.io_threads for r in the_plan.relays} == {3}
    args = ServerArgs(control="tcp://127.0.0.1:5555", heartbeat_s=1.0, parent_pid=1,
                      python="py")

    def io(argv):
        return argv[argv.index("--io-threads") + 1] if "--io-threads" in argv else None

    assert io(server_argv(s0.primary, s0.backup, args)) == "4"
    assert io(server_argv(s1.backup, s1.primary, args)) == "2"
    assert io(relay_argv(the_plan.relays[0], s0.primary, s0.backup, args)) == "3"
    plain = plan(parse_config({"shards": 1}), host()).shards[0].primary
    assert plain.io_threads == 1 and io(server_argv(plain, plain, args)) is None
    for bad, field in (({"shards": [{"backup": {"io_threads": 0}}]},
                        "shards[0].backup.io_threads"),
                       ({"shards": 1, "defaults": {"io_threads": 65}}, "defaults.io_threads"),
                       ({"shards": 1, "relays": {"io_threads": "many"}}, "relays.io_threads")):
        err = config_error(bad)
        assert err.field == field and field in str(err)


def test_cores_forms():
    assert parse_cores([3, 2, 2]) == (2, 3)
    assert parse_cores("2-3,6") == (2, 3, 6)
    assert parse_cores(" 0 - 2 , 5 ") == (0, 1, 2, 5)
    assert parse_cores(7) == (7,)
    assert parse_cores("auto") == "auto"
    assert format_cores((0, 1, 2, 3, 6, 8, 9)) == "0-3,6,8-9"


def test_unknown_field_is_named_with_the_allowed_ones():
    err = config_error({"shards": [{"name": "a", "primary": {"core": 3}}]})
    assert err.field == "shards[0].primary.core"
    assert str(err) == ('c.yaml: shards[0].primary.core: given 3: unknown field; expected one '
                        'of: host, nic, port, cores, io_threads, at (did you mean "cores"?)')
    err = config_error({"shards": 1, "heartbeat": 2})
    assert "heartbeat: given 2: unknown field" in str(err)
    assert 'did you mean "heartbeat_s"?' in str(err)
    err = config_error({"shards": 1, "defaults": {"port": 7000}})
    assert "defaults.port: given 7000: unknown field; expected one of: host, nic, cores" in str(err)


def test_fewer_than_one_shard():
    for given, shown in ((0, "0"), (-2, "-2"), ([], "[]")):
        err = config_error({"shards": given})
        assert err.field == "shards"
        assert f"shards: given {shown}: a cluster needs at least 1 shard" in str(err)
    err = config_error({"port_base": 6000})
    assert "c.yaml: shards: missing required field" == str(err)
    err = config_error({"shards": "four"})
    assert 'shards: given "four": expected a shard count' in str(err)


def test_port_outside_range():
    err = config_error({"shards": [{"primary": {"port": 65533}}]})
    assert err.field == "shards[0].primary.port"
    assert "shards[0].primary.port: given 65533: out of range; expected a port base in " \
           "1..65532 (a server uses port..port+3)" in str(err)
    err = config_error({"shards": [{"backup": {"port": 0}}]})
    assert "shards[0].backup.port: given 0: out of range" in str(err)
    err = config_error({"shards": [{"backup": {"port": "6000"}}]})
    assert 'shards[0].backup.port: given "6000": not a port number' in str(err)
    err = config_error({"shards": 3, "port_base": 65500})
    lines = str(err).splitlines()
    assert lines[0].startswith("c.yaml: shards[2].primary.port: given 65540 (port_base 65500 "
                               "+ 40): out of range")
    assert lines[1].startswith("c.yaml: shards[2].backup.port: given 65550")
    assert "lower port_base or give this server a port" in lines[0]


def test_bad_cores_are_named():
    err = config_error({"shards": [{}, {"backup": {"cores": "3-1"}}]})
    assert err.field == "shards[1].backup.cores"
    assert "shards[1].backup.cores: given \"3-1\": range '3-1' runs backwards" in str(err)
    err = config_error({"shards": [{"primary": {"cores": [1, "x"]}}]})
    assert 'shards[0].primary.cores: given [1, "x"]: "x" is not a core number; expected ' \
           '"auto", a core number, a list like [2, 3] or a string like "2-3,6"' in str(err)
    err = config_error({"shards": [{"primary": {"cores": []}}]})
    assert "shards[0].primary.cores: given []: an empty core set" in str(err)
    err = config_error({"shards": [{"primary": {"cores": [-1]}}]})
    assert "core -1 is negative" in str(err)


def test_address_fields():
    err = config_error({"shards": [{"primary": {"host": "localhost"}}]})
    assert 'shards[0].primary.host: given "localhost": not an IPv4 address; expected a ' \
           'dotted IPv4 address' in str(err)
    err = config_error({"shards": [{"primary": {"host": "127.0.0.1", "nic": "lo"}}]})
    assert err.field == "shards[0].primary"
    assert 'given {"host": "127.0.0.1", "nic": "lo"}: both host and nic are set' in str(err)
    err = config_error({"shards": [{"backup": {"host": "0.0.0.0"}}]})
    assert "0.0.0.0 cannot be a server's address" in str(err)
    err = config_error({"shards": 1, "control": "tcp://localhost:5555"})
    assert 'control: given "tcp://localhost:5555": \'localhost\' is not an IPv4 address' \
        in str(err)
    assert parse_config({"shards": 1, "control": "tcp://*:5600"}).control_address == "0.0.0.0"


def test_prefix_pinned_to_two_shards_names_both():
    err = config_error({"shards": [{"name": "cfg", "prefixes": ["/config/"]},
                                   {"name": "users", "prefixes": ["/users/", "/config/"]}]})
    assert err.field == "shards[1].prefixes[1]"
    assert str(err) == ('c.yaml: shards[1].prefixes[1]: given "/config/": pinned to two '
                        'shards: cfg (shards[0].prefixes[0]) and users; a prefix may be '
                        'pinned to one shard only')
    err = config_error({"shards": [{"prefixes": ["/a/", "/a/"]}]})
    assert 'shards[0].prefixes[1]: given "/a/": pinned twice in shard s0 (also ' \
           'shards[0].prefixes[0])' in str(err)
    err = config_error({"shards": [{"prefixes": [""]}]})
    assert 'shards[0].prefixes[0]: given "": an empty prefix would pin every key' in str(err)
    # nested prefixes are fine: the longest pinned prefix wins
    cfg = parse_config({"shards": [{"prefixes": ["/a/"]}, {"prefixes": ["/a/b/"]}]})
    assert [s.prefixes for s in cfg.shards] == [["/a/"], ["/a/b/"]]


def test_duplicate_shard_names_and_timeouts():
    err = config_error({"shards": [{"name": "s1"}, {}]})
    assert 'shards[1].name: given "s1": already the name of shards[0]' in str(err)
    err = config_error({"shards": [{"name": "a/b"}]})
    assert 'shards[0].name: given "a/b": expected 1-64 letters' in str(err)
    err = config_error({"shards": 1, "heartbeat_s": 2, "silence_timeout_s": 2})
    assert err.field == "silence_timeout_s"
    assert "silence_timeout_s: given 2.0: must be longer than heartbeat_s (2 s)" in str(err)
    err = config_error({"shards": 1, "heartbeat_s": True})
    assert "heartbeat_s: given true: not a number of seconds" in str(err)
    err = config_error({"shards": 1, "heartbeat_s": -1})
    assert "heartbeat_s: given -1: expected a number of seconds > 0" in str(err)


def test_several_errors_are_reported_together():
    err = config_error({"shards": [{"primary": {"port": 0, "cores": "x"}}], "bogus": 1})
    text = str(err)
    assert "shards[0].primary.port: given 0" in text
    assert 'shards[0].primary.cores: given "x"' in text
    assert "bogus: given 1: unknown field" in text
    assert len(text.splitlines()) == 3


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"cluster\.yaml: invalid YAML: line 3, column \d+"):
        load_config(write(tmp_path, "shards: 1\nport_base: 6000\n  oops: [\n"))
    path = write(tmp_path, "shards: 1\nport_base: 6000\nport_base: 7000\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}: line 3: duplicate key \"port_base\" (first at line "
                               "2); each key may appear once per mapping")
    with pytest.raises(ConfigError, match="the config is empty"):
        load_config(write(tmp_path, "# nothing\n"))
    with pytest.raises(ConfigError, match=r"given \[1, 2\]: expected a mapping with fields: "
                                          r"cluster, control"):
        load_config(write(tmp_path, "[1, 2]\n"))
    with pytest.raises(ConfigError, match="nope.yaml: cannot read: No such file"):
        load_config(tmp_path / "nope.yaml")
    path = write(tmp_path, "shards:\n  - name: a\n    primary: {cpus: 1}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: shards[0].primary.cpus: given 1: unknown field")


# ---------------------------------------------------------------- placement against a host

def test_core_the_host_lacks_lists_its_cores():
    err = plan_error({"shards": [{}, {"backup": {"cores": [2, 7]}}]}, host(cores=range(4)))
    assert err.field == "shards[1].backup.cores"
    assert str(err) == ("shards[1].backup.cores: given [2, 7]: core 7 is not usable on host "
                        "facts.yaml; it has cores 0-3 (4 cores)")
    err = plan_error({"shards": [{"primary": {"cores": "8-9"}}]}, host(cores=range(4)))
    assert "given [8, 9]: cores 8-9 are not usable" in str(err)


def test_nic_the_host_lacks_lists_its_nics():
    err = plan_error({"shards": [{"primary": {"nic": "eth9"}}]})
    assert err.field == "shards[0].primary.nic"
    assert str(err) == ('shards[0].primary.nic: given "eth9": no NIC of that name on host '
                        'facts.yaml; it has: lo (127.0.0.1), eth0 (10.0.0.5), eth1 '
                        '(10.1.0.5), dummy0 (no IPv4)')


def test_nic_without_ipv4():
    err = plan_error({"shards": [{}, {"backup": {"nic": "dummy0"}}]})
    assert err.field == "shards[1].backup.nic"
    assert str(err) == ('shards[1].backup.nic: given "dummy0": NIC dummy0 has no IPv4 '
                        'address; NICs with IPv4 on host facts.yaml: lo (127.0.0.1), eth0 '
                        '(10.0.0.5), eth1 (10.1.0.5)')


def test_address_the_host_lacks():
    err = plan_error({"shards": [{"primary": {"host": "10.9.9.9"}}]})
    assert 'shards[0].primary.host: given "10.9.9.9": no NIC of host facts.yaml holds this ' \
           'address; its IPv4 addresses: lo (127.0.0.1), eth0 (10.0.0.5)' in str(err)
    err = plan_error({"shards": 1, "control": "tcp://10.9.9.9:5555"})
    assert err.field == "control"
    assert 'control: given "tcp://10.9.9.9:5555": no NIC of host facts.yaml holds address ' \
           '10.9.9.9' in str(err)
    # any loopback address belongs to lo
    the_plan = plan(parse_config({"shards": [{"primary": {"host": "127.0.0.2"}}]}), host())
    assert (the_plan.shards[0].primary.nic, the_plan.shards[0].primary.address) == \
        ("lo", "127.0.0.2")


def test_overlapping_port_ranges_name_both_servers():
    err = plan_error({"shards": [{"primary": {"port": 7000}, "backup": {"port": 7010}},
                                 {"name": "b", "primary": {"port": 7012}}]})
    assert err.field == "shards[1].primary.port"
    assert str(err) == ("shards[1].primary.port: given 7012: ports 7012-7015 of b/primary "
                        "overlap ports 7010-7013 of s0/backup (shards[0].backup.port) on "
                        "127.0.0.1; a server uses port..port+3, so port bases on one address "
                        "must be at least 4 apart")
    # a derived port says where it came from
    err = plan_error({"shards": [{"primary": {"port": 6020}}, {}]})
    assert "shards[1].primary.port: given 6020 (from port_base 6000): ports 6020-6023 of " \
           "s1/primary overlap ports 6020-6023 of s0/primary" in str(err)
    # the same ports on two different addresses do not collide
    ok = plan(parse_config({"shards": [{"primary": {"nic": "eth0", "port": 7000},
                                        "backup": {"nic": "eth1", "port": 7000}}]}), host())
    assert [s.address for s in ok.servers] == ["10.0.0.5", "10.1.0.5"]


def test_server_ports_holding_the_control_port():
    err = plan_error({"shards": [{"primary": {"port": 5553}}]})
    assert err.field == "shards[0].primary.port"
    assert str(err) == ("shards[0].primary.port: given 5553: ports 5553-5556 of s0/primary "
                        "include the control port 5555 (control: tcp://127.0.0.1:5555); move "
                        "the server or the control endpoint")
    err = plan_error({"shards": [{"primary": {"nic": "eth0", "port": 5555}}],
                      "control": "tcp://*:5555"})
    assert "ports 5555-5558 of s0/primary include the control port 5555 " \
           "(control: tcp://*:5555)" in str(err)
    plan(parse_config({"shards": [{"primary": {"nic": "eth0", "port": 5555}}]}), host())


def test_every_misfit_is_reported_at_once():
    err = plan_error({"shards": [{"primary": {"cores": [9], "nic": "eth7"},
                                  "backup": {"port": 5554}}]})
    lines = str(err).splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "shards[0].primary.cores", "shards[0].primary.nic", "shards[0].backup.port"]


def test_auto_spreads_each_pair_over_different_cores():
    for cores in (range(2), range(3), range(4), range(16), (0, 5, 9)):
        for shards in range(1, 9):
            the_plan = plan(parse_config({"shards": shards}), host(cores=cores))
            for sh in the_plan.shards:
                assert len(sh.primary.cores) == len(sh.backup.cores) == 1
                assert sh.primary.cores != sh.backup.cores, (list(cores), shards, sh)
                assert set(sh.primary.cores + sh.backup.cores) <= set(cores)
                assert sh.primary.cores_auto and sh.backup.cores_auto
            assert not the_plan.notes
            used = [s.cores[0] for s in the_plan.servers]
            # round-robin: every core is used before any is used twice
            assert len(set(used)) == min(len(used), len(list(cores)))


def test_auto_on_two_cores_balances_primaries_and_avoids_explicit_cores():
    the_plan = plan(parse_config({"shards": 4}), host(cores=(0, 1)))
    assert [(s.primary.cores[0], s.backup.cores[0]) for s in the_plan.shards] == [
        (0, 1), (1, 0), (0, 1), (1, 0)]
    # explicit cores are left to their owners while the pool has others
    the_plan = plan(parse_config({"shards": [{"primary": {"cores": [0]}}, {}, {}]}),
                    host(cores=range(4)))
    assert the_plan.shards[0].primary.cores == (0,)
    assert the_plan.shards[0].backup.cores != (0,)
    assert all(0 not in s.cores for s in the_plan.servers[1:])
    # a backup never lands on its explicit primary's core, even from a full pool
    the_plan = plan(parse_config({"shards": [{"primary": {"cores": [1]}}]}),
                    host(cores=(0, 1)))
    assert the_plan.shards[0].backup.cores == (0,)
    # same input, same plan
    assert plan(parse_config({"shards": 5}), host()) == plan(parse_config({"shards": 5}),
                                                             host())


def test_single_core_host_notes_the_shared_core():
    the_plan = plan(parse_config({"shards": 2}), host(cores=(3,)))
    assert {s.cores for s in the_plan.servers} == {(3,)}
    assert the_plan.notes == ("shard s0: primary and backup share core(s) 3",
                              "shard s1: primary and backup share core(s) 3")


def test_plan_carries_routing_parameters_and_endpoints():
    the_plan = plan(parse_config({"shards": [{"prefixes": ["/config/"]}, {},
                                             {"prefixes": ["/users/", "/u/"]}]}), host())
    assert the_plan.routing.shard_count == 3
    assert the_plan.routing.prefixes == (("/config/",), (), ("/users/", "/u/"))
    assert the_plan.routing.pins() == {"/config/": 0, "/users/": 2, "/u/": 2}
    backup = the_plan.server("s2/backup")
    assert backup.ports == (6050, 6051, 6052, 6053)
    assert backup.endpoint("snapshot") == "tcp://127.0.0.1:6050"
    assert backup.endpoint("peer") == "tcp://127.0.0.1:6053"
    data = json.loads(json.dumps(the_plan.to_dict()))
    assert data["routing"] == {"shard_count": 3,
                               "prefixes": [["/config/"], [], ["/users/", "/u/"]],
                               "epoch": 1}
    assert data["shards"][2]["backup"]["endpoints"]["updates"] == "tcp://127.0.0.1:6051"


# ---------------------------------------------------------------- shipped files and host facts

@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_loopback_configs_plan_on_this_host(name):
    the_plan = load_plan(ROOT / "configs" / name)
    assert len(the_plan.shards) == SHIPPED[name]
    assert len(the_plan.servers) == 2 * SHIPPED[name]
    assert the_plan.control == "tcp://127.0.0.1:5555"
    for i, sh in enumerate(the_plan.shards):
        assert (sh.primary.port, sh.backup.port) == (6000 + 20 * i, 6010 + 20 * i)
        assert sh.primary.address == sh.backup.address == "127.0.0.1"
        assert sh.primary.cores != sh.backup.cores
        assert set(sh.primary.cores + sh.backup.cores) <= set(local_host_facts().cores)


def test_shipped_16core_scale_config_gives_every_server_a_core_of_its_own():
    """configs/16core-scale.yaml (the scale test's config): primaries on cores 0-5, backups on
    6-11, nothing on 12-15 (the load generator's cores)."""
    the_plan = plan(load_config(ROOT / "configs" / "16core-scale.yaml"), load_host_facts(FACTS_16))
    assert len(the_plan.shards) == 6
    for i, sh in enumerate(the_plan.shards):
        assert (sh.primary.cores, sh.backup.cores) == ((i,), (6 + i,))
        assert sh.primary.address == sh.backup.address == "127.0.0.1"
    used = [c for s in the_plan.servers for c in s.cores]
    assert sorted(used) == list(range(12))


def test_shipped_16core_config_uses_every_option():
    facts = load_host_facts(FACTS_16)
    assert facts.cores == tuple(range(16)) and not facts.local
    assert facts.nics == {"lo": ("127.0.0.1",), "eth0": ("10.0.0.5",), "eth1": ("10.1.0.5",)}
    cfg = load_config(ROOT / "configs" / "16core-2nic.yaml")
    the_plan = plan(cfg, facts)
    servers = {s.name: s for s in the_plan.servers}
    assert (the_plan.heartbeat_s, the_plan.silence_timeout_s) == (0.5, 2.0)
    assert the_plan.control == "tcp://10.1.0.5:5555"
    assert servers["config/primary"].cores == (2, 3)
    assert (servers["config/backup"].nic, servers["config/backup"].address) == \
        ("eth1", "10.1.0.5")
    assert servers["users/primary"].nic == "eth0"  # given by host address
    assert servers["users/backup"].cores == (12,)
    autos = [s for s in the_plan.servers if s.cores_auto]
    assert len(autos) == 6
    explicit = {c for s in the_plan.servers if not s.cores_auto for c in s.cores}
    assert not explicit & {c for s in autos for c in s.cores}
    assert len({s.cores for s in autos}) == 6
    assert the_plan.routing.prefixes[:2] == (("/config/", "/schema/"), ("/users/",))
    assert [s.name for s in cfg.shards] == ["config", "users", "orders", "events", "s4"]
    # the same config does not fit this host (no 10.1.0.5 here), and says why
    with pytest.raises(ConfigError, match=r'control: given "tcp://10\.1\.0\.5:5555": no NIC '
                                          r'of this host holds address 10\.1\.0\.5'):
        plan(cfg, local_host_facts())


def test_host_facts_file_errors(tmp_path):
    path = write(tmp_path, "cores: 0-3\nnics:\n  eth0: [10.0.0.300]\n", "h.yaml")
    with pytest.raises(ConfigError, match=r"nics\.eth0: given \[\"10\.0\.0\.300\"\]: "
                                          r"'10\.0\.0\.300' is not an IPv4 address"):
        load_host_facts(path)
    path = write(tmp_path, "cores: auto\nnics: {}\n", "h.yaml")
    with pytest.raises(ConfigError, match='cores: given "auto": "auto" describes no host'):
        load_host_facts(path)
    path = write(tmp_path, "cores: 0-3\nnic: {}\n", "h.yaml")
    with pytest.raises(ConfigError, match="nic: given {}: unknown field"):
        load_host_facts(path)


def test_local_host_facts_match_this_process():
    import psutil

    facts = local_host_facts()
    assert facts.local
    assert facts.cores == tuple(sorted(psutil.Process().cpu_affinity()))
    assert "127.0.0.1" in facts.ipv4_of("lo")


# ---------------------------------------------------------------- ports actually in use

def test_port_in_use_is_refused_naming_server_and_port(tmp_path):
    base = free_port_base(40)
    path = write(tmp_path, f"""
        control: tcp://127.0.0.1:{base + 30}
        shards: 1
        port_base: {base}
        """)
    the_plan = load_plan(path)
    check_ports_free(the_plan)  # all free now
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", base + 12))
        holder.listen()
        assert probe_port("127.0.0.1", base + 12) == "already in use"
        with pytest.raises(ConfigError) as info:
            check_ports_free(the_plan, source=str(path))
    finally:
        holder.close()
    assert info.value.field == "shards[0].backup.port"
    assert str(info.value) == (
        f"{path}: shards[0].backup.port: given {base + 10}: port {base + 12} of s0/backup "
        f"(collector, P+2) cannot be bound on 127.0.0.1: already in use; stop what holds it "
        f"or pick another port")


def test_control_port_in_use_is_refused():
    base = free_port_base(40)
    the_plan = plan(parse_config({"shards": 1, "port_base": base,
                                  "control": f"tcp://127.0.0.1:{base + 30}"}),
                    local_host_facts())
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", base + 30))
        holder.listen()
        with pytest.raises(ConfigError) as info:
            check_ports_free(the_plan)
    finally:
        holder.close()
    assert info.value.field == "control"
    assert f"control port {base + 30} cannot be bound on 127.0.0.1: already in use" \
        in str(info.value)


# ---------------------------------------------------------------- the CLI

def run_cli(procs, *args: str):
    proc = procs.python("-m", "clonemap.supervisor", "validate", *args)
    code = proc.wait(60)
    proc.stop()  # joins the output readers
    return code, "\n".join(proc.stdout), "\n".join(proc.stderr)


def test_cli_prints_the_4shard_plan(procs):
    # --no-port-check: other tests may run the real 4-shard cluster on these ports now;
    # the probe itself is exercised on free ports below.
    code, out, err = run_cli(procs, "configs/4shard.yaml", "--no-port-check")
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("s") and "127.0.0.1" in line]
    assert len(rows) == 8
    assert "cluster four: 4 shards, 8 servers" in out
    assert "control tcp://127.0.0.1:5555   heartbeat 1 s   silence timeout 3 s" in out
    assert any("s3" in r and "backup" in r and "6070-6073" in r for r in rows)
    code, out, err = run_cli(procs, "configs/4shard.yaml", "--no-port-check", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["valid"] is True and data["ports_checked"] is False
    assert len(data["shards"]) == 4
    assert [sh["primary"]["port"] for sh in data["shards"]] == [6000, 6020, 6040, 6060]


def test_cli_shows_io_threads_only_where_a_server_has_more_than_one(procs, tmp_path):
    path = write(tmp_path, "shards:\n  - {primary: {io_threads: 4}}\n")
    code, out, err = run_cli(procs, str(path), "--no-port-check")
    assert code == 0, err
    assert "I/O threads" in out
    rows = [[cell.strip() for cell in line.split("│")] for line in out.splitlines()
            if line.startswith("s0")]
    assert [(r[1], r[-1]) for r in rows] == [("primary", "4"), ("backup", "1")]
    code, out, err = run_cli(procs, "configs/4shard.yaml", "--no-port-check", "--json")
    assert code == 0 and json.loads(out)["shards"][0]["primary"]["io_threads"] == 1, err
    code, out, err = run_cli(procs, "configs/4shard.yaml", "--no-port-check")
    assert code == 0 and "I/O threads" not in out, err


def test_cli_checks_ports_and_refuses_a_taken_one(procs, tmp_path):
    base = free_port_base(40)
    path = write(tmp_path, f"control: tcp://127.0.0.1:{base + 30}\nshards: 1\n"
                           f"port_base: {base}\n")
    code, out, err = run_cli(procs, str(path))
    assert code == 0, err
    assert "valid: every port is free on this host" in out
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", base + 1))
        holder.listen()
        code, out, err = run_cli(procs, str(path))
    finally:
        holder.close()
    assert code == 2
    assert out == ""
    assert f"error: {path}: shards[0].primary.port: given {base}: port {base + 1} of " \
           f"s0/primary (updates, P+1) cannot be bound on 127.0.0.1: already in use" in err


def test_cli_bad_config_exits_2_with_the_message_on_stderr(procs, tmp_path):
    path = write(tmp_path, "shards:\n  - primary: {cores: [0, 99]}\n")
    code, out, err = run_cli(procs, str(path))
    assert code == ConfigError.exit_code == 2
    assert out == ""
    assert err.strip() == (f"error: {path}: shards[0].primary.cores: given [0, 99]: core 99 "
                           f"is not usable on this host; it has cores "
                           f"{local_host_facts().describe_cores()}")
    code, out, err = run_cli(procs, str(write(tmp_path, "shards: 1\nshard: 2\n", "t.yaml")))
    assert code == 2 and 'shard: given 2: unknown field' in err


def test_cli_plans_for_another_host(procs):
    code, out, err = run_cli(procs, "configs/16core-2nic.yaml", "--host-facts", str(FACTS_16))
    assert code == 0, err
    assert "cluster big: 5 shards, 10 servers" in out
    assert "ports not probed (host facts from" in out
    assert "/config/, /schema/" in out
    code, out, err = run_cli(procs, "configs/16core-2nic.yaml")
    assert code == 2 and out == ""
    assert err.splitlines()[0] == ('error: configs/16core-2nic.yaml: control: given '
                                   '"tcp://10.1.0.5:5555": no NIC of this host holds address '
                                   '10.1.0.5; its IPv4 addresses: '
                                   + local_host_facts().describe_nics(ipv4_only=True))


def test_validate_warns_when_a_non_loopback_bind_has_curve_off(tmp_path):
    facts = load_host_facts(FACTS_16)
    exposed = plan(load_config(ROOT / "configs" / "16core-2nic.yaml"), facts)
    warnings = [n for n in exposed.notes if "security.curve off" in n]
    assert len(warnings) == 1 and "10.0.0.5" in warnings[0] and "10.1.0.5" in warnings[0]
    data = yaml.safe_load((ROOT / "configs" / "16core-2nic.yaml").read_text())
    data["security"] = {"curve": True}
    path = tmp_path / "secure.yaml"
    path.write_text(yaml.safe_dump(data))
    secure = plan(load_config(path), facts)
    assert not [n for n in secure.notes if "curve" in n]
    assert secure.curve and secure.keys_dir == str(tmp_path / "keys")
    local = plan(load_config(ROOT / "configs" / "4shard.yaml"), facts)
    assert not [n for n in local.notes if "curve" in n]  # loopback only


def test_security_and_limits_fields_are_checked():
    with pytest.raises(ConfigError, match="security.curvy"):
        parse_config({"shards": 1, "security": {"curvy": True}})
    with pytest.raises(ConfigError, match="limits.control_message_bytes"):
        parse_config({"shards": 1, "limits": {"control_message_bytes": 10}})
    cfg = parse_config({"shards": 1, "limits": {"control_held_bytes": 1 << 20}})
    assert cfg.limits.control_held_bytes == 1 << 20 and cfg.limits.control_message_bytes == 1 << 20


def test_relays_are_placed_per_shard_after_the_port_base_and_checked():
    h = host()
    p = plan(parse_config({"shards": 2, "port_base": 6000, "relays": {"per_shard": 2}}), h)
    assert [(r.name, r.port) for r in p.relays] == [
        ("s0/relay0", 7000), ("s0/relay1", 7004), ("s1/relay0", 7008), ("s1/relay1", 7012)]
    assert p.to_dict()["relays"][0]["address"] == "127.0.0.1"
    only = plan(parse_config({"shards": 2, "relays": {"per_shard": 1, "shards": ["s1"],
                                                      "port_base": 9000}}), h)
    assert [(r.name, r.port) for r in only.relays] == [("s1/relay0", 9004)]
    with pytest.raises(ConfigError, match="relays.shards.*no shard 's7'"):
        plan(parse_config({"shards": 2, "relays": {"per_shard": 1, "shards": ["s7"]}}), h)
    with pytest.raises(ConfigError, match="overlap"):  # relays on the servers' ports
        plan(parse_config({"shards": 1, "port_base": 6000,
                           "relays": {"per_shard": 1, "port_base": 6010}}), h)
    assert plan(parse_config({"shards": 1}), h).relays == ()


# ---------------------------------------------------------------- several hosts

THREE = ROOT / "configs" / "3host.yaml"


def test_a_three_host_config_plans_each_hosts_part():
    config = load_config(THREE)
    for name in ("a", "b", "c"):
        the_plan = plan(config, load_host_facts(ROOT / "configs" / "hosts" /
                                                f"3host-{name}.yaml"), host=name)
        local = [s.name for s in the_plan.servers if the_plan.is_local(s)]
        assert len(local) == 2 and len(the_plan.servers) == 6  # the map: every server
        assert the_plan.control == dict(the_plan.hosts)[name]
        assert the_plan.across == frozenset({0, 1, 2})
        assert the_plan.coordination == ("etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379",
                                         5.0, "sync")


def test_a_config_with_hosts_needs_the_host_it_is_planned_for():
    config = load_config(THREE)
    facts = load_host_facts(ROOT / "configs" / "hosts" / "3host-a.yaml")
    with pytest.raises(ConfigError, match="say which one this is with --host NAME"):
        plan(config, facts)
    with pytest.raises(ConfigError, match="'d' is not one of them"):
        plan(config, facts, host="d")
    with pytest.raises(ConfigError, match="names no hosts"):
        plan(load_config(ROOT / "configs" / "4shard.yaml"), facts, host="a")
    # host a's facts cannot run host b's part: its addresses are elsewhere
    with pytest.raises(ConfigError, match="no NIC of host .* holds"):
        plan(config, facts, host="b")


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("coordination"), "a pair across two hosts needs a tie-breaker"),
    (lambda d: d["shards"][0]["primary"].pop("at"), "must say where each server runs"),
    (lambda d: d["shards"][0]["primary"].update(at="z"), "not a host of this config"),
    (lambda d: d.update(hosts={}), "no hosts named"),
    (lambda d: d["coordination"].update(etcd=[]), "at least one etcd member"),
    (lambda d: d["coordination"].update(lease_s=1), "greater than or equal to 2"),
])
def test_a_config_over_hosts_is_checked(change, message):
    data = yaml.safe_load(THREE.read_text())
    change(data)
    assert message in str(config_error(data))


def test_at_without_hosts_is_refused():
    err = config_error({"shards": [{"primary": {"at": "a"}}]})
    assert "this config names no hosts" in str(err)


def test_validate_plans_one_hosts_part_and_marks_the_others(procs):
    code, out, err = run_cli(procs, str(THREE), "--host", "b", "--host-facts",
                             str(ROOT / "configs" / "hosts" / "3host-b.yaml"))
    assert code == 0, err
    assert "host b of a, b, c" in out and out.count("(another host)") == 4
    code, out, err = run_cli(procs, str(THREE), "--host-facts",
                             str(ROOT / "configs" / "hosts" / "3host-b.yaml"))
    assert code == 2 and "--host NAME" in err

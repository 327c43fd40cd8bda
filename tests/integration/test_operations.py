"""Operating a cluster as the README tells users to: ``supervisor start`` of a shipped
config (free ports), the CLIs with their default timeouts, servers killed and restarted.

* Metrics: ``/metrics`` in Prometheus text format, parsed with prometheus_client's own
  parser; every family the README lists, with values that follow writes, a kill, the
  restart and the takeover; the Grafana dashboard names only metrics a live scrape has.
* Status that tells the truth: READY only once every shard has an ACTIVE server; a shard
  with none is exit 1 and said in words; a takeover is an event line.
* A second ``start`` of a running cluster, and ``validate`` of it: one line each.
* One way to name the cluster for every control command, before or after it.
* ``chp get/set/del`` talk only to the owning shard (the other shard frozen); a client
  planned from another config is told at once.
* The client's Prometheus collector.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import wait_until
from clonemap.client.api import Clone
from clonemap.client.metrics import CLIENT_METRIC_NAMES, CloneCollector
from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.routing import ShardMap
from clonemap.supervisor.metrics import METRIC_NAMES
from test_supervisor_cli import PYTHON, ROOT, cli, start, status, wait_status, write_config

pytestmark = pytest.mark.timeout(240)
DASHBOARD = ROOT / "configs" / "grafana" / "clonemap-dashboard.json"
DEADLINE_S = 30.0


def scrape(url: str) -> dict[str, list]:
    """Family name -> samples, from the endpoint, parsed by prometheus_client."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def sample(families: dict, name: str, **labels) -> float | None:
    """The value of the one sample named ``name`` whose labels include ``labels``."""
    for samples in families.values():
        for s in samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None




def metrics_url(config) -> str:
    data = yaml.safe_load(config.read_text())
    return f"http://{data['metrics']}/metrics"


def exported(name: str) -> str:
    """The family a dashboard query's series belongs to."""
    for suffix in ("_bucket", "_count", "_sum"):
        if name.endswith(suffix) and name.removesuffix(suffix) in METRIC_NAMES:
            return name.removesuffix(suffix)
    return name


def dashboard_metrics() -> set[str]:
    import re

    doc = json.loads(DASHBOARD.read_text())
    names = set()
    for panel in doc["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names |= set(re.findall(r"\b(?:clonemap|process)_[a-z_]+", target["expr"]))
    return names


# ---------------------------------------------------------------- metrics and status

def test_metrics_status_and_takeover_under_the_supervisor(procs, tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml")
    sup = start(procs, config, tmp_path)
    ready = next(line for line in sup.stdout if line.startswith("READY supervisor"))
    assert "active_shards=1/1" in ready and f"metrics={metrics_url(config)}" in ready
    rows = status(control)  # READY came after an ACTIVE server: no wait needed here
    assert rows["s0/primary"]["bstar"] == "ACTIVE", rows

    url = metrics_url(config)
    families = scrape(url)
    for name in METRIC_NAMES:
        assert name.removesuffix("_total") in families, name
    assert "process_resident_memory_bytes" in families
    assert sample(families, "clonemap_server_up", shard="s0", role="primary") == 1
    assert sample(families, "clonemap_server_up", shard="s0", role="backup") == 1
    assert sample(families, "clonemap_server_active", shard="s0", role="primary") == 1
    assert sample(families, "clonemap_server_active", shard="s0", role="backup") == 0
    assert sample(families, "clonemap_shard_has_active", shard="s0", cluster="one") == 1
    # nothing here is cut off by a refused route: the guard is on and turned no send
    assert sample(families, "clonemap_refused_sends_total", shard="s0", role="primary") == 0

    with Clone(config=str(config), codec="bytes", timeout_s=10) as clone:
        for i in range(10):
            clone.set(f"/ops/{i}", b"v", wait=True)
    def written():
        # each server's stats are polled about once a second, each at its own moment: the
        # primary's may show the 10 keys while the backup's last poll predates them
        f = scrape(url)
        if (sample(f, "clonemap_shard_keys", shard="s0") == 10
                and sample(f, "clonemap_persist_fsync_seconds_count", shard="s0",
                           role="primary")
                and sample(f, "clonemap_replica_lag_updates", shard="s0", role="backup") == 0):
            return f
        return None

    families = wait_until(written, "keys, an fsync and a backup with no lag in the metrics")
    assert sample(families, "clonemap_shard_sequence", shard="s0") >= 10
    assert sample(families, "clonemap_updates_total", shard="s0", role="primary") >= 10
    assert sample(families, "clonemap_server_rss_bytes", shard="s0", role="primary") > 1e6
    assert sample(families, "clonemap_server_cpu_seconds_total", shard="s0",
                  role="primary") > 0
    assert sample(families, "clonemap_broker_workers") >= 2

    out = cli("kill", "s0/primary", str(config))  # CONFIG after the command
    assert out.returncode == 0, out.stderr
    wait_status(control, lambda rows: rows["s0/backup"]["bstar"] == "ACTIVE"
                and rows["s0/primary"]["bstar"] == "PASSIVE")
    out = cli("--config", str(config), "status")  # the option before the command
    assert out.returncode == 0, out.stdout + out.stderr
    assert "s0: backup took over from primary" in out.stdout
    families = scrape(url)
    assert sample(families, "clonemap_failovers_total", shard="s0") == 1
    assert sample(families, "clonemap_server_restarts_total", shard="s0", role="primary") == 1
    assert sample(families, "clonemap_server_active", shard="s0", role="backup") == 1

    live = set(families)
    for name in dashboard_metrics():
        assert exported(name).removesuffix("_total") in live, name


def test_a_shard_without_an_active_server_is_exit_1_in_words(procs, tmp_path):
    """The active killed, its restart 60 s away, and no client yet to vote: the backup
    stays PASSIVE (Binary Star), so the shard has no ACTIVE server; then the backup
    killed too."""
    config, control = write_config(tmp_path, "1shard.yaml")
    start(procs, config, tmp_path, "--backoff-initial-s", "60")
    wait_status(control, lambda rows: rows["s0/primary"]["bstar"] == "ACTIVE")
    assert cli("kill", "s0/primary", "--control", control).returncode == 0
    wait_status(control, lambda rows: rows["s0/primary"]["state"] == "BACKOFF")
    out = cli("status", "--control", control)
    assert out.returncode == 1
    assert ("s0 has no ACTIVE server: the backup is PASSIVE and takes over at the next "
            "client request") in " ".join(out.stdout.split()), out.stdout
    assert cli("--control", control, "kill", "s0/backup").returncode == 0
    wait_status(control, lambda rows: rows["s0/backup"]["state"] == "BACKOFF")
    out = cli("status", "--control", control)
    assert out.returncode == 1
    assert ("s0 has no ACTIVE server: its clients cannot read a snapshot or write now"
            in " ".join(out.stdout.split())), out.stdout
    assert "bstar -: no stats from that run" in out.stdout
    summary = json.loads(cli("status", "--json", "--control", control).stdout)["summary"]
    assert summary["without_active"] == ["s0"]
    families = scrape(metrics_url(config))
    assert sample(families, "clonemap_shard_has_active", shard="s0") == 0
    assert sample(families, "clonemap_server_up", shard="s0", role="primary") == 0


def test_a_second_start_and_validate_of_a_running_cluster_say_so_in_one_line(procs,
                                                                               tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml")
    sup = start(procs, config, tmp_path)
    out = subprocess.run([PYTHON, "-m", "clonemap.supervisor", "start", str(config), "--run-dir",
                          str(tmp_path / "other-run")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 3
    assert out.stderr.strip() == (f"error: cluster one is already running (pid {sup.pid}, "
                                  f"control {control})")
    out = cli("validate", str(config))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "already running" in lines[0] and "--no-port-check" in lines[0]
    assert cli("validate", str(config), "--no-port-check").returncode == 0


def test_the_metrics_port_is_checked_and_can_be_off(procs, tmp_path):
    config, _ = write_config(tmp_path, "1shard.yaml")
    data = yaml.safe_load(config.read_text())
    host, port = data["metrics"].split(":")
    import socket

    taken = socket.socket()
    taken.bind((host, int(port)))
    taken.listen()
    try:
        out = cli("validate", str(config))
        assert out.returncode == 2 and f"metrics port {port} cannot be bound" in out.stderr
    finally:
        taken.close()
    data["metrics"] = "off"
    config.write_text(yaml.safe_dump(data))
    sup = start(procs, config, tmp_path)
    ready = next(line for line in sup.stdout if line.startswith("READY supervisor"))
    assert "metrics=" not in ready
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2)


def test_the_dashboard_is_valid_json_naming_only_exported_metrics():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["panels"] and doc["title"] == "clonemap"
    names = dashboard_metrics()
    assert len(names) >= 15
    for name in names:
        assert exported(name) in METRIC_NAMES or name.startswith("process_"), name


# ---------------------------------------------------------------- chp and clients

def frozen(pids):
    """SIGSTOP these processes (the supervisor's servers, not ended: resumed after)."""
    class Frozen:
        def __enter__(self):
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)

        def __exit__(self, *exc):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
    return Frozen()


def chp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "clonemap.client.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_chp_talks_only_to_the_owning_shard_and_a_wrong_config_is_told(procs, tmp_path):
    config, control = write_config(tmp_path, "2shard.yaml")
    start(procs, config, tmp_path)
    rows = wait_status(control, lambda rows: all(
        rows[f"s{i}/primary"]["bstar"] == "ACTIVE" for i in range(2)))
    shard_map = ShardMap(2)
    key = next(f"/k{i}/x" for i in range(100) if shard_map.owner(f"/k{i}/x".encode()) == 0)
    plain = next(f"plain{i}" for i in range(100) if shard_map.owner(f"plain{i}".encode()) == 0)
    # every server of s1 frozen: a key of s0 needs nothing from s1 (default timeouts)
    with frozen([rows["s1/primary"]["pid"], rows["s1/backup"]["pid"]]):
        for k in (key, plain):
            assert chp("--config", str(config), "set", k, "v").returncode == 0
            out = chp("--config", str(config), "get", k)
            assert (out.returncode, out.stdout) == (0, "v\n"), out.stderr
            assert chp("--config", str(config), "del", k).returncode == 0
    # a config of one shard over the same ports: its "s0" is the cluster's s0 of 2
    wrong = yaml.safe_load(config.read_text())
    wrong["shards"] = wrong["shards"][:1] if isinstance(wrong["shards"], list) else 1
    wrong_path = tmp_path / "wrong.yaml"
    wrong_path.write_text(yaml.safe_dump(wrong))
    out = chp("--config", str(wrong_path), "get", "/a/b")
    assert out.returncode == 2, out.stderr
    assert "wrong cluster map: this client routes keys over 1 shard " in out.stderr
    assert "shard 0 of 2" in out.stderr
    assert out.stderr.count("wrong cluster map") == 1, out.stderr  # said once
    with pytest.raises(ConfigError, match="wrong cluster map"):
        Clone(config=str(wrong_path), timeout_s=10)


def test_the_client_collector_exports_its_stats(procs, tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml")
    start(procs, config, tmp_path)
    with Clone(config=str(config), codec="bytes", timeout_s=10) as clone:
        clone.set("/c/1", b"x", wait=True)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(CloneCollector(clone, client="test"))
        text = generate_latest(registry).decode()
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    for name in CLIENT_METRIC_NAMES:
        assert name.removesuffix("_total") in families, name
    assert sample(families, "clonemap_client_keys", client="test", shard="s0") == 1
    assert sample(families, "clonemap_client_kvsets_sent_total", client="test",
                  shard="s0") >= 1
    assert sample(families, "clonemap_client_failed", client="test") == 0
    assert sample(families, "clonemap_client_refused_sends_total", client="test") == 0

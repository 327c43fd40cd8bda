"""A new user's second hour: each surprise a fresh user met after the quick start, as the
commands run (processes, their real output), with what they now say.

* ``chp --version``, ``supervisor --version``;
* ``supervisor init DIR``: the quick start's cluster, written where there is no checkout;
* ``chp watch --json``: a snapshot's items carry each key's own sequence (the one
  ``chp get -o json`` shows and ``--if-seq`` takes), not the shard's;
* a client without keys against a CURVE server fails at once, naming the port it was given;
* ``supervisor validate`` says whether CURVE is on;
* ``supervisor logs``: a server's run ends with a short summary line;
* a client that starts while a pair's primary is passive (the state after any failover)
  says nothing and calls no failover callback.

(``--detach``'s hint with the config's absolute path is checked where a user runs it from
an installed wheel: ``test_wheel.py``; the README's first read and write by
``test_doc_examples.py``.)
"""
from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
import yaml

import clonemap
from conftest import PYTHON, ROOT, free_port_base
from test_supervisor_cli import cli, start, wait_status, write_config

pytestmark = pytest.mark.timeout(120)

CHP = [PYTHON, "-m", "clonemap.client.cli"]
MAX_LOG_LINE = 300
"""The longest line ``supervisor logs`` may show of a server's run."""


def run(args: list, *, timeout_s: float = 30.0, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def test_both_commands_say_their_version():
    for args, name in ((CHP, "chp"), ([PYTHON, "-m", "clonemap.supervisor"], "supervisor")):
        out = run([*args, "--version"])
        assert (out.returncode, out.stdout) == (0, f"{name} (clonemap) {clonemap.__version__}\n")


def test_init_writes_the_quick_start_cluster_and_keeps_what_is_there(tmp_path):
    out = cli("init", str(tmp_path / "c"))
    assert out.returncode == 0, out.stderr
    written = yaml.safe_load((tmp_path / "c" / "clonemap.yaml").read_text())
    quick = yaml.safe_load((ROOT / "configs" / "4shard.yaml").read_text())
    for key in ("control", "heartbeat_s", "silence_timeout_s", "defaults", "shards"):
        assert written[key] == quick[key], key
    assert written["metrics"] == "127.0.0.1:9464"
    example = (tmp_path / "c" / "multi-host.example.yaml").read_text()
    assert example == (ROOT / "configs" / "3host.yaml").read_text()
    valid = cli("validate", str(tmp_path / "c" / "clonemap.yaml"), "--no-port-check")
    assert valid.returncode == 0 and "cluster local: 4 shards, 8 servers" in valid.stdout

    again = cli("init", str(tmp_path / "c"))
    assert again.returncode == 2
    assert again.stderr == (f"error: {tmp_path / 'c'}: clonemap.yaml, multi-host.example.yaml "
                            "already there; --force replaces\n")
    moved = cli("init", str(tmp_path / "c"), "--force", "--control-port", "7000",
                "--port-base", "7100", "--metrics-port", "7001")
    assert moved.returncode == 0
    written = yaml.safe_load((tmp_path / "c" / "clonemap.yaml").read_text())
    assert written["control"] == "tcp://127.0.0.1:7000"
    assert [s["primary"]["port"] for s in written["shards"]] == [7100, 7120, 7140, 7160]
    clash = cli("init", str(tmp_path / "d"), "--control-port", "7110", "--port-base", "7100")
    assert clash.returncode == 2 and "inside the servers' ports 7100-7179" in clash.stderr
    assert not (tmp_path / "d").exists()


def test_watch_json_gives_each_snapshot_item_its_own_sequence(procs, port_base):
    procs.python("-m", "clonemap.shards", "--port", str(port_base), ready="READY")
    servers = ["--servers", f"tcp://127.0.0.1:{port_base}"]
    for key, value in (("/w/a", "1"), ("/w/b", "2"), ("/w/a", "3")):
        assert run([*CHP, *servers, "set", key, value]).returncode == 0
    own = {key: json.loads(run([*CHP, *servers, "get", key, "-o", "json"]).stdout)["seq"]
           for key in ("/w/a", "/w/b")}
    assert own == {"/w/a": 3, "/w/b": 2}
    watch = procs.spawn([*CHP, *servers, "watch", "/w/", "--json", "--count", "1"])
    watch.wait_line('"kind": "synced"')
    assert run([*CHP, *servers, "set", "/w/c", "4"]).returncode == 0
    assert watch.wait(30) == 0
    docs = [json.loads(line) for line in watch.stdout]
    items = {d["key"]: d["seq"] for d in docs[:2]}
    assert [d["kind"] for d in docs] == ["put", "put", "synced", "put"]
    assert items == own
    assert (docs[3]["key"], docs[3]["seq"]) == ("/w/c", 4)


def test_a_client_without_keys_fails_at_once_naming_the_port_it_was_given(
        procs, port_base, cluster_keys):
    procs.python("-m", "clonemap.shards", "--port", str(port_base), "--keys-dir",
                 str(cluster_keys), ready="READY")
    # a deadline far past this call's own limit: the answer must not wait for it
    out = run([*CHP, "--servers", f"tcp://127.0.0.1:{port_base}", "--timeout-s", "600",
               "get", "/x"], timeout_s=60)
    assert out.returncode == 1
    assert out.stderr == (f"chp: error: tcp://127.0.0.1:{port_base}: the cluster requires "
                          "CURVE: pass --keys DIR or --config CONFIG\n")


def test_validate_says_whether_curve_is_on(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "secure").mkdir()
    plain, _ = write_config(tmp_path / "plain", "1shard.yaml")
    secure, _ = write_config(tmp_path / "secure", "1shard.yaml", security={"curve": True})
    assert cli("keygen", str(secure)).returncode == 0
    off = cli("validate", str(plain), "--no-port-check")
    on = cli("validate", str(secure), "--no-port-check")
    assert off.returncode == on.returncode == 0, (off.stderr, on.stderr)
    assert "security: off (plain TCP" in off.stdout
    assert f"security: CURVE on every socket; keys in {secure.parent / 'keys'}" in on.stdout


@pytest.fixture
def supervised(procs, tmp_path):
    """A one-shard pair under ``supervisor start``, its primary ACTIVE."""
    config, control = write_config(tmp_path, "1shard.yaml")
    start(procs, config, tmp_path, "--backoff-initial-s", "0.2")
    wait_status(control, lambda r: (r["s0/primary"]["bstar"], r["s0/backup"]["bstar"])
                == ("ACTIVE", "PASSIVE"))
    return config, control


def test_a_server_s_run_ends_with_a_short_line_in_its_log(supervised):
    config, control = supervised
    assert cli("restart", "s0/backup", "--control", control).returncode == 0
    wait_status(control, lambda r: r["s0/backup"]["restarts"] >= 1
                and r["s0/backup"]["bstar"] == "PASSIVE")
    logs = cli("logs", "s0/backup", "--control", control, "-n", "200")
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    assert [line for line in lines if "stopped: seq " in line]
    assert max(map(len, lines)) <= MAX_LOG_LINE, max(lines, key=len)


def test_a_client_starting_while_the_primary_is_passive_says_nothing(supervised, tmp_path):
    config, control = supervised
    assert cli("kill", "s0/primary", "--control", control).returncode == 0
    wait_status(control, lambda r: (r["s0/primary"]["bstar"], r["s0/backup"]["bstar"])
                == ("PASSIVE", "ACTIVE"), timeout_s=30)
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent(f"""
        import logging, sys
        from clonemap import Clone

        with Clone(control="{control}", on_failover=print) as clone:
            clone.set("/app/k", b"v", wait=True)
            print(clone.get("/app/k"), clone.stats()["shards"][0]["failovers"])
        if "--log" in sys.argv:  # the same again, the client's log kept
            records = []
            handler = logging.Handler()
            handler.emit = records.append
            logging.getLogger("clonemap").addHandler(handler)
            logging.getLogger("clonemap").setLevel(logging.INFO)
            with Clone(control="{control}") as clone:
                clone.get("/app/k")
            print(sorted({{(r.levelname, r.getMessage().split(": ", 1)[1].split(";")[0])
                          for r in records if "passive" in r.getMessage()}}))
            print(max(r.levelno for r in records) < logging.WARNING)
        """))
    out = run([PYTHON, script])
    assert (out.returncode, out.stdout, out.stderr) == (0, "b'v' 0\n", "")
    # it went the way a user's client goes: to the passive primary, then to the backup
    logged = run([PYTHON, script, "--log"])
    assert logged.stdout.splitlines()[1:] == [
        "[('INFO', 'server not serving (passive)')]", "True"], logged.stdout

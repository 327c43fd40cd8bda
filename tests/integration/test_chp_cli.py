"""``chp`` as a shell user runs it: a subprocess against real servers (``--servers``) and
against a real supervisor (``--control``, ``--config``).

Checked: values round-trip as text, as hex and as raw bytes (NUL, newline, invalid UTF-8,
from a file or stdin); dump (text and JSON), del, TTL; watch prints the items, "synced",
then live changes, and Ctrl-C ends it with 130; trace prints the shard publisher's
KVPUB and HUGZ decoded; exit codes 1 (not found), 2 (usage), 4 (no cluster) with one line
on stderr.
"""
from __future__ import annotations

import json
import time
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import PYTHON, ROOT, free_port_base
from test_client_failover import start_standalone
from test_supervisor_cli import start, write_config
from clonemap.shards.common.routing import ShardMap

pytestmark = pytest.mark.timeout(120)

BINARY = b"\x00\xff\n\x01binary\r\n\x80"


def chp(*args: str, stdin: bytes | None = None, timeout_s: float = 30.0
        ) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "clonemap.client.cli", *args], cwd=ROOT, input=stdin,
                          capture_output=True, timeout=timeout_s)


def ok(out: subprocess.CompletedProcess) -> bytes:
    assert out.returncode == 0, (out.returncode, out.stderr.decode())
    return out.stdout


def one_error_line(out: subprocess.CompletedProcess, code: int, text: str) -> None:
    err = out.stderr.decode()
    assert out.returncode == code, (out.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chp: error: ") and text in lines[0], err


@pytest.fixture
def two_shards(procs):
    ports = [free_port_base(4), free_port_base(4)]
    for port in ports:
        start_standalone(procs, port)
    return ["--servers", f"tcp://127.0.0.1:{ports[0]}", "--servers",
            f"tcp://127.0.0.1:{ports[1]}"], ports


def test_values_round_trip_as_text_hex_raw_and_files(two_shards, tmp_path):
    srv, ports = two_shards
    ok(chp(*srv, "set", "/users/42/name", "Zoë"))
    assert ok(chp(*srv, "get", "/users/42/name")) == "Zoë\n".encode()
    ok(chp(*srv, "set", "/bin/a", "--hex", BINARY.hex()))
    assert ok(chp(*srv, "get", "/bin/a", "--raw")) == BINARY
    assert ok(chp(*srv, "get", "/bin/a", "--hex")) == BINARY.hex().encode() + b"\n"
    blob = tmp_path / "blob"
    blob.write_bytes(BINARY * 100)
    ok(chp(*srv, "set", "/bin/file", "--file", str(blob)))
    assert ok(chp(*srv, "get", "/bin/file", "--raw")) == BINARY * 100
    ok(chp(*srv, "set", "/bin/stdin", "--file", "-", stdin=BINARY[::-1]))
    assert ok(chp(*srv, "get", "/bin/stdin", "--raw")) == BINARY[::-1]
    ok(chp(*srv, "set", "/cfg/fire", "and-forget", "--no-wait"))
    assert ok(chp(*srv, "get", "/cfg/fire")) == b"and-forget\n"
    # the keys went to their owners (2 hashed shards)
    shard_map = ShardMap(2)
    assert {shard_map.owner(k) for k in ("/users/", "/bin/", "/cfg/")} == {0, 1}
    # dump: text (binary as 0x...), JSON (binary as {"hex": ...}), a subtree
    text = ok(chp(*srv, "dump")).decode()
    assert text.splitlines() == [
        f"/bin/a\t0x{BINARY.hex()}", f"/bin/file\t0x{(BINARY * 100).hex()}",
        f"/bin/stdin\t0x{BINARY[::-1].hex()}", "/cfg/fire\tand-forget", "/users/42/name\tZoë"]
    doc = json.loads(ok(chp(*srv, "dump", "--json")))
    assert doc["/users/42/name"] == "Zoë" and doc["/bin/a"] == {"hex": BINARY.hex()}
    assert json.loads(ok(chp(*srv, "dump", "/users/", "--json"))) == {"/users/42/name": "Zoë"}
    assert ok(chp(*srv, "dump", "/nothing/")) == b""
    # del, then get and del again: exit 1, one line
    ok(chp(*srv, "del", "/bin/a"))
    one_error_line(chp(*srv, "get", "/bin/a"), 6, "key not found: /bin/a")
    one_error_line(chp(*srv, "del", "/bin/a"), 6, "key not found")


def test_conditional_writes_and_metadata_from_the_command_line(two_shards):
    """``set --create``/``--if-seq`` print the new sequence, a conflict is one line and
    exit 8 (never 4, a timeout), ``get -o json`` gives the sequence to pass next and the
    expiry; ``del --if-seq`` deletes only at that sequence."""
    srv, _ = two_shards
    first = int(ok(chp(*srv, "set", "/locks/job", "me", "--create", "--ttl", "60")))
    one_error_line(chp(*srv, "set", "/locks/job", "you", "--create"), 8,
                   f"conflict: '/locks/job' was last changed at sequence {first}")
    doc = json.loads(ok(chp(*srv, "get", "/locks/job", "-o", "json")))
    assert doc["value"] == "me" and doc["seq"] == first
    assert doc["expires"] is not None and doc["expires"] > time.time() + 50
    assert json.loads(ok(chp(*srv, "get", "/locks/job", "--json"))) == doc
    second = int(ok(chp(*srv, "set", "/locks/job", "me2", "--if-seq", str(first))))
    assert second > first
    one_error_line(chp(*srv, "set", "/locks/job", "late", "--if-seq", str(first)), 8,
                   f"last changed at sequence {second}")
    one_error_line(chp(*srv, "del", "/locks/job", "--if-seq", str(first)), 8, "conflict")
    one_error_line(chp(*srv, "set", "/locks/job", "x", "--create", "--if-seq", "3"), 2,
                   "--create is --if-seq 0")
    one_error_line(chp(*srv, "set", "/locks/job", "x", "--create", "--no-wait"), 2,
                   "drop --no-wait")
    ok(chp(*srv, "del", "/locks/job", "--if-seq", str(second)))
    one_error_line(chp(*srv, "get", "/locks/job"), 6, "key not found")


def test_usage_errors_exit_2_and_no_cluster_exits_4(two_shards, tmp_path):
    srv, _ = two_shards
    for args in (["set", "/a/b"], ["set", "/a/b", "--hex", "abc"], ["get"],
                 ["set", "/a/b", "x", "--file", str(tmp_path / "missing")],
                 ["--servers", "tcp://127.0.0.1:1", "--control", "tcp://127.0.0.1:2", "get",
                  "/a"], ["nosuchcommand"], ["set", "/a/b", "x", "--ttl", "-1"]):
        out = chp(*args)
        assert out.returncode == 2, (args, out.returncode, out.stderr.decode())
        assert out.stdout == b""
    one_error_line(chp(*srv, "set", "HUGZ", "x"), 2, "HUGZ")
    out = chp(*srv, "trace", "s7")
    assert out.returncode == 2 and b"no shard 's7'" in out.stderr
    free = free_port_base(4)
    out = chp("--servers", f"tcp://127.0.0.1:{free}", "--timeout-s", "0.5", "get", "/a/b")
    one_error_line(out, 4, "not ready within 0.5 s")
    out = chp("--control", f"tcp://127.0.0.1:{free}", "--timeout-s", "0.5", "get", "/a/b")
    one_error_line(out, 4, "no cluster map: is the supervisor up?")
    # malformed endpoints and what a server would drop: one line, exit 2, at once
    one_error_line(chp("--control", "foo", "get", "/a"), 2, "--control 'foo'")
    one_error_line(chp("--servers", "tcp://1.2.3:4", "get", "/a"), 2, "--servers")
    one_error_line(chp("--control", f"tcp://127.0.0.1:{free}", "set", "/a/b", "x", "--ttl",
                       "1e12"), 2, "ttl must be a number of seconds in 0..315360000")
    one_error_line(chp("--control", f"tcp://127.0.0.1:{free}", "set", "/a/" + "k" * 2000,
                       "x"), 2, "limit 1024")
    env = {**os.environ, "CLONEMAP_CONTROL": f"tcp://127.0.0.1:{free}"}
    out = subprocess.run([PYTHON, "-m", "clonemap.client.cli", "--timeout-s", "0.4", "dump"], cwd=ROOT,
                         capture_output=True, timeout=30, env=env)
    one_error_line(out, 4, f"control tcp://127.0.0.1:{free}")


def test_watch_is_live_and_ctrl_c_exits_130(two_shards, procs):
    srv, _ = two_shards
    ok(chp(*srv, "set", "/w/a", "one"))
    ok(chp(*srv, "set", "/other/x", "not watched"))
    watch = procs.python("-m", "clonemap.client.cli", *srv, "watch", "/w/", ready="synced /w/")
    ok(chp(*srv, "set", "/other/x", "still not"))
    ok(chp(*srv, "set", "/w/b", "--hex", "00ff"))
    ok(chp(*srv, "del", "/w/a"))
    watch.wait_line("put /w/b 0x00ff")
    watch.wait_line("delete /w/a")
    watch.signal(signal.SIGINT)
    assert watch.wait(10) == 130
    assert "put /w/a one" in watch.stdout and not any("/other/" in line
                                                      for line in watch.stdout)
    # --json and --count: machine-readable lines, ends by itself
    counted = procs.python("-m", "clonemap.client.cli", *srv, "watch", "/w/", "--json", "--count", "1",
                           ready='"synced"')
    ok(chp(*srv, "set", "/w/c", "--hex", "ff"))
    assert counted.wait(10) == 0
    docs = [json.loads(line) for line in counted.stdout]
    assert docs[0] == {"kind": "put", "key": "/w/b", "value": {"hex": "00ff"},
                       "seq": docs[0]["seq"], "shard": docs[0]["shard"]}
    assert docs[-1]["key"] == "/w/c" and docs[-1]["value"] == {"hex": "ff"}


def test_trace_prints_the_publishers_commands_decoded(two_shards, procs):
    srv, ports = two_shards
    owner = ShardMap(2).owner("/t/k")
    trace = procs.python("-m", "clonemap.client.cli", *srv, "trace", f"s{owner}", ready="HUGZ")
    ok(chp(*srv, "set", "/t/k", "traced", "--ttl", "30"))
    line = trace.wait_line("KVPUB")
    assert f"tcp://127.0.0.1:{ports[owner] + 1} KVPUB seq=" in line
    assert "key=/t/k" in line and "value=traced" in line and '"ttl": "30"' in line
    uuid = line.split("uuid=")[1].split()[0]
    assert len(uuid) == 32
    trace.signal(signal.SIGTERM)
    assert trace.wait(10) == 0


def test_control_and_config_against_a_real_supervisor(procs, tmp_path):
    config, control = write_config(tmp_path, "2shard.yaml", heartbeat_s=0.3)
    start(procs, config, tmp_path)
    via_control = ["--control", control]
    via_config = ["--config", str(config)]
    ok(chp(*via_control, "set", "/users/7", "--hex", BINARY.hex()))
    ok(chp(*via_control, "set", "/orders/1", "first", "--ttl", "60"))
    assert ok(chp(*via_config, "get", "/users/7", "--raw")) == BINARY
    assert ok(chp(*via_config, "get", "/orders/1")) == b"first\n"
    doc = json.loads(ok(chp(*via_control, "dump", "--json")))
    assert doc == {"/orders/1": "first", "/users/7": {"hex": BINARY.hex()}}
    out = chp(*via_control, "trace", "s1", "--count", "1")
    assert ok(out).count(b"\n") == 1 and (b"HUGZ" in out.stdout or b"KVPUB" in out.stdout)
    ok(chp(*via_config, "del", "/orders/1"))
    one_error_line(chp(*via_control, "get", "/orders/1"), 6, "not found")
    # keys only, and which shard owns a key (by the routing function) and who serves it
    ok(chp(*via_control, "set", "/users/8", "x"))
    assert ok(chp(*via_control, "keys", "/users/")) == b"/users/7\n/users/8\n"
    data = yaml.safe_load(config.read_text())
    owner = ShardMap(2).owner("/users/7")
    which = json.loads(ok(chp(*via_config, "which", "/users/7", "--json")))
    primary = data["shards"][owner]["primary"]["port"]
    assert which["shard"] == f"s{owner}" and which["index"] == owner
    assert which["servers"][0] == f"tcp://127.0.0.1:{primary}"
    assert which["active"] in which["servers"]
    # del --prefix: the count first, then every key under it, over both shards
    for i in range(6):
        ok(chp(*via_control, "set", f"/bulk{i}/k", "v"))
    one_error_line(chp(*via_control, "del", "--prefix", "/bulk"), 2,
                   "would delete 6 keys under '/bulk': add --yes")
    assert ok(chp(*via_config, "del", "--prefix", "/bulk", "--yes")) == \
        b"deleted 6 keys under /bulk\n"
    assert ok(chp(*via_control, "keys")) == b"/users/7\n/users/8\n"


def test_the_chp_entry_point_is_installed():
    script = Path(PYTHON).parent / "chp"
    assert script.exists(), "pip install -e . (make venv) installs the chp script"
    out = subprocess.run([str(script), "--help"], capture_output=True, timeout=30)
    assert out.returncode == 0 and b"get" in out.stdout and b"trace" in out.stdout


def test_watch_from_a_past_sequence_resumes_then_follows_live(procs, tmp_path):
    """``chp watch --from-seq S``: the changes after S from the server's history, then
    "synced", then live ones, none missed or doubled; a history that no longer holds S,
    and a subtree over two shards, are told in words."""
    port = free_port_base(4)
    start_standalone(procs, port)
    srv = ["--servers", f"tcp://127.0.0.1:{port}"]
    for i in range(1, 6):
        ok(chp(*srv, "set", f"/w/{i}", f"v{i}"))
    watch = procs.python("-m", "clonemap.client.cli", *srv, "watch", "/w/", "--from-seq", "2",
                         "--count", "1", ready="synced")
    ok(chp(*srv, "set", "/w/9", "live"))
    assert watch.wait(30) == 0
    assert watch.stdout == ["put /w/3 v3", "put /w/4 v4", "put /w/5 v5", "synced /w/",
                            "put /w/9 live"], watch.stdout
    short = free_port_base(4)
    procs.python("-m", "clonemap.shards", "--port", str(short), "--history-updates", "2",
                 ready="READY")
    for i in range(1, 6):
        ok(chp("--servers", f"tcp://127.0.0.1:{short}", "set", f"/h/{i}", "v"))
    one_error_line(chp("--servers", f"tcp://127.0.0.1:{short}", "watch", "/h/",
                       "--from-seq", "1"), 1, "history no longer holds sequence 1")
    two = ["--servers", f"tcp://127.0.0.1:{port}", "--servers", f"tcp://127.0.0.1:{short}"]
    one_error_line(chp(*two, "watch", "", "--from-seq", "1"), 2, "sequences are per shard")

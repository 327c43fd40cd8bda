"""The supervisor's command line, end to end: real ``supervisor start`` processes, real
shard servers, the control commands over MDP, pinning checked on every thread, and no
process left behind however the supervisor ends.

Each test writes a copy of a config from configs/ with its ports moved to free ones.
``start --no-table`` prints one ``EVENT <server> ...`` line per event (started, ready,
exit, restart), which is what the tests wait on.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml
import zmq

from conftest import PYTHON, ROOT, free_port_base
from clonemap.shards.common.proto import chp

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ helpers

def write_config(tmp_path: Path, source: str, **overrides) -> tuple[Path, str]:
    """A copy of configs/<source> with a free control port and free server ports."""
    data = yaml.safe_load((ROOT / "configs" / source).read_text())
    control = f"tcp://127.0.0.1:{free_port_base(1)}"
    data["control"] = control
    data["metrics"] = f"127.0.0.1:{free_port_base(1)}"
    shards = data["shards"]
    count = shards if isinstance(shards, int) else len(shards)
    base = free_port_base(20 * count)
    if isinstance(shards, int):
        data["port_base"] = base
    else:
        for i, shard in enumerate(shards):
            shard.setdefault("primary", {})["port"] = base + 20 * i
            shard.setdefault("backup", {})["port"] = base + 20 * i + 10
    data.update(overrides)
    path = tmp_path / f"cluster-{source}"
    path.write_text(yaml.safe_dump(data))
    return path, control


def cli(*args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "clonemap.supervisor", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def status(control: str) -> dict[str, dict]:
    """``cluster.status`` asked in-process (the ``status`` command is run where it is
    itself under test)."""
    from clonemap.supervisor.control import status_rows

    rows, _ = status_rows(control, timeout_s=5.0)
    return {row["name"]: row for row in rows}


def status_cli(control: str) -> dict[str, dict]:
    out = cli("status", "--json", "--control", control)
    assert out.returncode in (0, 1), out.stderr
    return {row["name"]: row for row in json.loads(out.stdout)["servers"]}


def start(procs, config: Path, tmp_path: Path, *extra: str, timeout_s: float = 60.0):
    return procs.python("-m", "clonemap.supervisor", "start", str(config), "--no-table",
                        "--run-dir", str(tmp_path / "run"), *extra,
                        ready="READY supervisor", timeout_s=timeout_s)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids, timeout_s: float = 15.0) -> list[int]:
    """Wait until every pid has exited (a zombie counts as exited); the ones left."""
    deadline = time.monotonic() + timeout_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        psutil.wait_procs([p for p in (_proc(pid) for pid in left) if p], timeout=0.2)
        left = [pid for pid in left if not gone(pid)]
    return left


def _proc(pid: int):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def children_of(pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def wait_status(control: str, predicate, timeout_s: float = 20.0) -> dict[str, dict]:
    """Poll ``supervisor status`` (the thing under test) until ``predicate(rows)``."""
    deadline = time.monotonic() + timeout_s
    rows = status(control)
    while not predicate(rows):
        assert time.monotonic() < deadline, brief(rows) + "\n" + json.dumps(rows)[:3000]
        time.sleep(0.3)
        rows = status(control)
    return rows


def brief(rows: dict[str, dict]) -> str:
    """A line per server of ``supervisor status`` rows: what a failed wait shows first
    (the whole rows, cut to fit a CI log, showed one server of four)."""
    def line(name: str, row: dict) -> str:
        stats = row.get("stats") or {}
        return (f"{name}: {row.get('state')} {row.get('bstar')} pid {row.get('pid')} "
                f"restarts {row.get('restarts')} ({row.get('reason')}, last exit "
                f"{row.get('last_exit')}) keys {row.get('keys')} seq {row.get('seq')} "
                f"epoch {(stats.get('routing') or {}).get('epoch')}")
    return "\n".join(line(n, r) for n, r in sorted(rows.items()))


def snapshot_answered(zctx, address: str, port: int, timeout_s: float = 5.0) -> int:
    """Ask a server for a snapshot (ICANHAZ) on a raw DEALER; the KTHXBAI's sequence."""
    import zmq

    sock = zctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://{address}:{port}")
    sock.send_multipart(chp.icanhaz(b""))
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0 and sock.poll(int(remaining * 1000)), "no snapshot"
        msg = chp.decode_snapshot(sock.recv_multipart())
        if isinstance(msg, chp.Kthxbai):
            sock.close(0)
            return msg.seq


# ------------------------------------------------------------------ pieces

def test_targets_log_tails_and_the_cluster_map_agree_with_routing(tmp_path):
    from clonemap.shards.common.routing import ShardMap
    from clonemap.shards.common.cluster import cluster_map
    from clonemap.supervisor.protocol import check_target
    from clonemap.supervisor.services import tail_lines
    from clonemap.shards.common.hostfacts import load_host_facts
    from clonemap.shards.common.placement import load_plan

    assert check_target(" s0/primary ") == "s0/primary"
    for bad in ("s0", "s0/leader", "/primary", "s 0/backup", "s0/backup/x"):
        with pytest.raises(ValueError, match="is not SHARD/ROLE"):
            check_target(bad)
    log = tmp_path / "x.log"
    log.write_bytes(b"".join(b"line %d\n" % i for i in range(100000)))
    assert tail_lines(log, 3) == b"line 99997\nline 99998\nline 99999\n"
    log.write_bytes(b"a\nb")
    assert tail_lines(log, 5) == b"a\nb\n" and tail_lines(log, 1) == b"b\n"
    log.write_bytes(b"")
    assert tail_lines(log, 5) == b""
    plan = load_plan(ROOT / "configs" / "16core-2nic.yaml",
                     load_host_facts(ROOT / "configs" / "hosts" / "16core-2nic.yaml"))
    cmap = json.loads(json.dumps(cluster_map(plan)))
    rebuilt = ShardMap.from_description(cmap["routing"])
    pins = {i: list(sh.prefixes) for i, sh in enumerate(plan.shards) if sh.prefixes}
    assert pins and rebuilt == ShardMap(len(plan.shards), pins)
    for shard, planned in zip(cmap["shards"], plan.shards):
        assert shard["primary"]["endpoints"]["updates"] == planned.primary.endpoint("updates")
        assert shard["backup"]["ports"]["peer"] == planned.backup.port + 3


# ------------------------------------------------------------------ tests

def test_control_commands_without_a_supervisor_exit_4(free_control, zctx):
    """Nothing listens: the answer is at once (a refused connection), not after the
    30 s deadline given (``cli`` itself gives up after 10 s); ``stop`` of a cluster that
    is not running is done already (exit 0). Something listens that is not a supervisor:
    the MDP deadline, then the same exit code."""
    out = cli("stop", "--control", free_control, "--timeout-s", "30", timeout_s=10)
    assert out.returncode == 0 and out.stdout.startswith("not running"), out
    for args in (["status"], ["kill", "s0/primary"], ["restart", "s0/backup"],
                 ["logs", "s0/primary"]):
        out = cli(*args, "--control", free_control, "--timeout-s", "30", timeout_s=10)
        assert out.returncode == 4, (args, out.stderr)
        assert "nothing listens on port" in out.stderr and "is the supervisor running" in \
            out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
    mute = zctx.socket(zmq.ROUTER)  # listens, never answers
    mute.bind(free_control)
    out = cli("status", "--control", free_control, "--timeout-s", "0.3")
    assert out.returncode == 4 and "no reply within 0.3 s" in out.stderr, out.stderr
    mute.close(0)
    out = cli("kill", "s0", "--control", free_control)
    assert out.returncode == 2 and "is not SHARD/ROLE" in out.stderr


@pytest.fixture
def free_control():
    return f"tcp://127.0.0.1:{free_port_base(1)}"


def test_start_refuses_a_taken_port_before_starting_anything(procs, tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml")
    import socket

    data = yaml.safe_load(config.read_text())
    holder = socket.socket()
    holder.bind(("127.0.0.1", data["port_base"] + 11))  # the backup's P+1
    try:
        out = cli("start", str(config), "--no-table", "--run-dir", str(tmp_path / "run"))
    finally:
        holder.close()
    assert out.returncode == 2
    assert "shards[0].backup.port" in out.stderr and "cannot be bound" in out.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_four_shards_pinned_mapped_killed_restarted_stopped(procs, tmp_path, zctx):
    import zmq

    from clonemap.shards.common.mdp.client import SyncMdpClient

    config, control = write_config(tmp_path, "4shard.yaml")
    sup = start(procs, config, tmp_path, "--demo-load", "--backoff-initial-s", "0.2")
    ready = [line for line in sup.stdout if line.startswith("READY supervisor")]
    assert ready and "servers=8 running=8" in ready[0]
    plan = json.loads(cli("validate", str(config), "--json", "--no-port-check").stdout)
    planned = {f"{sh['name']}/{role}": sh[role] for sh in plan["shards"]
               for role in ("primary", "backup")}
    rows = status_cli(control)
    assert sorted(rows) == sorted(planned) and len(rows) == 8
    assert {row["state"] for row in rows.values()} == {"RUNNING"}
    assert sorted(children_of(sup.pid)) == sorted(row["pid"] for row in rows.values())
    seen_pids = {row["pid"] for row in rows.values()}

    # pinned as planned: every thread of every server, ZeroMQ's I/O threads included
    for name, row in rows.items():
        proc = psutil.Process(row["pid"])
        threads = proc.threads()
        assert len(threads) >= 3, (name, threads)  # main + zmq I/O + reaper at least
        for thread in threads:
            assert os.sched_getaffinity(thread.id) == set(planned[name]["cores"]), (
                name, thread.id)
        assert row["address"] == planned[name]["address"]
        assert row["port"] == planned[name]["port"]

    # the cluster map over MDP, as a client would read it
    with SyncMdpClient(control, ctx=zctx, timeout_s=3) as client:
        status_code, body = client.request("cluster.map")
    assert status_code == b"200"
    cmap = json.loads(body)
    assert cmap["cluster"] == "four" and cmap["routing"]["shards"] == 4
    assert cmap["routing"]["version"] == 1
    for shard in cmap["shards"]:
        for role in ("primary", "backup"):
            server = planned[f"{shard['name']}/{role}"]
            assert shard[role]["port"] == server["port"]
            assert shard[role]["endpoints"]["snapshot"] == server["endpoints"]["snapshot"]

    # cluster.status at the frame level, on a raw DEALER: a PARTIAL per server, a FINAL
    dealer = zctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(control)
    dealer.send_multipart([b"MDPC02", b"\x01", b"cluster.status", b""])
    replies = []
    while not replies or replies[-1][1] != b"\x03":
        assert dealer.poll(5000), replies
        replies.append(dealer.recv_multipart())
    assert [r[:3] for r in replies[:-1]] == [[b"MDPC02", b"\x02", b"cluster.status"]] * 8
    assert {json.loads(r[3])["name"] for r in replies[:-1]} == set(planned)
    assert replies[-1][:4] == [b"MDPC02", b"\x03", b"cluster.status", b"200"]
    assert json.loads(replies[-1][4])["states"] == {"RUNNING": 8}

    # logs over MDP
    out = cli("logs", "s1/backup", "-n", "5", "--control", control)
    assert out.returncode == 0 and "READY shard" in cli(
        "logs", "s1/backup", "-n", "1000", "--control", control).stdout
    assert len(out.stdout.splitlines()) <= 5
    out = cli("logs", "s9/backup", "--control", control)
    assert out.returncode == 6 and "no server 's9/backup'" in out.stderr

    # each pair settles: one ACTIVE, one PASSIVE; figures from the servers' own services
    rows = wait_status(control, lambda r: all(
        {r[f"s{i}/primary"]["bstar"], r[f"s{i}/backup"]["bstar"]} == {"ACTIVE", "PASSIVE"}
        for i in range(4)) and all(row["seq"] is not None for row in r.values()))

    # kill a primary: it is restarted (a new pid) and the cluster keeps serving
    victim = rows["s0/primary"]
    out = cli("kill", "s0/primary", "--control", control)
    assert out.returncode == 0 and f"pid {victim['pid']}" in out.stdout
    sup.wait_line(f"EVENT s0/primary pid {victim['pid']} killed by SIGKILL")
    sup.wait_line("EVENT s0/primary ready")
    rows = wait_status(control, lambda r: r["s0/primary"]["state"] == "RUNNING")
    assert rows["s0/primary"]["pid"] != victim["pid"] and rows["s0/primary"]["restarts"] == 1
    assert rows["s0/primary"]["last_exit"] == "killed by SIGKILL"
    assert gone(victim["pid"])
    seen_pids |= {row["pid"] for row in rows.values()}
    # the backup took over; the restarted primary rejoined as passive
    rows = wait_status(control, lambda r: r["s0/backup"]["bstar"] == "ACTIVE"
                       and r["s0/primary"]["bstar"] == "PASSIVE")
    backup = rows["s0/backup"]
    assert snapshot_answered(zctx, backup["address"], backup["port"]) >= backup["seq"]
    wait_status(control, lambda r: r["s0/backup"]["seq"] > backup["seq"])  # the load goes on

    # an operator restart: SIGTERM, a new pid, a clean exit recorded
    old = rows["s2/backup"]["pid"]
    out = cli("restart", "s2/backup", "--control", control)
    assert out.returncode == 0, out.stderr
    rows = wait_status(control, lambda r: r["s2/backup"]["state"] == "RUNNING")
    assert rows["s2/backup"]["pid"] not in (None, old)
    assert rows["s2/backup"]["last_exit"] == "exited with code 0"
    seen_pids |= {row["pid"] for row in rows.values()}

    # stop: every server and the supervisor end, nothing left
    out = cli("stop", "--control", control)
    assert out.returncode == 0, out.stderr
    assert sup.wait(20) == 0
    assert any(line.startswith("STOPPED supervisor") for line in sup.stdout)
    assert wait_gone(seen_pids) == []
    assert cli("status", "--control", control, "--timeout-s", "0.3").returncode == 4


def test_sigkilled_supervisor_leaves_no_child_and_sigterm_stops_cleanly(procs, tmp_path):
    config, control = write_config(tmp_path, "2shard.yaml")
    sup = start(procs, config, tmp_path)
    children = children_of(sup.pid)
    assert len(children) == 4
    sup.signal(signal.SIGKILL)
    sup.wait(5)
    assert wait_gone(children) == [], "children outlived a SIGKILLed supervisor"

    sup = start(procs, config, tmp_path)  # the ports are free again
    children = children_of(sup.pid)
    assert len(children) == 4
    sup.signal(signal.SIGTERM)
    assert sup.wait(20) == 0
    assert wait_gone(children) == []
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    assert logs == ["s0-backup.log", "s0-primary.log", "s1-backup.log", "s1-primary.log"]
    assert "stopped with the supervisor" in (tmp_path / "run" / "logs" /
                                             "s0-primary.log").read_text()
    assert not (tmp_path / "run" / "supervisor.pid").exists()


def test_a_server_that_keeps_crashing_is_failed_not_restarted(procs, tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml")
    sup = start(procs, config, tmp_path, "--backoff-initial-s", "0.05", "--crash-limit", "3")
    for attempt in range(3):
        row = status(control)["s0/backup"]
        assert row["state"] == "RUNNING"
        assert cli("kill", "s0/backup", "--control", control).returncode == 0
        sup.wait_line(f"EVENT s0/backup pid {row['pid']} killed by SIGKILL")
        if attempt < 2:
            sup.wait_line("EVENT s0/backup ready")
    sup.wait_line("EVENT s0/backup FAILED: crashed 3 times")
    rows = status(control)
    assert rows["s0/backup"]["state"] == "FAILED" and rows["s0/backup"]["pid"] is None
    assert rows["s0/primary"]["state"] == "RUNNING"
    out = cli("status", "--control", control)
    assert out.returncode == 1 and "FAILED" in out.stdout
    out = cli("kill", "s0/backup", "--control", control)
    assert out.returncode == 1 and "has no process now (FAILED)" in out.stderr
    assert cli("restart", "s0/backup", "--control", control).returncode == 0  # a new chance
    rows = wait_status(control, lambda r: r["s0/backup"]["state"] == "RUNNING")
    assert rows["s0/backup"]["restarts"] == 3


def test_a_server_log_over_the_limit_is_rotated_and_the_server_keeps_writing(procs, tmp_path):
    """Copy-truncate at each start: the restarted server's log begins afresh, the old lines
    are in <log>.1, and the running server's later lines land in the truncated file."""
    config, control = write_config(tmp_path, "1shard.yaml")
    sup = start(procs, config, tmp_path, "--backoff-initial-s", "0.05", "--log-max-mb", "0.0001")
    log = tmp_path / "run" / "logs" / "s0-backup.log"
    first_pid = status(control)["s0/backup"]["pid"]
    assert log.stat().st_size >= 105, log.read_text()  # start-up lines: over the limit
    assert cli("kill", "s0/backup", "--control", control).returncode == 0
    sup.wait_line(f"EVENT s0/backup pid {first_pid} killed by SIGKILL")
    sup.wait_line("EVENT s0/backup ready")
    rotated = log.with_name("s0-backup.log.1")
    old = rotated.read_text()
    assert f"started pid {first_pid}" in old and "killed by SIGKILL" in old
    new = log.read_text()
    assert "log rotated; the previous lines are in s0-backup.log.1" in new
    assert f"started pid {first_pid} " not in new
    assert "started pid" in new  # the new run's own lines go to the fresh file
    assert cli("stop", "--control", control).returncode == 0
    assert sup.wait(20) == 0


def test_detach_runs_in_the_background_and_stop_ends_it(tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml")
    run_dir = tmp_path / "run"
    out = cli("start", str(config), "--detach", "--run-dir", str(run_dir), timeout_s=60)
    pid_file = run_dir / "supervisor.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    children: list[int] = []
    try:
        assert out.returncode == 0, out.stderr
        assert "READY supervisor" in out.stdout and pid is not None
        children = children_of(pid)
        assert len(children) == 2
        rows = status_cli(control)
        assert {r["state"] for r in rows.values()} == {"RUNNING"}
        assert cli("stop", "--control", control).returncode == 0
        assert wait_gone([pid, *children]) == []
        assert "STOPPED supervisor" in (run_dir / "supervisor.log").read_text()
    finally:
        for leftover in ([pid] if pid else []) + children:
            if not gone(leftover):
                os.kill(leftover, signal.SIGKILL)


def test_sigterm_while_the_servers_start_stops_them_all(procs, tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml")
    sup = procs.python("-m", "clonemap.supervisor", "start", str(config), "--no-table", "--run-dir",
                       str(tmp_path / "run"))
    pids = [int(sup.wait_line(f"EVENT s0/{role} started pid", 30).split()[4])
            for role in ("primary", "backup")]
    sup.signal(signal.SIGTERM)
    assert sup.wait(20) == 0
    assert wait_gone(pids) == []
    assert any(line.startswith("STOPPED supervisor") for line in sup.stdout)


def test_server_command_line_follows_the_plan():
    from clonemap.shards.common.hostfacts import load_host_facts
    from clonemap.shards.common.placement import load_plan
    from clonemap.supervisor.runner import ServerArgs, server_argv

    plan = load_plan(ROOT / "configs" / "16core-2nic.yaml",
                     load_host_facts(ROOT / "configs" / "hosts" / "16core-2nic.yaml"))
    shard = plan.shards[1]
    args = ServerArgs(control="tcp://127.0.0.1:5555", heartbeat_s=0.5, parent_pid=42,
                      python="py")
    argv = server_argv(shard.backup, shard.primary, args)
    assert argv[:3] == ["py", "-m", "clonemap.shards"] and "--backup" in argv
    rest = [a for a in argv[3:] if a != "--backup"]
    assert dict(zip(rest[::2], rest[1::2])) == {
        "--port": str(shard.backup.port), "--host": shard.backup.address,
        "--cpus": ",".join(map(str, shard.backup.cores)), "--heartbeat-s": "0.5",
        "--shard": shard.name, "--peer": f"{shard.primary.address}:{shard.primary.port}",
        "--control": "tcp://127.0.0.1:5555", "--parent-pid": "42"}

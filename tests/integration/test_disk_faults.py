"""Disk faults under ``supervisor start``, with real small filesystems and a ledger.

Each server's data directory (``<run>/data/s0-<role>``) is a tmpfs the test mounts
(CI runs as root), so ENOSPC is a real full disk and EROFS a real read-only remount. EIO
on a write and a failed fsync cannot be made on a real filesystem here (no
device-mapper in this kernel), so they are injected at the OS-call boundary: with
``$CLONEMAP_INJECT_DISK_FAULT`` set, SIGUSR2 makes the server's next log write or fsync
fail (``DataDir.inject_fault``).

A writer thread sets ``/ledger/<n>`` (8 KB values) with ``wait=True`` and the client's
default timeouts, and keeps the ledger of what was acknowledged. After every fault has
healed, a fresh client reads every acknowledged key back, and again after a stop and a
start of the whole cluster. Checked each time: zero acknowledged writes lost, the disk
error in ``supervisor status`` and the metrics within a second of the server stopping,
the healthy peer serving, the failed server back without an operator.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
import zmq

from clonemap.shards.common.proto import chp
from helpers import fill_disk
from test_supervisor_cli import cli, status, wait_status, write_config

pytestmark = pytest.mark.timeout(240)

VALUE_BYTES = 8000
DISK_BYTES = 32 << 20


def value_of(n: int, size: int = VALUE_BYTES) -> bytes:
    return (f"{n:08d}".encode() * (size // 8 + 1))[:size]


class Ledger:
    """A writer thread and the writes it saw acknowledged."""

    def __init__(self, config: Path, value_bytes: int = VALUE_BYTES, per_s: float = 0):
        self.config = config
        self.value_bytes = value_bytes
        self.pace_s = 1.0 / per_s if per_s else 0.0
        """At most ``per_s`` writes a second (0: one after the other): the map must fit
        a server's small disk when it copies it back."""
        self.acked: list[int] = []
        self.failed = 0
        self.mark = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from clonemap.client.api import Clone
        from clonemap.shards.common.errors import ClonemapError

        with Clone(config=str(self.config)) as clone:
            n = 0
            while not self.stop.wait(self.pace_s):
                n += 1
                try:
                    clone.set(f"/ledger/{n}", value_of(n, self.value_bytes), wait=True)
                except (ClonemapError, TimeoutError):
                    self.failed += 1  # not acknowledged: may or may not be applied
                    continue
                self.acked.append(n)

    def __enter__(self) -> "Ledger":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)

    def wait_acked(self, count: int, timeout_s: float = 60.0) -> None:
        """Until ``count`` writes were acknowledged since the last call (the writer
        goes on until ``max_writes``, so size that for every wait)."""
        deadline = time.monotonic() + timeout_s
        while len(self.acked) < self.mark + count:
            assert time.monotonic() < deadline, (len(self.acked), self.mark, self.failed)
            assert self.thread.is_alive(), ("the writer stopped", len(self.acked))
            time.sleep(0.05)
        self.mark = len(self.acked)

    def check(self, config: Path) -> None:
        """A fresh client holds every acknowledged write, with its value."""
        from clonemap.client.api import Clone

        assert self.acked, "nothing was acknowledged"
        with Clone(config=str(config)) as clone:
            lost = [n for n in self.acked
                    if clone.get(f"/ledger/{n}") != value_of(n, self.value_bytes)]
        assert not lost, f"{len(lost)} of {len(self.acked)} acknowledged writes lost: {lost[:10]}"


def mount(path: Path, size: int = DISK_BYTES) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "clonemap-test", str(path)],
                   check=True)


def ext4(path: Path, image: Path, size: int = DISK_BYTES) -> None:
    """An ext4 filesystem on a loop device at ``path`` (replacing what is mounted
    there), mounted ``errors=remount-ro``: ext4's ``trigger_fs_error`` then makes it
    read-only under its open files, as a real media error would (EROFS)."""
    subprocess.run(["umount", "-l", str(path)], check=False)
    subprocess.run(["truncate", "-s", str(size), str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(path)],
                   check=True)


def ext4_error(path: Path) -> None:
    """ext4's own error path (``/sys/fs/ext4/<dev>/trigger_fs_error``): the filesystem
    at ``path`` goes read-only at once."""
    source = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(path)], check=True,
                            capture_output=True, text=True).stdout.strip()
    Path(f"/sys/fs/ext4/{Path(source).name}/trigger_fs_error").write_text("clonemap test")


def ext4_repair(path: Path, image: Path, control: str, name: str) -> None:
    """Unmount (once the server, stopped on its error, has no run holding a file open),
    detach the loop device, check and mount again, writable. The loop device is detached
    and gone before ``e2fsck`` reads the image (a device still attached could write its
    cached blocks over the repair: the filesystem then came back read-only and the
    server failed on EROFS for a minute, once in a full run); a check that cannot repair
    it, or a mount that comes back read-only, fails here, saying so."""
    device = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(path)], check=True,
                            capture_output=True, text=True).stdout.strip()
    for _ in range(20):
        wait_status(control, lambda r: r[name]["pid"] is None)  # between two runs
        if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
            break
    else:
        raise AssertionError(f"{path} stayed busy")
    subprocess.run(["losetup", "-d", device], capture_output=True)  # (autoclear may have)
    # a device someone still has open (udev probing it after the unmount) detaches at
    # its last close: asked again each look, for as long as a loaded host takes (it
    # took over 10 s once, with three test workers on 2 cores)
    deadline = time.monotonic() + 30
    while attached := subprocess.run(["losetup", "-j", str(image)], capture_output=True,
                                     text=True).stdout.strip():
        assert time.monotonic() < deadline, f"{image} still attached: {attached}"
        for line in attached.splitlines():
            subprocess.run(["losetup", "-d", line.partition(":")[0]], capture_output=True)
        time.sleep(0.05)
    check = subprocess.run(["e2fsck", "-f", "-y", str(image)], capture_output=True, text=True)
    assert check.returncode < 4, f"e2fsck could not repair {image}: {check.stdout[-2000:]}"
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(path)],
                   check=True)
    options = subprocess.run(["findmnt", "-n", "-o", "OPTIONS", str(path)], check=True,
                             capture_output=True, text=True).stdout
    assert options.startswith("rw"), f"{path} mounted read-only after the repair: {options}"


@pytest.fixture
def cluster(procs, tmp_path):
    """A one-shard cluster (``fsync: everysec``) whose servers' data directories are
    tmpfs mounts; ``start()`` starts (or starts again) its supervisor."""
    config, control = write_config(tmp_path, "1shard.yaml")
    data = yaml.safe_load(config.read_text())
    run = tmp_path / "run"
    disks = {role: run / "data" / f"s0-{role}" for role in ("primary", "backup")}
    for disk in disks.values():
        mount(disk)

    class Cluster:
        def __init__(self):
            self.config, self.control, self.disks = config, control, disks
            self.metrics = f"http://{data['metrics']}/metrics"
            self.sup = None
            self.ledger: Ledger | None = None

        def start(self):
            self.sup = procs.python(
                "-m", "clonemap.supervisor", "start", str(config), "--no-table", "--run-dir",
                str(run), ready="READY supervisor", timeout_s=60,
                env={"CLONEMAP_INJECT_DISK_FAULT": os.environ.get("FAULT", "write:EIO")})
            return self.sup

        def stop(self):
            assert cli("stop", str(config)).returncode == 0
            self.sup.wait(30)

        def row(self, role: str) -> dict:
            return status(control)[f"s0/{role}"]

        def metric(self, name: str, role: str) -> float | None:
            body = urllib.request.urlopen(self.metrics, timeout=5).read().decode()
            for line in body.splitlines():
                if line.startswith(name + "{") and f'role="{role}"' in line:
                    return float(line.rsplit(" ", 1)[1])
            return None

        def active(self) -> str:
            rows = wait_status(control, lambda r: any(x["bstar"] == "ACTIVE"
                                                      for x in r.values()), timeout_s=30)
            return next(r["role"] for r in rows.values() if r["bstar"] == "ACTIVE")

        def wait_disk_error(self, role: str) -> None:
            """The server stops on its disk error; within a second of the supervisor
            seeing it, status and metrics say so."""
            self.sup.wait_line(f"EVENT s0/{role} DISK ERROR", timeout_s=60)
            seen = time.monotonic()  # its first restart is 0.5 s away
            row = status(control)[f"s0/{role}"]
            metric = self.metric("clonemap_server_disk_ok", role)
            errors = self.metric("clonemap_server_disk_errors_total", role)
            took = time.monotonic() - seen
            assert row["disk_errors"] >= 1 and errors >= 1, (row, errors)
            if row["state"] != "RUNNING":  # not back yet (it may be, on a disk that works)
                assert row["disk_error"], row
            if metric != 0:  # scraped after a restart that came back ready
                assert self.row(role)["state"] == "RUNNING", metric
            assert took < 1.0, took
            if self.ledger is not None:  # acknowledgements count from here
                self.ledger.mark = len(self.ledger.acked)

        def wait_back(self, role: str, timeout_s: float = 60.0) -> None:
            """The server rejoined by itself: RUNNING, and ACTIVE or a PASSIVE that holds
            the map (its replica live, not waiting to copy its peer's). A PASSIVE still
            copying must not take over, so a fault on its peer before then leaves the
            peer to come back ACTIVE, which a test injecting the next fault must not
            mistake for a failed failover."""
            def back(rows: dict) -> bool:
                row = rows[f"s0/{role}"]
                stats = row.get("stats") or {}
                holds_map = row["bstar"] == "ACTIVE" or (
                    row["bstar"] == "PASSIVE" and not stats.get("needs_peer")
                    and (stats.get("replica") or {}).get("phase") == "live")
                return row["state"] == "RUNNING" and holds_map and not row["disk_error"]

            wait_status(control, back, timeout_s=timeout_s)

        def start_whole(self) -> None:
            """``start``, then wait until the backup follows the primary with the whole
            map (``wait_back``). Until then the active acknowledges alone (one host:
            Binary Star replicates after the acknowledgement), and a fault of its disk
            in that window leaves the backup to serve its own copy, the active's writes
            kept only in its ``dropped-*`` file (``bstar`` rule 9, the README's
            limits): the failover these tests check is that of a pair that is whole.
            (In one run of the suite the primary took 65 writes in the 90 ms before the
            backup heard it was active, then filled its disk: 65 of 295 lost.)"""
            self.start()
            assert self.active() == "primary"
            self.wait_back("backup")

    c = Cluster()
    try:
        yield c
    finally:
        if c.sup is not None and c.sup.alive():
            cli("stop", str(config))
            c.sup.wait(30)
        for disk in disks.values():
            subprocess.run(["umount", "-l", str(disk)], check=False)


def restart_all_and_check(cluster, ledger: Ledger) -> None:
    cluster.stop()
    cluster.start()
    ledger.check(cluster.config)


def test_a_full_disk_on_the_active_fails_over_and_it_rejoins_when_space_returns(cluster):
    cluster.start_whole()
    filler = fill_disk(cluster.disks["primary"], leave=512 << 10)
    with Ledger(cluster.config) as ledger:
        cluster.ledger = ledger
        cluster.wait_disk_error("primary")
        out = cli("status", str(cluster.config))  # still full: it cannot come back yet
        assert out.returncode == 1 and "s0/primary: disk error" in out.stdout, out.stdout
        assert cluster.active() == "backup"
        ledger.wait_acked(50)  # the backup acknowledges writes again
        ledger.stop.set()  # the map must fit the primary's disk when it copies it
        ledger.thread.join(30)
        filler.unlink()  # space returns: no operator action beyond that
        cluster.wait_back("primary")
    assert cluster.row("primary")["restarts"] >= 1
    ledger.check(cluster.config)
    restart_all_and_check(cluster, ledger)


def test_a_full_disk_on_the_passive_then_on_both(cluster):
    cluster.start()
    fill_disk(cluster.disks["backup"], leave=1 << 20)
    with Ledger(cluster.config, per_s=200) as ledger:
        cluster.ledger = ledger
        cluster.wait_disk_error("backup")
        ledger.wait_acked(50)  # the active goes on alone
        assert cluster.active() == "primary"
        primary_filler = fill_disk(cluster.disks["primary"], leave=256 << 10)
        cluster.wait_disk_error("primary")  # both full: the shard stops acknowledging
        out = cli("status", str(cluster.config))
        assert out.returncode == 1 and "disk error" in out.stdout, out.stdout
        primary_filler.unlink()
        (cluster.disks["backup"] / "filler").unlink()
        cluster.wait_back("primary")
        cluster.wait_back("backup")
        ledger.wait_acked(20)
    ledger.check(cluster.config)
    restart_all_and_check(cluster, ledger)


def test_read_only_disk_eio_and_a_failed_fsync_each_fail_over(cluster, monkeypatch):
    monkeypatch.setenv("FAULT", "write:EIO")
    image = cluster.config.parent / "primary.ext4"
    ext4(cluster.disks["primary"], image)
    cluster.start_whole()
    with Ledger(cluster.config, value_bytes=1000, per_s=200) as ledger:
        cluster.ledger = ledger
        ledger.wait_acked(20)
        # EROFS: the active's ext4 goes read-only under its open log (a media error)
        ext4_error(cluster.disks["primary"])
        cluster.wait_disk_error("primary")
        assert "EROFS" in cluster.row("primary")["disk_error"]
        assert cluster.active() == "backup"
        ledger.wait_acked(20)
        ext4_repair(cluster.disks["primary"], image, cluster.control, "s0/primary")
        cluster.wait_back("primary")
        # EIO on the next log write of the (new) active, injected
        os.kill(cluster.row("backup")["pid"], signal.SIGUSR2)
        cluster.wait_disk_error("backup")
        assert cluster.active() == "primary"
        ledger.wait_acked(20)
        cluster.wait_back("backup")
    ledger.check(cluster.config)
    restart_all_and_check(cluster, ledger)


def test_a_failed_fsync_is_never_retried_the_server_stops(cluster, monkeypatch):
    monkeypatch.setenv("FAULT", "fsync:EIO")
    cluster.start_whole()
    with Ledger(cluster.config, value_bytes=1000, per_s=200) as ledger:
        cluster.ledger = ledger
        ledger.wait_acked(20)
        pid = cluster.row("primary")["pid"]
        os.kill(pid, signal.SIGUSR2)  # the next everysec fsync fails
        cluster.wait_disk_error("primary")
        log = (cluster.config.parent / "run" / "logs" / "s0-primary.log").read_text()
        assert "fsync of the log" in log and "never fsynced again" in log
        assert cluster.active() == "backup"
        ledger.wait_acked(20)
        cluster.wait_back("primary")
    ledger.check(cluster.config)
    restart_all_and_check(cluster, ledger)


# ------------------------------------------------------------------ recovery

def _write_ledger(config: Path, count: int) -> Ledger:
    ledger = Ledger(config, value_bytes=100)
    ledger.stop.set()  # no thread: write ``count`` here, each acknowledged
    from clonemap.client.api import Clone

    with Clone(config=str(config)) as clone:
        for n in range(1, count + 1):
            clone.set(f"/ledger/{n}", value_of(n, 100), wait=True)
            ledger.acked.append(n)
    return ledger


def _supervise(procs, config: Path, run: Path, *extra: str):
    return procs.python("-m", "clonemap.supervisor", "start", str(config), "--no-table", "--run-dir",
                        str(run), *extra, ready="READY supervisor", timeout_s=60)


def _written_then_stopped(procs, config: Path, control: str, run: Path,
                          count: int) -> Ledger:
    """A cluster started, ``count`` acknowledged writes that both servers hold, the
    cluster stopped cleanly. (A pair on one host acknowledges on the active alone: a
    backup still starting or copying on a loaded host would otherwise be stopped with
    less than the ledger, and the faults below take the primary's copy away.)"""
    sup = _supervise(procs, config, run)
    ledger = _write_ledger(config, count)
    wait_status(control, lambda r: r["s0/backup"]["bstar"] == "PASSIVE"
                and (r["s0/backup"]["stats"].get("replica") or {}).get("phase") == "live"
                and r["s0/backup"]["seq"] == r["s0/primary"]["seq"] == count)
    assert cli("stop", str(config)).returncode == 0
    sup.wait(30)
    return ledger


def test_one_unreadable_log_the_healthy_peer_serves_and_it_copies_back(procs, tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml")
    run = tmp_path / "run"
    ledger = _written_then_stopped(procs, config, control, run, 400)
    # a byte flipped in the middle of the primary's log: not a torn tail, a bad disk
    primary_dir = run / "data" / "s0-primary"
    segment = max(primary_dir.glob("log-*.cml"), key=lambda p: p.stat().st_size)
    raw = bytearray(segment.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    segment.write_bytes(bytes(raw))
    sup = _supervise(procs, config, run)
    ready = next(line for line in sup.stdout if line.startswith("READY supervisor"))
    assert "active_shards=1/1" in ready
    assert any("EVENT s0/primary could not read its data directory" in line
               for line in sup.stdout), sup.stdout  # said before READY
    rows = wait_status(control, lambda r: r["s0/backup"]["bstar"] == "ACTIVE"
                       and r["s0/primary"]["bstar"] == "PASSIVE"
                       and not r["s0/primary"]["stats"].get("needs_peer"))
    assert rows["s0/backup"]["keys"] == 400
    moved = list(primary_dir.glob("unreadable-*"))
    assert len(moved) == 1 and (moved[0] / segment.name).exists(), "kept, never deleted"
    assert not (primary_dir / "needs-peer").exists()
    log = (run / "logs" / "s0-primary.log").read_text()
    assert "checksum mismatch" in log and "holds a valid copy again" in log
    ledger.check(config)
    # the copy is whole: with the backup gone, the primary serves every write
    assert cli("kill", "s0/backup", str(config)).returncode == 0
    ledger.check(config)


def _leave_an_incomplete_replica(data_dir: Path) -> None:
    """``data_dir`` as a passive killed in the middle of rewriting it from its active
    leaves it (``DataDir.replace`` done, the new map's first snapshot not yet renamed):
    the real writer, stopped where a SIGKILL would stop it."""
    from clonemap.shards.persist import DataDir
    from clonemap.shards.store import Store

    for path in data_dir.iterdir():
        if path.is_file():
            path.unlink()
    peer = Store()
    for n in range(1, 11):
        peer.apply(f"/ledger/{n}".encode(), b"v")
    writer = DataDir(data_dir, "no")
    writer.open("g-peer", 0)
    writer.replace(peer, "g-peer", None)
    writer.append(11, b"/ledger/11", b"v", None)
    writer.flush()
    writer.abandon()  # no clean close: that would finish the snapshot


def test_an_incomplete_replica_never_serves_an_empty_map_while_its_peer_is_down(
        procs, tmp_path, zctx):
    """A backup whose directory is an incomplete replica starts empty: it has no copy of
    the shard. With its primary's disk failing at start, the supervisor reports the
    primary down, and a client's vote would make a backup serve its own copy (rule 9),
    here an empty map, every acknowledged write gone. It refuses instead (rule 8: it
    needs its peer's copy), and once the primary's disk is back the primary serves and
    the backup copies its map."""
    config, control = write_config(tmp_path, "1shard.yaml")
    run = tmp_path / "run"
    ledger = _written_then_stopped(procs, config, control, run, 50)
    backup_dir = run / "data" / "s0-backup"
    _leave_an_incomplete_replica(backup_dir)
    primary_disk = run / "data" / "s0-primary"
    mount(primary_disk, size=1 << 20)  # the primary cannot start
    try:
        sup = _supervise(procs, config, run, "--ready-timeout-s", "3")
        assert any(line.startswith("NOT_READY supervisor") for line in sup.stdout)
        rows = wait_status(control, lambda r: r["s0/backup"]["state"] == "RUNNING"
                           and r["s0/backup"]["stats"].get("peer_reported_down"))
        assert rows["s0/backup"]["stats"]["needs_peer"] is True
        assert rows["s0/backup"]["keys"] == 0
        assert list(backup_dir.glob("incomplete-*")), "its files are kept aside"
        port = yaml.safe_load(config.read_text())["port_base"] + 10
        vote = zctx.socket(zmq.DEALER)
        vote.linger = 0
        vote.connect(f"tcp://127.0.0.1:{port}")
        vote.send_multipart(chp.icanhaz(b""))  # a client's vote
        rows = wait_status(control, lambda r: r["s0/backup"]["stats"]["refused_votes"] >= 1)
        assert rows["s0/backup"]["bstar"] == "BACKUP"
        assert not vote.poll(0), "an empty map was served as the shard's"
        vote.close()
    finally:
        subprocess.run(["umount", "-l", str(primary_disk)], check=False)
    rows = wait_status(control, lambda r: r["s0/primary"]["bstar"] == "ACTIVE"
                       and r["s0/backup"]["bstar"] == "PASSIVE"
                       and not r["s0/backup"]["stats"].get("needs_peer"), timeout_s=60)
    assert rows["s0/backup"]["keys"] == rows["s0/primary"]["keys"] == 50
    assert not (backup_dir / "needs-peer").exists()
    ledger.check(config)


def test_the_operator_serves_a_needs_peer_server_once_its_peer_s_copy_is_given_up(
        procs, tmp_path):
    """shards/README.md, as an operator follows it: the primary's copy is lost for good,
    so the needs-peer marker goes from the backup's directory and the backup is
    restarted; it then serves what it holds (here nothing), on a client's vote."""
    config, control = write_config(tmp_path, "1shard.yaml")
    run = tmp_path / "run"
    _written_then_stopped(procs, config, control, run, 10)
    backup_dir = run / "data" / "s0-backup"
    _leave_an_incomplete_replica(backup_dir)
    primary_disk = run / "data" / "s0-primary"
    mount(primary_disk, size=1 << 20)
    try:
        _supervise(procs, config, run, "--ready-timeout-s", "3")
        wait_status(control, lambda r: r["s0/backup"]["state"] == "RUNNING"
                    and r["s0/backup"]["stats"].get("needs_peer")
                    and r["s0/backup"]["stats"].get("peer_reported_down"))
        (backup_dir / "needs-peer").unlink()
        assert cli("restart", "s0/backup", str(config)).returncode == 0
        from clonemap.client.api import Clone

        with Clone(config=str(config)) as clone:  # its vote
            assert clone.items() == []
            clone.set("/after", b"given up", wait=True)
        rows = status(control)
        assert rows["s0/backup"]["bstar"] == "ACTIVE"
        assert rows["s0/backup"]["stats"]["needs_peer"] is False
    finally:
        cli("stop", str(config))
        subprocess.run(["umount", "-l", str(primary_disk)], check=False)


def test_detach_is_not_ready_while_a_shard_has_no_active_server(tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml")
    run = tmp_path / "run"
    for role in ("primary", "backup"):
        mount(run / "data" / f"s0-{role}", size=1 << 20)  # under --min-free-bytes
    try:
        out = cli("start", str(config), "--detach", "--run-dir", str(run),
                  "--ready-timeout-s", "3", timeout_s=60)
        assert out.returncode == 1, (out.stdout, out.stderr)
        assert out.stdout.startswith("NOT_READY supervisor") and "active_shards=0/1" in out.stdout
        err = out.stderr
        assert "not served: s0: no ACTIVE server" in err and "disk error: ENOSPC" in err, err
        assert f"supervisor stop {config}" in err
    finally:
        cli("stop", str(config))
        for role in ("primary", "backup"):
            subprocess.run(["umount", "-l", str(run / "data" / f"s0-{role}")], check=False)


def test_a_torn_tail_is_reported_in_updates_in_the_log_and_the_metrics(procs, tmp_path):
    from clonemap.shards.persist import format as fmt

    config, control = write_config(tmp_path, "1shard.yaml")
    run = tmp_path / "run"
    _written_then_stopped(procs, config, control, run, 10)
    segment = max((run / "data" / "s0-primary").glob("log-*.cml"))
    torn = fmt.record([11, b"/t/1", b"x", None, b"", b"/t/2", b"y", None, b""])
    with open(segment, "ab") as f:
        f.write(torn[:-3])
    _supervise(procs, config, run)
    log = (run / "logs" / "s0-primary.log").read_text()
    assert "2 update(s), sequence 11..12" in log, log[-2000:]
    data = yaml.safe_load(config.read_text())
    body = urllib.request.urlopen(f"http://{data['metrics']}/metrics", timeout=5).read()
    line = next(x for x in body.decode().splitlines()
                if x.startswith("clonemap_recovery_torn_updates{") and 'role="primary"' in x)
    assert line.endswith(" 2.0"), line


def test_a_primary_whose_disk_fails_at_start_leaves_the_backup_to_serve(procs, tmp_path):
    """The "no disk" case of one server of a pair: the primary cannot start (its disk is
    under --min-free-bytes), so the backup never hears it and would refuse every vote.
    The supervisor reports the primary down, the backup serves on a client's vote, and
    the primary copies its map back once its disk has room."""
    config, control = write_config(tmp_path, "1shard.yaml")
    run = tmp_path / "run"
    ledger = _written_then_stopped(procs, config, control, run, 50)
    primary_disk = run / "data" / "s0-primary"
    mount(primary_disk, size=1 << 20)  # the primary's directory: a tiny, empty disk
    try:
        sup = _supervise(procs, config, run, "--ready-timeout-s", "3")
        assert any("DISK ERROR" in line for line in sup.stdout), sup.stdout
        ledger.check(config)  # the client's vote: the backup serves its copy
        rows = status(control)
        assert rows["s0/backup"]["bstar"] == "ACTIVE"
        assert rows["s0/backup"]["stats"]["peer_reported_down"] is True
    finally:
        subprocess.run(["umount", "-l", str(primary_disk)], check=False)
    # its disk is back (the directory as it was): it rejoins as passive and copies
    wait_status(control, lambda r: r["s0/primary"]["state"] == "RUNNING"
                and r["s0/primary"]["bstar"] == "PASSIVE", timeout_s=60)
    ledger.check(config)

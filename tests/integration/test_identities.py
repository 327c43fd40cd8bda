"""Named client identities, as an operator sets them up: identities and roles in the
config, ``supervisor keygen`` (each identity's own pair, only the missing ones),
``supervisor validate`` showing each identity's rights, and the control plane refusing
the commands that change the cluster to an identity whose role lacks ``admin`` while
the shared client pair, an admin identity and every identity's reads and writes work.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest
import yaml

from clonemap.client.api import Clone
from clonemap.shards.common.errors import Exit
from clonemap.shards.common.security import Security
from clonemap.supervisor.control import Control, status_rows
from conftest import PYTHON, ROOT
from test_supervisor_cli import cli, start, wait_status, write_config

pytestmark = pytest.mark.timeout(120)

SECURITY = {
    "curve": True,
    "clients": {"dashboard": {"role": "reader"}, "ops": {"role": "admin"}},
    "roles": {"reader": {"read": ["/"], "deny": ["/secrets/"]},
              "admin": {"read": [""], "write": [""], "admin": True}},
}


def chp(config, *args: str, identity: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("CLONEMAP_IDENTITY", None)
    if identity is not None:
        env["CLONEMAP_IDENTITY"] = identity  # (chp --identity is tried below too)
    return subprocess.run([PYTHON, "-m", "clonemap.client.cli", "--config", str(config),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=env)


def test_keygen_makes_each_identity_s_pair_and_only_the_missing_ones(tmp_path):
    config, _ = write_config(tmp_path, "1shard.yaml", security=SECURITY)
    out = cli("keygen", str(config))
    assert out.returncode == 0, out.stderr
    folder = tmp_path / "keys" / "clients"
    assert sorted(p.name for p in folder.iterdir()) == [
        "dashboard.key", "dashboard.key_secret", "ops.key", "ops.key_secret"]
    assert stat.S_IMODE((folder / "ops.key_secret").stat().st_mode) == 0o600
    kept = {p.name: p.read_bytes() for p in (tmp_path / "keys").rglob("*") if p.is_file()}
    again = cli("keygen", str(config))  # nothing missing: nothing written
    assert again.returncode == 2 and "nothing written" in again.stderr, again.stderr
    data = yaml.safe_load(config.read_text())
    data["security"]["clients"]["orders-svc"] = {"role": "reader"}
    config.write_text(yaml.safe_dump(data))
    added = cli("keygen", str(config))
    assert added.returncode == 0, added.stderr
    assert [line for line in added.stdout.splitlines() if line.startswith("wrote")] == [
        f"wrote {folder / 'orders-svc.key'}",
        f"wrote {folder / 'orders-svc.key_secret'}  (secret: mode 0600)"]
    for path in (tmp_path / "keys").rglob("*"):
        if path.is_file() and path.name in kept and "orders-svc" not in path.name:
            assert path.read_bytes() == kept[path.name], f"{path} was rewritten"


def test_validate_shows_each_identity_s_rights_and_refuses_a_bad_one(tmp_path):
    config, _ = write_config(tmp_path, "1shard.yaml", security=SECURITY)
    missing = cli("validate", str(config))
    assert missing.returncode == 2 and "clients/dashboard.key" in missing.stderr
    assert cli("keygen", str(config)).returncode == 0
    out = cli("validate", str(config))
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # (rich wraps long lines)
    assert "identity dashboard (role reader): read /; deny /secrets/" in text
    assert "identity ops (role admin): read (every key); write (every key); admin" in text
    assert "every server and relay enforces the roles' read, write and deny rights" in text
    as_json = json.loads(cli("validate", str(config), "--json").stdout)
    assert as_json["security"]["identities"]["dashboard"]["admin"] is False
    data = yaml.safe_load(config.read_text())
    data["security"]["clients"]["client"] = {"role": "nobody"}
    config.write_text(yaml.safe_dump(data))
    bad = cli("validate", str(config))
    assert bad.returncode == 2
    assert "security.clients.client: given \"client\"" in bad.stderr
    assert "security.clients.client.role: given \"nobody\": no such role" in bad.stderr


def test_only_admin_identities_change_the_cluster_and_every_identity_reads_and_writes(
        procs, tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml", security=SECURITY)
    assert cli("keygen", str(config)).returncode == 0
    sup = start(procs, config, tmp_path)
    try:
        control = Control(control, Security.load(config.parent / "keys", "client"))
        rows = wait_status(control, lambda r: all(
            x["bstar"] in ("ACTIVE", "PASSIVE") for x in r.values()))
        pid = rows["s0/primary"]["pid"]
        # a reader's control commands: status yes; kill, restart, stop and logs no
        assert cli("status", str(config), "--identity", "dashboard").returncode == 0
        for args in (("kill", "s0/primary"), ("restart", "s0/primary"), ("stop",),
                     ("logs", "s0/primary")):
            out = cli(*args, str(config), "--identity", "dashboard")
            assert out.returncode == Exit.FORBIDDEN, (args, out.stdout, out.stderr)
            assert "identity 'dashboard'" in out.stderr and "admin" in out.stderr
            assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        rows = wait_status(control, lambda r: r["s0/primary"]["state"] == "RUNNING")
        assert rows["s0/primary"]["pid"] == pid and rows["s0/primary"]["restarts"] == 0
        sup.wait_stderr("refused cluster.kill from identity 'dashboard'")  # its log
        _, summary = status_rows(control)
        assert summary["forbidden"] == {"dashboard": 4}  # counted by identity
        # data: every admitted identity, by environment, option and code, within its
        # rights (tests/integration/test_access_control.py tries them all)
        refused = chp(config, "set", "/k", "v", identity="dashboard")
        assert refused.returncode == Exit.FORBIDDEN, refused.stderr
        assert chp(config, "--identity", "ops", "set", "/k", "v").returncode == 0
        got = chp(config, "get", "/k", identity="dashboard")
        assert (got.returncode, got.stdout.strip()) == (0, "v"), got.stderr
        with Clone(config=str(config), identity="dashboard") as clone:
            assert clone.get("/k") == b"v"
        unknown = chp(config, "--identity", "nobody", "get", "/k")
        assert unknown.returncode == 2 and "clients/nobody.key_secret" in unknown.stderr
        # an admin identity, and the shared client pair (older configs), may
        killed = cli("kill", "s0/primary", str(config), "--identity", "ops")
        assert killed.returncode == 0, killed.stderr
        wait_status(control, lambda r: r["s0/primary"]["state"] == "RUNNING"
                    and r["s0/primary"]["pid"] != pid, timeout_s=30)
        assert cli("logs", "s0/primary", str(config)).returncode == 0
    finally:
        assert cli("stop", str(config), "--identity", "ops").returncode == 0
        sup.wait(30)

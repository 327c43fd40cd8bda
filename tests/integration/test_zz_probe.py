import json, time
from test_disk_faults import _supervise, _write_ledger
from test_supervisor_cli import status, write_config, cli

def test_probe(procs, tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml")
    run = tmp_path / "run"
    t0 = time.monotonic()
    sup = _supervise(procs, config, run)
    t1 = time.monotonic()
    rows = status(control)
    b0 = {k: rows["s0/backup"].get(k) for k in ("bstar", "seq", "keys")}
    ledger = _write_ledger(config, 50)
    t2 = time.monotonic()
    rows = status(control)
    out = {r: {k: rows[r].get(k) for k in ("bstar", "seq", "keys")} | {"phase": rows[r]["stats"].get("replica")} for r in rows}
    print("PROBE ready=%.2f writes=%.2f before=%s after=%s" % (t1-t0, t2-t1, b0, json.dumps(out)))
    assert cli("stop", str(config)).returncode == 0
    sup.wait(30)

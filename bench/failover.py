"""Binary Star failover: the gap after a kill -9, updates lost, the passive's CPU and memory.

``python -m bench.failover [--kills 6] [--rate 500] [--heartbeat-s 0.2] [--steady-s 2]
[--ceiling-s 2]`` (also ``python -m bench failover ...``)

First the same-run ceilings, flat out, for context (``bench.harness.ceilings.measure_ceilings``:
a bare pyzmq PUB->SUB and the bare forwarding loop). Then one pair (``python -m clonemap.shards
--primary/--backup``) serves one shard. In this process:

* a writer client (``clonemap.client.api.Clone`` with both servers, so every KVSET goes to both
  collectors) sets a NEW key ``/w/<n>`` at ``--rate`` per second for the whole run;
* a reader client (another ``Clone``, silence timeout 3 heartbeats) watches ``/w/`` and
  records the time of each change and of its failover callback;
* a raw SUB on each server's P+1 records the first KVPUB each server publishes.

Then ``--kills`` times: let the load run ``--steady-s`` (sampling the passive server's CPU
and RSS), ``kill -9`` the active, and measure from the kill to

* ``first_kvpub_s``: the first KVPUB the new active publishes (raw SUB) - it goes active
  on the first client vote, i.e. after the client's silence timeout;
* ``client_failover_s``: the reader's first failover callback (it switched servers; it
  may switch at once on the TCP disconnection, its votes refused until the peer expires);
* ``client_resumed_s``: its ``resumed`` callback (the new active's snapshot installed);
* ``client_resume_s``: the first change the reader applies after that (an update
  through the new active).

The killed server is restarted at once (it rejoins as passive and resynchronises) and the
next kill hits the other one. At the end the writer stops, the last key is awaited at the
reader, and the active's snapshot is compared with everything written: ``lost`` counts
keys written but missing (target 0); the reader's map must equal the snapshot.

The gap is set against the configured client silence timeout (3 heartbeats): resume
minus silence, and resume / silence; and against the ceilings: how many updates the bare
PUB->SUB carries in the median gap.

Targets: every client resumes within 2 s of its silence timeout; zero updates lost; the
passive's RSS grows < 20 MiB within any steady window.

``--supervised`` measures the other mode, the one users meet: the real supervisor
restarts the killed server at once and it rejoins PASSIVE (``bench.failover_supervised``).

Duration on a 2-core host: smoke (``--kills 1 --steady-s 0.3``) ~8 s; quick
(``--kills 3 --steady-s 1``) ~20 s; full (``--kills 10 --steady-s 2``) ~1 min.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time

from bench.harness import record as rec
from bench.harness.procs import Target, bench_main, free_port_base, server_argv
from clonemap.shards.common import timing

NAME = "failover"
DURATION = ("Duration (2 cores): smoke (--kills 1 --steady-s 0.3) ~8 s; quick (--kills 3 "
            "--steady-s 1) ~20 s; full (--kills 10 --steady-s 2) ~1 min.")
SILENCE_HEARTBEATS = timing.SILENCE_HEARTBEATS
RESUME_SLACK_S = 2.0
RSS_GROWTH_TARGET_BYTES = 20 * 2**20
DEADLINE_S = 20.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.failover",
                                 description=__doc__.split("\n")[0], epilog=DURATION)
    ap.add_argument("--kills", type=int, default=6, help="kill -9 this many times")
    ap.add_argument("--rate", type=float, default=500.0, help="writes per second")
    ap.add_argument("--heartbeat-s", type=float, default=0.2)
    ap.add_argument("--steady-s", type=float, default=2.0,
                    help="steady load before each kill (CPU/RSS sampled)")
    ap.add_argument("--ceiling-s", type=float, default=2.0,
                    help="measured window of each same-run ceiling (PUB->SUB, forwarder)")
    ap.add_argument("--supervised", action="store_true",
                    help="the cluster as users run it: supervisor start configs/4shard.yaml, "
                         "supervisor kill of s0's active, restarted by the supervisor "
                         "(bench.failover_supervised; record failover_supervised)")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    if (args.kills < 1 or args.rate <= 0 or args.heartbeat_s <= 0 or args.steady_s < 0
            or args.ceiling_s <= 0):
        ap.error("--kills >= 1, --rate > 0, --heartbeat-s > 0, --steady-s >= 0, "
                 "--ceiling-s > 0")
    return args


def canonical_command(args: argparse.Namespace) -> str:
    return rec.command_line("bench.failover", {
        "kills": args.kills, "rate": args.rate, "heartbeat_s": args.heartbeat_s,
        "steady_s": args.steady_s, "ceiling_s": args.ceiling_s})


class Pair:
    """The two server processes; ``start(i)`` (re)starts server i (0 primary, 1 backup)."""

    def __init__(self, heartbeat_s: float):
        self.ports = [free_port_base(4), 0]
        while True:
            self.ports[1] = free_port_base(4)
            if abs(self.ports[1] - self.ports[0]) >= 4:
                break
        self.heartbeat_s = heartbeat_s
        self.procs: list[Target | None] = [None, None]

    def start(self, i: int) -> Target:
        role = ("primary", "backup")[i]
        peer = self.ports[1 - i]
        argv = server_argv(self.ports[i], extra=(
            f"--{role}", "--peer", f"127.0.0.1:{peer}", "--shard", "bench",
            "--heartbeat-s", str(self.heartbeat_s), "--log-level", "warning"))
        self.procs[i] = Target(role, argv)
        return self.procs[i]

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None:
                proc.stop()


class StateWatch:
    """SUBs on both servers' P+3: the latest state message of each."""

    def __init__(self, ctx, ports, zmq, wire):
        self.zmq, self.wire = zmq, wire
        self.socks = []
        self.poller = zmq.Poller()
        for port in ports:
            s = ctx.socket(zmq.SUB)
            s.linger = 0
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(f"tcp://127.0.0.1:{port + 3}")
            self.poller.register(s, zmq.POLLIN)
            self.socks.append(s)
        self.last = [None, None]

    def pump(self, duration_s: float) -> None:
        """Read state messages for ``duration_s`` (the measured steady-load window)."""
        end = time.monotonic() + duration_s
        while (remaining := end - time.monotonic()) > 0:
            for sock, _ in self.poller.poll(max(1, int(remaining * 1000))):
                self.last[self.socks.index(sock)] = self.wire.decode(sock.recv_multipart())

    def wait(self, pred, timeout_s: float = DEADLINE_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred(self.last):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"pair state not reached: {self.last}")
            for sock, _ in self.poller.poll(int(remaining * 1000)):
                i = self.socks.index(sock)
                self.last[i] = self.wire.decode(sock.recv_multipart())


class FirstKvpub:
    """Raw SUBs on both P+1: the time of each server's first KVPUB after ``arm``."""

    def __init__(self, ctx, ports, zmq, chp):
        self.zmq, self.chp = zmq, chp
        self.socks = []
        for port in ports:
            s = ctx.socket(zmq.SUB)
            s.linger = 0
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(f"tcp://127.0.0.1:{port + 1}")
            self.socks.append(s)

    def wait_first(self, i: int, timeout_s: float) -> float | None:
        """Drop what server i published so far, then wait for its next KVPUB."""
        sock = self.socks[i]
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000)):
                return None
            msg = self.chp.decode_update(sock.recv_multipart())
            if isinstance(msg, self.chp.Kvpub):
                return time.monotonic()

    def drain(self, i: int) -> None:
        sock = self.socks[i]
        while sock.poll(0):
            sock.recv_multipart()


class Writer(threading.Thread):
    def __init__(self, clone, rate: float):
        super().__init__(name="writer", daemon=True)
        self.clone, self.rate = clone, rate
        self.n = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        period = 1.0 / self.rate
        t0 = time.monotonic()
        while not self.stop_event.is_set():
            self.clone.set(f"/w/{self.n:08d}", b"x")
            self.n += 1
            delay = t0 + self.n * period - time.monotonic()
            if delay > 0:
                self.stop_event.wait(delay)


def _proc_sample(pid: int) -> dict:
    import psutil

    p = psutil.Process(pid)
    t = p.cpu_times()
    return {"cpu_s": t.user + t.system, "rss": p.memory_info().rss, "at": time.monotonic()}


def run(args: argparse.Namespace) -> rec.Record:
    from bench.harness.ceilings import measure_ceilings

    hb = args.heartbeat_s
    silence_s = round(SILENCE_HEARTBEATS * hb, 6)
    record = rec.Record(NAME, canonical_command(args), {
        "kills": args.kills, "rate_per_s": args.rate, "heartbeat_s": hb,
        "client_silence_timeout_s": silence_s, "steady_s": args.steady_s,
        "ceiling_s": args.ceiling_s})
    with rec.Progress(NAME, 3 + args.kills) as progress:
        ceilings = measure_ceilings(seconds=args.ceiling_s, warmup=min(1.0, args.ceiling_s / 2),
                                    kinds=("pubsub", "forwarder"), progress=progress)
        _run_pair(args, record, progress)
        progress.finish_step()
    s = record.data["summary"]
    s["ceilings"] = ceilings
    pubsub_rate = ceilings.get("pubsub", {}).get("received_per_s") or 0.0
    resume = s["client_resume_s"].get("median")
    s["gap"] = {
        "client_silence_timeout_s": silence_s,
        "client_resume_to_silence": round(resume / silence_s, 2) if resume else None,
        "first_kvpub_after_silence_s": _dist([r["first_kvpub_s"] - silence_s
                                              for r in record.data["runs"]
                                              if r["first_kvpub_s"] is not None]),
        "pubsub_updates_in_median_gap": round(resume * pubsub_rate) if resume else None,
    }
    record.target("client resume after its silence timeout (max)",
                  s["client_resume_after_silence_s"]["max"], RESUME_SLACK_S, "s",
                  higher_is_better=False)
    record.target("updates lost", s["lost"], 1, "updates", higher_is_better=False)
    record.target("passive RSS growth in a steady window (max)", s["passive_rss_growth_mib"],
                  RSS_GROWTH_TARGET_BYTES / 2**20, "MiB", higher_is_better=False)
    record.finish()
    return record


def _run_pair(args: argparse.Namespace, record: rec.Record, progress: rec.Progress) -> None:
    """The pair, the clients and the kills; fills the record's runs and summary."""
    import zmq

    from clonemap.client.api import Clone
    from clonemap.shards.common.proto import bstar as wire
    from clonemap.shards.common.proto import chp

    hb = args.heartbeat_s
    silence_s = round(SILENCE_HEARTBEATS * hb, 6)
    pair = Pair(hb)
    ctx = zmq.Context()
    clones = []
    writer = None
    try:
        pair.start(0)
        pair.start(1)
        states = StateWatch(ctx, pair.ports, zmq, wire)
        states.wait(lambda s: s[0] is not None and s[1] is not None
                    and {s[0].state, s[1].state} == {wire.State.ACTIVE, wire.State.PASSIVE})
        raw = FirstKvpub(ctx, pair.ports, zmq, chp)
        servers = [f"tcp://127.0.0.1:{p}" for p in pair.ports]
        events: list[tuple[str, float, object]] = []
        lock = threading.Lock()

        def on_failover(info) -> None:
            with lock:
                events.append(("failover", time.monotonic(), info))

        def on_change(change) -> None:
            if change.kind == "put":
                with lock:
                    events.append(("put", time.monotonic(), change.seq))

        reader = Clone(servers, silence_timeout_s=silence_s, on_failover=on_failover)
        clones.append(reader)
        writer_clone = Clone(servers, silence_timeout_s=silence_s)
        clones.append(writer_clone)
        reader.watch("/w/", callback=on_change)
        writer = Writer(writer_clone, args.rate)
        writer.start()
        active = 0 if states.last[0].state == wire.State.ACTIVE else 1
        rss_growth = []
        for k in range(args.kills):
            passive = 1 - active
            progress.step(f"kill {k + 1}/{args.kills}: {args.steady_s:g} s steady load, then "
                          f"kill -9 the {pair.procs[active].name}")
            # the passive has rejoined and caught up
            states.wait(lambda s: s[passive] is not None and s[passive].state ==
                        wire.State.PASSIVE and s[active].state == wire.State.ACTIVE)
            s0 = _proc_sample(pair.procs[passive].pid)
            states.pump(args.steady_s)  # steady load; keeps the latest states
            s1 = _proc_sample(pair.procs[passive].pid)
            rss_growth.append(s1["rss"] - s0["rss"])
            lag = states.last[active].sequence - states.last[passive].sequence
            raw.drain(passive)
            with lock:
                n_events = len(events)
            t_kill = time.monotonic()
            os.kill(pair.procs[active].pid, signal.SIGKILL)
            first = raw.wait_first(passive, DEADLINE_S)
            deadline = time.monotonic() + DEADLINE_S
            # The reader reports each failover twice: the switch (it may come at once, on
            # the TCP disconnection) and ``resumed`` (the new server's snapshot installed).
            # Its resume is the first update it applies after that, through the new active.
            failover_t = resumed_t = resume_t = None
            while time.monotonic() < deadline and resume_t is None:
                with lock:
                    for kind, t, info in events[n_events:]:
                        if kind == "failover" and not info.resumed and failover_t is None:
                            failover_t = t
                        elif kind == "failover" and info.resumed and resumed_t is None:
                            resumed_t = t
                        elif kind == "put" and resumed_t is not None and resume_t is None:
                            resume_t = t
                    n_events = len(events)
                if resume_t is None:
                    states.poller.poll(20)
            pair.procs[active].stop()
            run_ = {
                "kill": k + 1, "killed": pair.procs[active].name,
                "first_kvpub_s": round(first - t_kill, 4) if first else None,
                "client_failover_s": round(failover_t - t_kill, 4) if failover_t else None,
                "client_resumed_s": round(resumed_t - t_kill, 4) if resumed_t else None,
                "client_resume_s": round(resume_t - t_kill, 4) if resume_t else None,
                "passive_cpu_pct": round(100 * (s1["cpu_s"] - s0["cpu_s"]) /
                                         max(1e-9, s1["at"] - s0["at"]), 1),
                "passive_rss_mib": round(s1["rss"] / 2**20, 1),
                "passive_rss_growth_kib": round((s1["rss"] - s0["rss"]) / 1024),
                "passive_lag_seq": lag,
                "writes_so_far": writer.n,
            }
            record.add_run(run_)
            progress.note(f"kill {k + 1}: first KVPUB {run_['first_kvpub_s']} s, client "
                          f"resumed {run_['client_resume_s']} s after the kill (silence "
                          f"timeout {silence_s:g} s); passive CPU {run_['passive_cpu_pct']}%, "
                          f"RSS {run_['passive_rss_mib']} MiB")
            pair.start(active)  # rejoins as passive
            active = passive
        progress.step("the last write at the reader; the active's snapshot vs every write")
        writer.stop_event.set()
        writer.join()
        last_key = f"/w/{writer.n - 1:08d}"
        deadline = time.monotonic() + DEADLINE_S
        while reader.get(last_key) is None and time.monotonic() < deadline:
            states.poller.poll(50)
        snap = _snapshot(ctx, pair.ports[active], zmq, chp)
        written = {f"/w/{i:08d}".encode() for i in range(writer.n)}
        lost = len(written - set(snap))
        reader_map = {k.encode() for k in reader.keys("/w/")}
        converged = reader_map == {k for k in snap if k.startswith(b"/w/")}
        record.data["summary"] = _summary(record.data["runs"], silence_s, lost, writer.n,
                                          converged, rss_growth)
    finally:
        if writer is not None:
            writer.stop_event.set()
        for c in clones:
            c.close()
        pair.stop()
        ctx.destroy(linger=0)


def _snapshot(ctx, port: int, zmq, chp) -> dict[bytes, bytes]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart(chp.icanhaz())
    out = {}
    try:
        while True:
            if not dealer.poll(int(DEADLINE_S * 1000)):
                raise TimeoutError(f"no snapshot from port {port}")
            reply = chp.decode_snapshot(dealer.recv_multipart())
            if isinstance(reply, chp.Kthxbai):
                return out
            out[reply.key] = reply.value
    finally:
        dealer.close(0)


def _dist(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"n": 0}
    p90 = values[min(len(values) - 1, int(round(0.9 * (len(values) - 1))))]
    return {"n": len(values), "median": round(statistics.median(values), 3),
            "min": round(values[0], 3), "p90": round(p90, 3), "max": round(values[-1], 3)}


def _summary(runs, silence_s, lost, written, converged, rss_growth) -> dict:
    resume = [r["client_resume_s"] for r in runs]
    return {
        "first_kvpub_s": _dist([r["first_kvpub_s"] for r in runs]),
        "client_failover_s": _dist([r["client_failover_s"] for r in runs]),
        "client_resumed_s": _dist([r["client_resumed_s"] for r in runs]),
        "client_resume_s": _dist(resume),
        "client_resume_after_silence_s": _dist(
            [r - silence_s if r is not None else float("inf") for r in resume]),
        "missed_measurements": sum(r is None for r in resume),
        "written": written, "lost": lost, "reader_converged": converged,
        "passive_cpu_pct": _dist([r["passive_cpu_pct"] for r in runs]),
        "passive_rss_mib": _dist([r["passive_rss_mib"] for r in runs]),
        "passive_rss_growth_mib": round(max(rss_growth) / 2**20, 2),
    }


def report(record: rec.Record) -> None:
    rows = [[r["kill"], r["killed"], r["first_kvpub_s"], r["client_failover_s"],
             r["client_resumed_s"], r["client_resume_s"], r["passive_cpu_pct"], r["passive_rss_mib"],
             r["passive_rss_growth_kib"]] for r in record.data["runs"]]
    rec.table(record, f"{NAME}: per kill (seconds after kill -9)", [
        "kill", "killed", "first KVPUB", "client switch", "client resynced", "client resume",
        "passive CPU %", "passive RSS MiB", "RSS growth KiB"], rows)
    s = record.data["summary"]
    gap, c = s["gap"], s["ceilings"]
    rows = [[name, d.get("n"), d.get("median"), d.get("min"), d.get("p90"), d.get("max")]
            for name, d in (("first KVPUB from the new active", s["first_kvpub_s"]),
                            ("client switch (callback)", s["client_failover_s"]),
                            ("client resynced (callback)", s["client_resumed_s"]),
                            ("client resume (first update)", s["client_resume_s"]),
                            ("resume minus silence timeout", s["client_resume_after_silence_s"]),
                            ("first KVPUB minus silence timeout",
                             gap["first_kvpub_after_silence_s"]))]
    rec.table(record, f"{NAME}: distribution (s)", ["measure", "n", "median", "min", "p90",
                                                    "max"], rows,
              caption=f"{s['written']} writes, {s['lost']} lost, reader converged: "
                      f"{s['reader_converged']}; passive RSS median "
                      f"{s['passive_rss_mib'].get('median')} MiB, max growth in a steady "
                      f"window {s['passive_rss_growth_mib']} MiB. Client silence timeout "
                      f"{gap['client_silence_timeout_s']:g} s: resume / silence "
                      f"{gap['client_resume_to_silence']}. Same-run ceilings (flat out): "
                      f"bare PUB->SUB {c['pubsub']['received_per_s']:,.0f}/s (it would carry "
                      f"{gap['pubsub_updates_in_median_gap']} updates in the median gap), "
                      f"bare forwarding loop {c['forwarder']['received_per_s']:,.0f}/s.")
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    if argv is None:
        import sys
        argv = sys.argv[1:]
    if "--supervised" in argv:
        from bench import failover_supervised

        return failover_supervised.main(argv)
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()

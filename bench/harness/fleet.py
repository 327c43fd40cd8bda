"""One timed load run: the writer and subscriber processes of ``bench.harness.traffic`` as children.

``with LoadRun(writers, subscribers) as run: result = run.measure(warmup_s, seconds)``
starts every process (``multiprocessing`` "spawn"), waits until each is ready (a writer:
its collectors subscribed), hands all of them the same absolute window, and collects
what each saw; ``LoadResult.figures()`` turns that into rates over the window. Every
child is ended by PID on exit, even on an error.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict, dataclass, field

from bench.harness.traffic import (FLUSH_S, READY_DEADLINE_S, SubscriberConfig, Window,
                                   WriterConfig, percentiles_ms, writer_main)
from bench.harness.traffic_reader import subscriber_main


@dataclass
class LoadResult:
    writers: list[dict] = field(default_factory=list)
    subscribers: list[dict] = field(default_factory=list)

    def figures(self, split: bool = False) -> dict:
        """Totals and per-second rates over the measured window: the first subscriber's
        figures (``split``: the subscribers read disjoint shards, so their sum, and the
        latency percentiles of all their samples together), and every subscriber's
        received rate in ``received_per_s_each``."""
        w_window = sum(w["window_s"] for w in self.writers) / max(1, len(self.writers))
        sent_w = sum(w["sent_window"] for w in self.writers)
        sub = merged(self.subscribers) if split else self.subscribers[0]
        win = sub["window_s"] or 1e-9
        return {
            "window_s": round(win, 4),
            "sent_per_s": round(sent_w / (w_window or 1e-9), 1),
            "sequenced_per_s": round(sub["sequenced_window"] / win, 1),
            "received_per_s": round(sub["received_window"] / win, 1),
            "loss_window": sub["gaps_window"],
            "sent_total": sum(w["sent_total"] for w in self.writers),
            "dropped_at_writer_total": sum(w["dropped_total"] for w in self.writers),
            "first_seq": sub["first_seq"],
            "sequenced_total": sub["sequenced_total"],
            "received_total": sub["received_total"],
            "loss_total": sub["gaps_total"],
            "latency_ms": sub["latency_ms"],
            "received_per_s_each": [round(x["received_window"] / (x["window_s"] or 1e-9), 1)
                                    for x in self.subscribers],
            "loss_window_each": [x["gaps_window"] for x in self.subscribers],
            "malformed": sum(x["malformed"] for x in self.subscribers),
            "per_source": [{k: x[k] for k in ("endpoint", "received_window",
                                               "sequenced_window", "gaps_window")}
                           for x in sub["per_source"]],
        }


def merged(subscribers: list[dict]) -> dict:
    """One subscriber's figures from several that read disjoint shards: counts summed,
    the window their mean, latency from all samples, every shard in ``per_source``."""
    if len(subscribers) == 1:
        return subscribers[0]
    out = dict(subscribers[0])
    for name in ("received_total", "gaps_total", "received_window", "sequenced_window",
                 "gaps_window", "sequenced_total", "malformed", "latency_samples"):
        out[name] = sum(s.get(name, 0) for s in subscribers)
    out["window_s"] = sum(s["window_s"] for s in subscribers) / len(subscribers)
    samples = sorted(x for s in subscribers for x in s.get("latency_ns", ()))
    out["latency_ms"] = percentiles_ms(samples)
    out["per_source"] = [src for s in subscribers
                         for src in (s["per_source"] or [_one_source(s)])]
    return out


def _one_source(sub: dict) -> dict:
    return {"endpoint": (sub.get("endpoints") or [""])[0], "received_window": sub["received_window"],
            "sequenced_window": sub["sequenced_window"], "gaps_window": sub["gaps_window"]}


class LoadRun:
    """Writers and subscribers as child processes; every one is ended by PID on exit.

    ``with LoadRun(writers, subscribers) as run: result = run.measure(warmup_s, seconds)``
    """

    def __init__(self, writers: list[WriterConfig], subscribers: list[SubscriberConfig]):
        self.writer_cfgs = writers
        self.subscriber_cfgs = subscribers
        self._ctx = mp.get_context("spawn")
        self._children: list[tuple[str, object, object]] = []  # (role, process, conn)
        self._results: dict[int, dict] = {}    # child index -> result read early
        self._progress: dict[int, dict] = {}   # child index -> latest progress message

    def __enter__(self) -> "LoadRun":
        try:
            for cfg in self.subscriber_cfgs:
                self._start("subscriber", subscriber_main, cfg)
            for cfg in self.writer_cfgs:
                self._start("writer", writer_main, cfg)
            deadline = time.monotonic() + READY_DEADLINE_S + 10
            for role, proc, conn in self._children:
                msg = _recv_by(conn, deadline, f"{role} pid {proc.pid} ready")
                if "error" in msg:
                    raise RuntimeError(f"{role}: {msg['error']}")
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, role: str, target, cfg) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=target, args=(cfg, child), daemon=True,
                                 name=f"bench-{role}")
        proc.start()
        child.close()
        self._children.append((role, proc, parent))

    def start(self, warmup_s: float, seconds: float) -> Window:
        """Hand every process the same window (starting after ``warmup_s``); load begins."""
        now = time.monotonic()
        window = Window(now + warmup_s, now + warmup_s + seconds)
        for _, _, conn in self._children:
            conn.send(window)
        return window

    def progress(self) -> dict:
        """The subscribers' latest running figures, without blocking: ``received`` and
        ``received_per_s`` (over the last ~``progress_s``) per subscriber, and their sum of
        ``gaps``. Empty lists before the first report."""
        for idx, (role, _, conn) in enumerate(self._children):
            if role != "subscriber" or idx in self._results:
                continue
            try:
                while conn.poll(0):
                    msg = conn.recv()
                    if "progress" in msg:
                        self._progress[idx] = msg
                    else:
                        self._results[idx] = msg
                        break
            except (EOFError, OSError):
                continue
        latest = [self._progress[i] for i in sorted(self._progress)]
        return {"received": [m["received"] for m in latest],
                "received_per_s": [m["received_per_s"] for m in latest],
                "gaps": sum(m["gaps"] for m in latest)}

    def status(self) -> str:
        """A short live line from ``progress()``, e.g. for ``record.Progress.wait_until``."""
        p = self.progress()
        if not p["received_per_s"]:
            return "waiting for the first figures"
        rates = p["received_per_s"]
        each = (f"{min(rates):,.0f}-{max(rates):,.0f}/s per subscriber" if len(rates) > 1
                else f"{rates[0]:,.0f}/s")
        return f"received {each}, {sum(p['received']):,} so far, gaps {p['gaps']}"

    def collect(self, window: Window, deadline_s: float = 30.0) -> LoadResult:
        """Wait (up to ``deadline_s`` after the window) for every process's figures
        (progress messages are skipped)."""
        deadline = window.t_end + deadline_s
        result = LoadResult()
        for idx, (role, proc, conn) in enumerate(self._children):
            msg = self._results.pop(idx, None)
            while msg is None or "progress" in msg:
                msg = _recv_by(conn, deadline, f"{role} pid {proc.pid} result")
            if "error" in msg:
                raise RuntimeError(f"{role}: {msg['error']}")
            (result.writers if role == "writer" else result.subscribers).append(msg)
        return result

    def measure(self, warmup_s: float, seconds: float) -> LoadResult:
        return self.collect(self.start(warmup_s, seconds))

    def pids(self, role: str | None = None) -> list[int]:
        return [proc.pid for r, proc, _ in self._children if role in (None, r)]

    def close(self, grace_s: float = 0.0) -> None:
        """End every child by PID: wait up to ``grace_s`` for them to exit on their own
        (a writer flushing its queue), then SIGTERM, then SIGKILL."""
        deadline = time.monotonic() + grace_s
        for _, proc, _ in self._children:
            proc.join(max(0.0, deadline - time.monotonic()))
        for _, proc, conn in self._children:
            if proc.is_alive():
                proc.terminate()
        for _, proc, conn in self._children:
            proc.join(3)
            if proc.is_alive():
                proc.kill()
                proc.join(3)
            conn.close()
        self._children.clear()
        self._results.clear()
        self._progress.clear()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(grace_s=0.0 if exc_type else FLUSH_S + 5.0)


def _recv_by(conn, deadline: float, what: str) -> dict:
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not conn.poll(remaining):
        raise TimeoutError(f"no {what} within the deadline")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"{what}: the process exited") from None


def config_dict(cfg) -> dict:
    d = asdict(cfg)
    return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in d.items()}


def timed_writer(ports: list[int], *, rate: float, count: int,
                 value_bytes: int = 100, keys_dir: str = "", identity: str = "") -> LoadRun:
    """One open-loop writer (the traffic writer, the one every scenario uses): ``count``
    new keys ``key_of(0..count-1)``, routed over the shards at base ports ``ports`` as a
    client routes them, update i due at ``i / rate`` s and stamped with that intended
    time (``stamp_of``). ``with timed_writer(...) as run: window = run.start(0.0, s)``,
    then ``run.collect(window).writers[0]`` (``sent_total``, ``elapsed_s``,
    ``first_send_ns``). ``keys_dir`` (and ``identity``): a CURVE writer, with the
    client pair (or that identity's)."""
    collectors = tuple(f"tcp://127.0.0.1:{p + 2}" for p in ports)
    cfg = WriterConfig(collector=collectors[0], collectors=collectors if len(ports) > 1
                       else (), keys=count, value_bytes=value_bytes,
                       distribution="sequential", mode="rate", rate_per_s=rate, count=count,
                       tail_s=0.0, keys_dir=keys_dir, identity=identity)
    return LoadRun([cfg], [])

"""The load harness's subscriber processes: one per set of sources (``SubscriberConfig``),
reading every source's KVPUBs as fast as it can, checking sequences and sampling the
write-to-read latency from the writers' stamps (``bench.harness.traffic``)."""
from __future__ import annotations

import os
import time

from bench.harness.traffic import (CHECK_EVERY, GO_DEADLINE_S, KEY_FORMAT, MERGE_SAMPLES,
                                   READY_DEADLINE_S, STAMP_BYTES, SubscriberConfig, Window,
                                   _pin, _secure, _unpack_u64, percentiles_ms)


class SourceState:
    """What a subscriber saw from one publisher (one shard): counts and its sequence."""

    __slots__ = ("received", "hugz", "gaps", "backwards", "malformed", "first_seq",
                 "last_seq", "max_seq")

    def __init__(self) -> None:
        self.received = self.hugz = self.gaps = self.backwards = self.malformed = 0
        self.first_seq = self.last_seq = self.max_seq = 0

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def blind_reader(recv, more, again, every: int):
    """The pure path's ``read(sock, flags, max_frames)`` for ``drain``: five backend
    receives without reading MORE (a message's other frames are queued once its first is
    read), so a shorter message borrows frames from the next one or raises ``again``, and
    comes back short. Every ``every``-th message is checked for a sixth frame, which is read
    off and makes it come back long. None when nothing is waiting. ``recv(sock, flags,
    copy)``, ``more(sock)`` and ``again`` are pyzmq's backend calls in a subscriber."""
    count = 0

    def read(sock, flags: int, max_frames: int) -> list | None:
        nonlocal count
        try:
            first = recv(sock, flags, True)
        except again:
            return None
        try:
            frames = [first, recv(sock, 1, True), recv(sock, 1, True), recv(sock, 1, True),
                      recv(sock, 1, True)]  # 1 = zmq.NOBLOCK
        except again:
            return [first]
        count += 1
        if count % every == 0 and more(sock):
            while more(sock):
                recv(sock, 1, True)
            frames.append(b"")
        return frames
    return read


def drain(read, src, st: SourceState, budget: int, every: int, samples: list[int],
          now_ns) -> int:
    """Read up to ``budget`` queued messages from ``src`` without blocking, updating
    ``st``: a sequence above the highest seen so far that skips numbers counts the skipped
    ones as gaps; one at or below it counts as backwards; 0 is a HUGZ; a message of other
    than five frames, or with a sequence frame of other than 8 bytes, is malformed. Every
    ``every``-th update's latency is sampled from the value's stamp. Returns the count.

    ``read(src, NOBLOCK, 5)`` gives one message's frames, or None when none is waiting:
    on the compiled frame path ``zio.compiled_recv()`` with ``src = sock.underlying``, one
    C call per whole message with every frame count checked (0.60 against 0.91 us a message
    for ``blind_reader``'s five receives). The subscriber must outrun what it measures, or
    a publisher's high-water mark drops what it cannot take and the run reports loss."""
    received, max_seq, gaps, last = st.received, st.max_seq, st.gaps, st.last_seq
    unpack = _unpack_u64
    n = 0
    while n < budget:
        frames = read(src, 1, 5)  # 1 = zmq.NOBLOCK
        if frames is None:
            break
        n += 1
        if len(frames) != 5 or len(frames[1]) != 8:
            st.malformed += 1
            continue
        seq = unpack(frames[1])[0]
        if seq == 0:
            st.hugz += 1
            continue
        received += 1
        last = seq
        if seq > max_seq:
            if max_seq and seq != max_seq + 1:
                gaps += seq - max_seq - 1
            max_seq = seq
        else:
            st.backwards += 1
        if not st.first_seq:
            st.first_seq = seq
        if received % every == 0 and len(frames[4]) >= STAMP_BYTES:
            samples.append(now_ns() - unpack(frames[4][:STAMP_BYTES])[0])
    st.received, st.max_seq, st.gaps, st.last_seq = received, max_seq, gaps, last
    return n


def _sub_socket(ctx, endpoint: str, subscribe: bytes, rcvhwm: int, keys_dir: str = "",
                bind: bool = False, identity: str = ""):
    """A SUB with linger 0 and one subscription, bound to ``endpoint`` or connected to it
    (with the cluster's client key when ``keys_dir`` is set); closed if any step fails,
    so that the caller's context can still terminate. A connected one has a monitor
    (``_handshaken`` waits on it and closes it)."""
    import zmq

    sock = ctx.socket(zmq.SUB)
    try:
        sock.linger = 0
        sock.rcvhwm = rcvhwm
        sock.setsockopt(zmq.SUBSCRIBE, subscribe)
        if bind:
            sock.bind(endpoint)
        else:
            _secure(sock, keys_dir, identity)
            _MONITORS[sock] = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            sock.connect(endpoint)
    except BaseException:
        _drop_monitor(sock)
        sock.close(0)
        raise
    return sock


_MONITORS: dict = {}  # a connected SUB -> its monitor, until _handshaken


def _drop_monitor(sock) -> None:
    monitor = _MONITORS.pop(sock, None)
    if monitor is not None:
        sock.disable_monitor()
        monitor.close(0)


def _handshaken(socks, endpoints, deadline_s: float) -> None:
    """Until every connected SUB in ``socks`` has finished its ZMTP handshake (its
    subscription goes out right after), then their monitors are closed. A subscriber
    that reported ready on connect() alone, on a loaded host, was still connecting
    through a whole 0.3 s smoke window and read 0 updates. RuntimeError on a failed
    handshake or none by the deadline."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    deadline = time.monotonic() + deadline_s
    try:
        for sock, endpoint in zip(socks, endpoints):
            monitor = _MONITORS.get(sock)
            while monitor is not None:
                left_ms = int(1000 * (deadline - time.monotonic()))
                if left_ms <= 0 or not monitor.poll(left_ms):
                    raise RuntimeError(f"no ZMTP handshake with {endpoint} in {deadline_s} s")
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    break
                raise RuntimeError(f"the handshake with {endpoint} failed (event {event:#x})")
    finally:
        for sock in socks:
            _drop_monitor(sock)


def subscriber_main(cfg: SubscriberConfig, conn) -> None:
    """Child process: subscribe, report ready, count and time KVPUBs over a Window."""
    _pin(cfg.core)
    import importlib

    import zmq

    # everything the window's loop needs is imported before "ready": imported after the
    # window was handed out, under writers already flooding a small host's cores, it
    # once took past the window's end, and the run read 0 received
    for module in ("zmq.backend", "clonemap.shards.common.zio"):
        importlib.import_module(module)

    ctx = zmq.Context()
    socks = []
    result: dict = {"role": "subscriber", "pid": os.getpid()}
    try:
        for endpoint in cfg.sources:
            socks.append(_sub_socket(ctx, endpoint, cfg.subscribe, cfg.rcvhwm, cfg.keys_dir,
                                     cfg.bind, cfg.identity))
        _handshaken(socks, cfg.sources, READY_DEADLINE_S)
        conn.send({"ready": True})
        if not conn.poll(GO_DEADLINE_S):
            return
        window: Window = conn.recv()
        result.update(_subscribe(socks, cfg, window, conn, zmq))
        conn.send(result)
    except KeyboardInterrupt:
        pass
    except (zmq.ZMQError, RuntimeError) as exc:  # (RuntimeError: _handshaken)
        result["error"] = f"subscriber on {cfg.sources}: {exc}"
        conn.send(result)
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()


def _subscribe(socks, cfg: SubscriberConfig, window: Window, conn, zmq) -> dict:
    from zmq.backend import Socket

    recv = Socket.recv
    rcvmore = zmq.RCVMORE
    get = Socket.get
    more = lambda sock: get(sock, rcvmore)  # noqa: E731 (called once per ~64 updates)
    again = zmq.Again
    clock = time.monotonic
    now_ns = time.monotonic_ns
    every = max(1, cfg.latency_every)
    states = [SourceState() for _ in socks]
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    samples: list[int] = []
    at_start = at_end = None   # (time, [(received, max_seq, gaps) per source])
    last_data = clock()
    hard_stop = window.t_end + cfg.drain_s
    progress_s = cfg.progress_s
    next_progress = clock() + progress_s if progress_s else float("inf")
    last_report = (clock(), 0)

    def snapshot(now):
        return now, [(st.received, st.max_seq, st.gaps) for st in states]

    from clonemap.shards.common import zio

    if zio.COMPILED:
        read, sources = zio.compiled_recv(), [sock.underlying for sock in socks]
    else:
        read, sources = blind_reader(recv, more, again, every), socks
    drains = list(zip(sources, states))

    discard: list[int] = []

    def drain_all(into: list[int]) -> int:
        return sum(drain(read, src, st, CHECK_EVERY, every, into, now_ns)
                   for src, st in drains)

    late_s = None  # how long after the window's start the loop first looked (0: in time)
    while True:
        # Latency is sampled only from the updates counted in the window: those drained
        # after its start snapshot and before its end one. The first ~100 ms of a run
        # (connections, a new log file, cold code) read up to ~37 ms, ~1% of a run's
        # samples had the warm-up been kept: enough to set its p99 alone.
        n = drain_all(samples if at_start is not None and at_end is None else discard)
        discard.clear()
        now = clock()
        if n:
            last_data = now
        else:
            poller.poll(100)
            now = clock()
        if late_s is None:
            late_s = max(0.0, now - window.t_start)
        if at_start is None and now >= window.t_start:
            at_start = snapshot(now)
        if at_end is None and now >= window.t_end:
            at_end = snapshot(now)
        if now >= next_progress:
            total = sum(st.received for st in states)
            rate = (total - last_report[1]) / ((now - last_report[0]) or 1e-9)
            conn.send({"progress": True, "t": now, "received": total,
                       "received_per_s": round(rate, 1),
                       "gaps": sum(st.gaps for st in states)})
            last_report = (now, total)
            next_progress = now + progress_s
        if at_end is not None and (now - last_data >= cfg.quiet_s or now >= hard_stop):
            break
    samples.sort()
    window_s = at_end[0] - at_start[0]
    per_source = []
    for endpoint, st, s0, s1 in zip(cfg.sources, states, at_start[1], at_end[1]):
        per_source.append({"endpoint": endpoint, **st.as_dict(),
                           "received_window": s1[0] - s0[0],
                           "sequenced_window": s1[1] - s0[1],
                           "gaps_window": s1[2] - s0[2], "seq_at_window_start": s0[1]})
    total = lambda name: sum(x[name] for x in per_source)  # noqa: E731
    return {
        "received_total": total("received"), "hugz": total("hugz"),
        "first_seq": per_source[0]["first_seq"], "last_seq": per_source[0]["last_seq"],
        "max_seq": per_source[0]["max_seq"], "gaps_total": total("gaps"),
        "backwards_total": total("backwards"), "malformed": total("malformed"),
        "window_s": window_s,
        "late_s": round(late_s or 0.0, 3),
        "received_window": total("received_window"),
        "sequenced_window": total("sequenced_window"),
        "gaps_window": total("gaps_window"),
        "seq_at_window_start": per_source[0]["seq_at_window_start"],
        "sequenced_total": sum(x["max_seq"] - x["first_seq"] + 1 for x in per_source
                               if x["max_seq"]),
        "latency_samples": len(samples),
        "latency_ms": percentiles_ms(samples),
        # for a merge over subscribers that split the shards (fleet.LoadResult)
        "latency_ns": samples[::max(1, len(samples) // MERGE_SAMPLES)],
        "per_source": per_source if len(per_source) > 1 else [],
        "endpoints": list(cfg.sources),
    }


SETTLE_QUIET_S = 0.25
"""``settle`` returns once the publishers have sent no update for this long."""
SETTLE_DEADLINE_S = 60.0


def settle(publishers: list[str], *, keys_dir: str = "", quiet_s: float = SETTLE_QUIET_S,
           deadline_s: float = SETTLE_DEADLINE_S) -> dict:
    """Wait until the servers behind ``publishers`` have published the harness's last
    update: no KVPUB of a harness key for ``quiet_s`` (HUGZ are not subscribed). A flat-out
    window leaves the servers a backlog (writers outran them; their queues hold seconds of
    updates), which a next window's fresh subscribers would read with old stamps and time
    as their own. Returns ``settle_s`` (how long it took), ``settle_updates`` (how many
    were still coming) and ``settled`` (False: still publishing at ``deadline_s``)."""
    import zmq

    prefix = KEY_FORMAT.split("%", 1)[0].encode()
    ctx = zmq.Context.instance()
    socks = []
    poller = zmq.Poller()
    t0 = time.monotonic()
    seen = 0
    try:
        for endpoint in publishers:
            socks.append(_sub_socket(ctx, endpoint, prefix, 0, keys_dir))
            poller.register(socks[-1], zmq.POLLIN)
        # connected, or "quiet for quiet_s" could be a subscription not yet in effect
        _handshaken(socks, publishers, deadline_s)
        last = t0
        while True:
            now = time.monotonic()
            settled = now - last >= quiet_s
            if settled or now - t0 >= deadline_s:
                return {"settle_s": round(now - t0, 3), "settle_updates": seen,
                        "settled": settled}
            ready = poller.poll(max(1, int((quiet_s - (now - last)) * 1000)))
            for sock, _ in ready:
                while True:
                    try:
                        sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    seen += 1
                last = time.monotonic()
    finally:
        for sock in socks:
            sock.close(0)

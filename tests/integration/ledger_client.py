"""A real client for the partition tests, run as a process inside a network namespace.

    python ledger_client.py write SERVERS PREFIX [RATE]   writes PREFIX0, PREFIX1, ...
        with wait=True, one at a time (at most RATE a second, when given), until
        SIGTERM; prints ``ACK KEY`` for each acknowledged write and ``FAIL KEY ERROR``
        for each that was not (the ledger)
    python ledger_client.py read SERVERS           a fresh client: prints ``KEY VALUE`` for
        every key of its complete copy, then ``END N``
    python ledger_client.py dump SERVER[,SERVER..] [WAIT_S]
        each server's whole map, by a raw ICANHAZ (whatever routing it follows), asked
        all at once: for each, ``FROM SERVER``, its ``KEY VALUE`` lines and ``END N``;
        ``AGAIN SERVER`` when its stream stopped for WAIT_S (default 2) and it is asked
        again, ``SILENT SERVER`` when it was asked ``ASKS`` times

SERVERS: ``tcp://A:P,tcp://B:P`` (one shard's pair), or ``control=tcp://H:P[,...]`` (the
whole cluster, through a supervisor's map). Prints ``READY`` once started.
"""
from __future__ import annotations

import signal
import sys
import time

from clonemap.client.api import ClonemapError, Clone


def main() -> int:
    mode, where = sys.argv[1], sys.argv[2]
    if mode == "dump":
        return dump(where, float(sys.argv[3]) if len(sys.argv) > 3 else 2.0)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    if where.startswith("control="):
        opened = Clone(control=where[len("control="):].split(","), timeout_s=30)
    else:
        opened = Clone(where.split(","), timeout_s=30, silence_timeout_s=0.6,
                       heartbeat_s=0.2)
    with opened as clone:
        print("READY", flush=True)
        if mode == "read":
            keys = clone.keys()
            for key in keys:
                print(key, clone.get(key).decode(), flush=True)
            print("END", len(keys), flush=True)
            return 0
        prefix = sys.argv[3]
        rate = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
        i = 0
        started = time.monotonic()
        while not stop:
            if rate:  # a steady load, as a user's writer: the i-th write not before i/rate
                ahead = started + i / rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            key = f"{prefix}{i}"
            try:
                clone.set(key, str(i).encode(), wait=True, timeout_s=2.0)
                print("ACK", key, flush=True)
            except ClonemapError as exc:
                print("FAIL", key, f"{type(exc).__name__}: {exc}", flush=True)
            i += 1
    return 0


ASKS = 3
"""How many times ``dump`` asks a server that stays silent."""


def dump(endpoints: str, wait_s: float) -> int:
    """Each server's map by a raw ICANHAZ, all asked at once. A server whose stream
    stops for ``wait_s`` is asked again on a new connection, as a client would (prints
    ``AGAIN SERVER``; the rows of a stream cut off are dropped). ``SILENT`` after
    ``ASKS`` tries. (A leased server once closed a slow reader's connection after 3
    heartbeats without a PONG, at every try: ``zio.patient_with_readers``.)"""

    import zmq

    ctx = zmq.Context.instance()
    poller = zmq.Poller()
    asked: dict = {}

    def ask(endpoint: str, tries: int) -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(endpoint)
        dealer.send_multipart([b"ICANHAZ?", b""])
        poller.register(dealer, zmq.POLLIN)
        asked[dealer] = [endpoint, [], time.monotonic(), tries]

    def drop(dealer) -> None:
        poller.unregister(dealer)
        dealer.close(0)
        del asked[dealer]

    for endpoint in endpoints.split(","):
        ask(endpoint, 1)
    while asked:
        now = time.monotonic()
        for dealer, (endpoint, asked_rows, heard, tries) in list(asked.items()):
            if now - heard < wait_s:
                continue
            drop(dealer)
            print(f"{time.strftime('%H:%M:%S')} {endpoint}: {len(asked_rows)} rows, "
                  f"then nothing for {wait_s} s "
                  f"(ask {tries})", file=sys.stderr, flush=True)
            if tries < ASKS:
                print("AGAIN", endpoint, flush=True)
                ask(endpoint, tries + 1)
            else:
                print("SILENT", endpoint, flush=True)
        for dealer, _ in poller.poll(1000):
            state = asked[dealer]
            state[2] = time.monotonic()  # (a large map takes its time)
            frames = dealer.recv_multipart()
            if frames[0] != b"KTHXBAI":
                state[1].append(f"{frames[0].decode()} {frames[4].decode()}")
                continue
            print(f"FROM {state[0]}", *state[1], f"END {len(state[1])}", sep="\n", flush=True)
            drop(dealer)
    return 0


if __name__ == "__main__":
    sys.exit(main())

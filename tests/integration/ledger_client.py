"""A real client for the partition tests, run as a process inside a network namespace.

    python ledger_client.py write SERVERS PREFIX   writes PREFIX0, PREFIX1, ... with
        wait=True, one at a time, until SIGTERM; prints ``ACK KEY`` for each acknowledged
        write and ``FAIL KEY ERROR`` for each that was not (the ledger)
    python ledger_client.py read SERVERS           a fresh client: prints ``KEY VALUE`` for
        every key of its complete copy, then ``END N``
    python ledger_client.py dump SERVER[,SERVER..] [WAIT_S]
        each server's whole map, by a raw ICANHAZ (whatever routing it follows), asked
        all at once: for each, ``FROM SERVER``, its ``KEY VALUE`` lines and ``END N``,
        or ``SILENT SERVER`` when it does not answer within WAIT_S (default 2)

SERVERS: ``tcp://A:P,tcp://B:P`` (one shard's pair), or ``control=tcp://H:P[,...]`` (the
whole cluster, through a supervisor's map). Prints ``READY`` once started.
"""
from __future__ import annotations

import signal
import sys

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
        i = 0
        while not stop:
            key = f"{prefix}{i}"
            try:
                clone.set(key, str(i).encode(), wait=True, timeout_s=2.0)
                print("ACK", key, flush=True)
            except ClonemapError as exc:
                print("FAIL", key, f"{type(exc).__name__}: {exc}", flush=True)
            i += 1
    return 0


def dump(endpoints: str, wait_s: float) -> int:
    import time

    import zmq

    ctx = zmq.Context.instance()
    poller = zmq.Poller()
    asked = {}
    for endpoint in endpoints.split(","):
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(endpoint)
        dealer.send_multipart([b"ICANHAZ?", b""])
        poller.register(dealer, zmq.POLLIN)
        asked[dealer] = (endpoint, [])
    deadline = time.monotonic() + wait_s
    while poller.sockets and time.monotonic() < deadline:
        for dealer, _ in poller.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            endpoint, rows = asked[dealer]
            frames = dealer.recv_multipart()
            if frames[0] != b"KTHXBAI":
                rows.append(f"{frames[0].decode()} {frames[4].decode()}")
                continue
            poller.unregister(dealer)
            print(f"FROM {endpoint}", *rows, f"END {len(rows)}", sep="\n", flush=True)
            deadline = time.monotonic() + wait_s  # (a large map takes its time)
    for dealer in dict(poller.sockets):
        print("SILENT", asked[dealer][0], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Work at background CPU priority for a while, as an added shard's servers copy
(``supervisor reshard --copy-priority idle``), with no resharding at all:
``python -m bench.harness.idle_load --seconds S --procs N --work spin|copy``.

Starts ``N`` processes, each in a session of its own (as the supervisor starts a
server), each going to the background the way a copying server does
(``cpu_priority.background``: every thread under ``SCHED_IDLE``; ``autogroup_nice``: its
session's CPU group at nice 19). Each then works for ``S`` seconds:

* ``spin``: a loop of integer additions (CPU only: what the best possible background
  copy, one that touched no memory, would cost the host's other work);
* ``copy``: builds dicts of 100-byte values, 50,000 keys at a time, and drops them (the
  allocation and the memory traffic of applying a copy).

Prints one JSON line: each process's work done and how it went to the background. Used
by ``python -m bench reshard --change floor``: what the writes wait while nothing but
such work shares the host."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

_CHILD = """
import json, sys, time
from clonemap.shards.common import cpu_priority
seconds, work = float(sys.argv[1]), sys.argv[2]
why = cpu_priority.background(True)
grouped = cpu_priority.own_autogroup() and not cpu_priority.autogroup_nice(19)
end = time.monotonic() + seconds
done = 0
if work == "spin":
    while time.monotonic() < end:
        for i in range(10_000):
            done += i
    done //= 49_995_000  # (turns)
else:
    value = bytes(100)
    while time.monotonic() < end:
        d = {b"/s%05d/k%06d" % (i % 1000, i): value[:99] + b"x" for i in range(50_000)}
        done += len(d)
        del d
print(json.dumps({"done": done, "idle": not why, "why": why, "autogroup_19": grouped}))
"""


def run(seconds: float, procs: int, work: str) -> list[dict]:
    """Runs the ``procs`` processes for ``seconds``; each one's result."""
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(seconds), work],
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
                for _ in range(procs)]
    out = []
    for child in children:
        stdout, _ = child.communicate(timeout=seconds + 60)
        if child.returncode != 0:
            raise RuntimeError(f"idle load process exited {child.returncode}")
        out.append(json.loads(stdout))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.harness.idle_load",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--work", choices=("spin", "copy"), default="spin")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.procs < 1:
        ap.error("--seconds and --procs must be positive")
    t0 = time.monotonic()
    got = run(args.seconds, args.procs, args.work)
    print(json.dumps({"work": args.work, "seconds": round(time.monotonic() - t0, 3),
                      "procs": got}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench``: run every benchmark, quick versions by default.

    python -m bench            # quick: ~1 minute (throughput 2 rounds x 2 s, snapshot 100k keys)
    python -m bench --full     # the figures the README quotes (1M-key snapshot included)
    python -m bench --smoke    # a few seconds, tiny sizes: checks that nothing rotted

Each benchmark prints its tables and saves a JSON record under ``--results-dir``
(default bench/results/, and bench/results/latest/<name>.json). The per-benchmark
commands are ``python -m bench.chp_throughput``, ``python -m bench.snapshot``,
``python -m bench.fanout`` and ``python -m bench.handoff``.
"""
from __future__ import annotations

import argparse

from bench import chp_throughput, fanout, handoff, snapshot
from bench import record as rec

PROFILES = {
    "smoke": {
        "chp_throughput": ["--seconds", "1", "--warmup", "0.3", "--rounds", "1",
                           "--keys", "2000", "--retries", "0"],
        "snapshot": ["--keys", "2000", "--repeats", "1"],
        "fanout": ["--shards", "1,2", "--subscribers", "1,4", "--rate", "200",
                   "--seconds", "0.5"],
        "handoff": ["--modes", "inline,thread", "--work", "cpu", "--rate", "300",
                    "--seconds", "0.5"],
    },
    "quick": {
        "chp_throughput": ["--seconds", "2", "--warmup", "0.5", "--rounds", "2"],
        "snapshot": ["--keys", "100000", "--repeats", "2"],
        "fanout": ["--shards", "1,4", "--subscribers", "1,4,16", "--rate", "1000",
                   "--seconds", "3"],
        "handoff": ["--rate", "40000", "--seconds", "2"],
    },
    "full": {
        "chp_throughput": ["--seconds", "5", "--warmup", "1", "--rounds", "5",
                           "--blind-ceiling", "--quiet-wait-s", "60"],
        "snapshot": ["--keys", "10000,100000,1000000", "--repeats", "3",
                     "--quiet-wait-s", "60"],
        "fanout": ["--shards", "1,4", "--subscribers", "1,4,16", "--rate", "1000",
                   "--seconds", "5"],
        "handoff": ["--rate", "40000", "--seconds", "3"],
    },
}
BENCHMARKS = {"chp_throughput": chp_throughput.main, "snapshot": snapshot.main,
              "fanout": fanout.main, "handoff": handoff.main}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the full versions")
    size.add_argument("--smoke", action="store_true", help="tiny versions (seconds)")
    ap.add_argument("--only", choices=sorted(BENCHMARKS), action="append",
                    help="run only this benchmark (repeatable)")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    profile = PROFILES["full" if args.full else "smoke" if args.smoke else "quick"]
    for name in args.only or list(BENCHMARKS):
        BENCHMARKS[name]([*profile[name], "--results-dir", args.results_dir])


if __name__ == "__main__":
    main()

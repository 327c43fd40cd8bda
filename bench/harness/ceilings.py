"""The ceilings every scenario compares against, measured in the same run as the scenario.

* ``pubsub``: bare pyzmq PUB->SUB of the same 5-frame message shape, nothing in between:
  each writer process binds its XPUB and the subscriber process connects to every
  writer. There is no sequencer, so each writer numbers what it sends in the sequence
  frame and the subscriber checks those numbers (one sequence per writer socket).
* ``forwarder``: bench/harness/forwarder.py, a bare blocking SUB -> dict -> PUB loop, fed and
  counted by the same writers and subscriber (bench.harness.traffic) as the server.

Both use the harness writers exactly as a scenario does: flat out (``rate_per_s=0``,
``flow``: a full pipe blocks the writer) or open loop at ``rate_per_s`` updates/s *in
total* (split evenly over the writers; latency counts from each update's intended send
time). Each kind costs ``warmup + seconds`` plus ~1-2 s of process start-up.

    from bench.harness.ceilings import measure_ceilings
    ceilings = measure_ceilings(seconds=2, kinds=("pubsub", "forwarder"))
    ratio = server_rate / ceilings["forwarder"]["received_per_s"]

``python -m bench.harness.ceilings [--seconds 2] [--rate 0]`` prints them (no record).
"""
from __future__ import annotations

from bench.harness import record as rec
from bench.harness.offer import Offer, Targets, brief, run_offer

KINDS = ("pubsub", "forwarder")
OPTIONAL_KINDS = ("plain",)
"""``plain``: the plain five-receive loop (``forwarder --blind``): asked for by name."""


def ceiling_target(kind: str) -> tuple[str, tuple[str, ...]]:
    """The ``Targets`` kind and extra arguments of a ceiling: ``plain`` is the forwarding
    loop reading five frames blindly; the others are themselves."""
    return ("forwarder", ("--blind",)) if kind == "plain" else (kind, ())


FIGURE_KEYS = ("received_per_s", "sent_per_s", "sequenced_per_s", "loss_window",
               "writer_drops", "latency_ms", "cpu_pct", "cpu_cores", "window_s")


def measure_ceilings(*, seconds: float = 2.0, warmup: float = 0.5, keys: int = 100_000,
                     value_bytes: int = 100, writers: int = 1, rate_per_s: float = 0.0,
                     pin: bool = False, kinds=KINDS,
                     progress: "rec.Progress | None" = None,
                     latency_every: int = 64) -> dict:
    """Measure the bare ceilings now (same run as the caller's scenario).

    Returns ``{"pubsub": FIG, "forwarder": FIG, "config": {...}}`` (the kinds asked for)
    where FIG is ``{"received_per_s", "sent_per_s", "sequenced_per_s", "loss_window",
    "writer_drops", "latency_ms": {"p50", "p90", "p99", "p99.9", "max"}, "cpu_pct":
    {"targets", "writers", "subscribers", "ours", "host", "others"}, "cpu_cores",
    "window_s"}``. ``rate_per_s`` = 0: flat out (flow); > 0: open loop at that total
    rate. With ``progress``, each kind is one step of it (count them in its total).
    """
    unknown = set(kinds) - set(KINDS) - set(OPTIONAL_KINDS)
    if unknown:
        raise ValueError(f"unknown ceiling kinds {sorted(unknown)}; known: "
                         f"{KINDS + OPTIONAL_KINDS}")
    offer = Offer(writers=writers, subscribers=1, keys=keys, value_bytes=value_bytes,
                  rate_per_s=rate_per_s / writers if rate_per_s else 0.0, pin=pin,
                  latency_every=latency_every)
    out: dict = {"config": {"seconds": seconds, "warmup": warmup, "keys": keys,
                            "value_bytes": value_bytes, "writers": writers,
                            "rate_per_s": rate_per_s, "pin": pin,
                            "writer_mode": offer.writer_mode, "kinds": list(kinds)}}
    for kind in kinds:
        if progress is not None:
            progress.step(f"ceiling {kind}" + (f" at {rate_per_s:,.0f}/s" if rate_per_s
                                               else " flat out"))
        target, extra = ceiling_target(kind)
        with Targets(target, 1, offer=offer, extra=extra) as targets:
            fig = run_offer(targets, warmup=warmup, seconds=seconds, progress=progress)
        out[kind] = {k: fig[k] for k in FIGURE_KEYS}
        if progress is not None:
            progress.note(f"ceiling {kind}: {brief(fig)}")
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.harness.ceilings",
                                 description="measure the bare PUB->SUB and forwarding-loop "
                                             "ceilings now and print them (~2x(warmup+seconds)"
                                             " + 3 s)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--writers", type=int, default=1)
    ap.add_argument("--rate", type=float, default=0.0, help="total updates/s (0: flat out)")
    ap.add_argument("--pin", action="store_true")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.writers < 1 or args.rate < 0:
        ap.error("--seconds must be > 0, --writers >= 1, --rate >= 0")
    with rec.Progress("ceilings", total=len(KINDS)) as progress:
        c = measure_ceilings(seconds=args.seconds, warmup=args.warmup, keys=args.keys,
                             value_bytes=args.value_bytes, writers=args.writers,
                             rate_per_s=args.rate, pin=args.pin, progress=progress)
    rows = [[k, c[k]["received_per_s"], c[k]["sent_per_s"], c[k]["loss_window"],
             c[k]["latency_ms"].get("p50", "-"), c[k]["latency_ms"].get("p99", "-"),
             c[k]["cpu_cores"]] for k in KINDS]
    rec.print_table("ceilings", ["kind", "received/s", "sent/s", "lost", "p50 ms", "p99 ms",
                                 "cpu cores"], rows)


if __name__ == "__main__":
    main()

"""Worker processes for a watch: the Black Box pattern on the client side.

A watch callback runs in the client's process, so an application whose work per update
is more than one core can do is capped by that one core (the GIL included). ``Workers``
opens a watch and hands its changes to N worker processes:

    from clonemap.client.api import Clone
    from clonemap.client.workers import Workers

    with Clone(config="configs/4shard.yaml") as clone:
        with Workers(clone, "/orders/", "myapp.orders:setup", workers=4) as pool:
            ...                       # pool.stats(), pool.wait_idle(), pool.error

* **Routed by key.** A change goes to worker ``crc32(key) mod N``: every change of one key
  reaches the same worker, in the order the client applied them. Markers (``synced``,
  ``reset``) go to every worker, in their place among the changes. A ``reset``'s
  ``value`` (the ``ResetInfo``) stays in this process (``pool.resets``); workers see
  ``value=None``.
* **Set up once per worker.** ``setup`` ("module:function", or a function importable by
  name) is called in each worker process with ``args``; it returns the function that is
  then called with each ``clonemap.client.watch.Change``. Values are decoded there, with the
  client's codec, so decoding costs the workers, not the client. A handler that raises
  is logged and counted (``errors``); the worker goes on.
* **Bounded, never skipping.** Changes travel in batches of at most ``batch`` changes
  (or ``batch_bytes``) over one ZeroMQ PUSH/PULL pipe per worker (ipc, in a private
  temporary directory), each end holding at most ``queue_batches`` batches. A worker that
  falls behind blocks the hand-off, the watch's own queue (``capacity`` entries) fills,
  and the watch fails by the rules of any watch: ``SlowConsumer`` with the counts, in
  ``pool.error`` and to ``on_error``. Memory is therefore bounded by the watch's
  capacity plus, per worker, 2 x ``queue_batches`` x ``batch_bytes``.
* **Ended by PID.** ``close()`` (or leaving the ``with``) lets each worker finish what it
  holds (up to ``stop_timeout_s``), then ends it: SIGTERM, then SIGKILL.
* **Never outliving the caller.** Each worker reads a pipe whose other end only the
  caller's process holds (its lifeline): when that process is gone (killed, crashed,
  or an interpreter that ended without ``close()``), the pipe's end of file ends the
  worker at once. Before, such a worker waited on its ZeroMQ pipe for ever. A pipe, not
  ``PR_SET_PDEATHSIG``: Linux sends that when the *thread* that started the worker
  ends, and a pool may be made by a thread that ends before it. A child the caller forks
  without exec (``os.fork``, ``multiprocessing``'s fork) closes its copies of the write
  ends at once (``Workers.forget_lifelines_after_fork``): until 2026-12-01 such a child
  kept every worker alive after the caller was killed, for as long as it lived itself.

Why processes and not threads: a Python callback holds the GIL, so threads add no
cores. Each worker is a fresh interpreter (``python -m clonemap.client.workers``, its parameters
pickled on stdin, READY on a pipe of its own, its stdout and stderr the caller's), not
``multiprocessing``'s spawn, which re-runs the caller's ``__main__``: a plain script with
no ``if __name__ == "__main__"`` guard works. Why ZeroMQ pipes: bounded queues with
back-pressure, the same library as the rest of the client, and one batch = one message.
"""
from __future__ import annotations

import importlib
import logging
import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
import zlib
from typing import IO, TYPE_CHECKING, Any, Callable

import msgpack
import zmq

from clonemap.client.watch import DELETE, PUT, RESET, SYNCED, Change
from clonemap.client.codec import Codec
from clonemap.client.watch import RawChange
from clonemap.shards.common.errors import SlowConsumer, Timeout

if TYPE_CHECKING:
    from clonemap.client.sync import Clone

Setup = Callable[..., Callable[[Change], Any]]
"""A worker's setup: called once in the worker with ``args``, returns the handler."""
Item = tuple[str, str, Any, int, str]
"""A change as it travels to a worker: (kind, key, value bytes or None, seq, shard)."""

log = logging.getLogger(__name__)

BATCH = 256
BATCH_BYTES = 256 * 1024
QUEUE_BATCHES = 16
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.1
_STOP = b""


def printer(label: str = "worker") -> Callable[[Change], None]:
    """A setup to try ``Workers`` with: print each change, with this worker's PID."""
    pid = os.getpid()

    def handle(change: Change) -> None:
        print(f"{label} {pid}: {change.kind} {change.key} {change.value!r}", flush=True)
    return handle


def _resolve(setup: str | Setup) -> Setup:
    if callable(setup):
        return setup
    module, sep, name = setup.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"setup {setup!r}: give 'module:function'")
    found: Setup = getattr(importlib.import_module(module), name)
    return found


def _reference(setup: str | Setup) -> str:
    """What a worker process imports: 'module:function' (checked here, at once)."""
    if isinstance(setup, str):
        _resolve(setup)
        return setup
    module, name = getattr(setup, "__module__", None), getattr(setup, "__qualname__", "")
    if not module or "<" in name or module == "__main__":
        raise ValueError(f"setup {setup!r}: a worker process imports it by name; give a "
                         "module-level function (or 'module:function'), not a lambda, a "
                         "closure or a function of __main__")
    return f"{module}:{name}"


def worker_main(index: int, setup: str, args: tuple[Any, ...], codec: Codec, endpoint: str,
                report: str, queue_batches: int, out: IO[str]) -> None:
    """A worker process: set up, print READY (or ERROR and why) on ``out``, then handle
    batches until the stop message; after each batch, report (index, changes handled,
    errors, monotonic ns)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.rcvhwm = queue_batches
    pull.linger = 0
    push = ctx.socket(zmq.PUSH)
    push.linger = 1000
    try:
        handler = _resolve(setup)(*args)
        pull.connect(endpoint)
        push.connect(report)
        print(f"READY {os.getpid()}", file=out, flush=True)
        out.close()
    except Exception as exc:  # noqa: BLE001 - told to the parent, which raises it
        print(f"ERROR worker {index}: setup {setup!r} failed: {exc!r}", file=out,
              flush=True)
        return
    handled = errors = 0
    decode = codec.decode
    try:
        while True:
            msg = pull.recv()
            if msg == _STOP:
                break
            for kind, key, value, seq, shard in msgpack.unpackb(msg, raw=False):
                if kind == PUT:
                    change = Change(PUT, key, decode(value), seq, shard)
                elif kind == DELETE:
                    change = Change(DELETE, key, None, seq, shard)
                else:
                    change = Change(kind, key, None, seq, shard)
                try:
                    handler(change)
                except Exception:  # noqa: BLE001 - logged and counted; the worker goes on
                    errors += 1
                    log.exception("worker %d: handler failed on %s %r", index, kind, key)
                if kind in (PUT, DELETE):
                    handled += 1
            push.send(msgpack.packb([index, handled, errors, time.monotonic_ns()]))
    except KeyboardInterrupt:
        pass
    finally:
        pull.close(0)
        push.close()
        ctx.term()


class Workers:
    """N worker processes fed by one watch of ``clone`` (a ``clonemap.client.api.Clone``) under
    ``prefix``; see the module doc."""

    pools: "weakref.WeakSet[Workers]" = weakref.WeakSet()
    """Every pool of this process that is alive (``forget_lifelines_after_fork``)."""

    def __init__(self, clone: "Clone", prefix: str = "", setup: str | Setup = "", *,
                 workers: int = 4, args: tuple[Any, ...] = (), batch: int = BATCH,
                 batch_bytes: int = BATCH_BYTES, queue_batches: int = QUEUE_BATCHES,
                 capacity: int | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S,
                 stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        if workers < 1 or batch < 1 or batch_bytes < 1 or queue_batches < 1:
            raise ValueError("workers, batch, batch_bytes and queue_batches must be >= 1")
        self.setup = _reference(setup)
        self.n = workers
        self.batch, self.batch_bytes = batch, batch_bytes
        self.on_error = on_error
        self.stop_timeout_s = stop_timeout_s
        self.error: BaseException | None = None
        self.resets: list[Any] = []
        """Each ``ResetInfo`` the watch carried (a shard that lost data)."""
        self.handed = [0] * workers      # put/delete changes handed to each worker
        self.handled = [0] * workers     # ... and handled there (its reports)
        self.errors = [0] * workers
        self.last_ns = [0] * workers     # when each worker last reported
        self._routed = 0                 # watch entries taken and handed on (markers too)
        self._dir = tempfile.mkdtemp(prefix="clonemap-workers-")
        self._ctx = zmq.Context()
        self._pushes: list[zmq.Socket[bytes]] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lifelines: list[int] = []
        """The write end of each worker's lifeline (closed once the workers ended)."""
        Workers.pools.add(self)
        self._ready: list[IO[bytes]] = []
        """Each worker's READY pipe (its stdout stays the caller's)."""
        self._stopping = threading.Event()
        self._cv = threading.Condition()
        codec = clone.codec
        report = f"ipc://{self._dir}/report"
        self._report = self._ctx.socket(zmq.PULL)
        self._report.linger = 0
        self._report.bind(report)
        # a fresh interpreter per worker (not multiprocessing's spawn, which re-runs the
        # caller's __main__ and fails in a script without a __main__ guard); it sees the
        # caller's import path, so a setup importable here is importable there
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            for i in range(workers):
                endpoint = f"ipc://{self._dir}/w{i}"
                push = self._ctx.socket(zmq.PUSH)
                push.sndhwm = queue_batches
                push.linger = 0
                push.sndtimeo = int(POLL_S * 1000)
                push.bind(endpoint)
                self._pushes.append(push)
                # READY comes back on a pipe of its own: the worker's stdout stays the
                # caller's, for whatever its handler prints
                ready_r, ready_w = os.pipe()
                life_r, life_w = os.pipe()  # (its write end stays in this process only)
                self._lifelines.append(life_w)
                try:
                    proc = subprocess.Popen([sys.executable, "-m", "clonemap.client.workers"],
                                            stdin=subprocess.PIPE, env=env,
                                            pass_fds=(ready_w, life_r))
                finally:
                    os.close(ready_w)
                    os.close(life_r)
                self._ready.append(os.fdopen(ready_r, "rb"))
                self._procs.append(proc)
                assert proc.stdin is not None  # stdin=PIPE
                proc.stdin.write(pickle.dumps((i, self.setup, tuple(args), codec, endpoint,
                                               report, queue_batches, ready_w, life_r)))
                proc.stdin.close()
            deadline = time.monotonic() + start_timeout_s
            for i, (proc, ready) in enumerate(zip(self._procs, self._ready)):
                line = _line_by(ready, deadline)
                if line is None:
                    raise Timeout(f"worker {i} not ready within {start_timeout_s} s",
                                  what="worker", deadline_s=start_timeout_s)
                if not line.startswith("READY"):
                    raise RuntimeError(line.removeprefix("ERROR ") or
                                       f"worker {i} exited with {proc.poll()}")
            self._watch = clone.watch(prefix, capacity=capacity)
        except BaseException:
            self._end_processes(0.0)
            self._cleanup()
            raise
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"clonemap-workers {prefix!r}")
        self._thread.start()

    # ------------------------------------------------------------------ hand-off
    def worker_of(self, key: bytes) -> int:
        return zlib.crc32(key) % self.n

    def _run(self) -> None:
        n = self.n
        worker_of = self.worker_of
        try:
            while not self._stopping.is_set():
                raws = self._watch.get_raw(self.batch * n, POLL_S)
                self._read_reports()
                if not raws:
                    continue
                per: list[list[Item]] = [[] for _ in range(n)]
                sizes = [0] * n
                for kind, key, value, seq, shard in raws:
                    if kind == SYNCED or kind == RESET:
                        if kind == RESET:
                            self.resets.append(value)
                        for i in range(n):
                            per[i].append((kind, key.decode(), None, seq, shard))
                        continue
                    i = worker_of(key)
                    per[i].append((kind, key.decode(), value, seq, shard))
                    sizes[i] += len(key) + len(value) + 16
                    self.handed[i] += 1
                    if len(per[i]) >= self.batch or sizes[i] >= self.batch_bytes:
                        self._send(i, per[i])
                        per[i], sizes[i] = [], 0
                for i in range(n):
                    if per[i]:
                        self._send(i, per[i])
                self._routed += len(raws)
        except SlowConsumer as exc:
            self._fail(exc)
        except _Stopped:
            pass
        except Exception as exc:  # noqa: BLE001 - kept and told, never silent
            log.exception("workers: the hand-off failed")
            self._fail(exc)

    def _send(self, i: int, items: list[Item]) -> None:
        """One batch to worker ``i``; blocks while its pipe is full (back-pressure)."""
        msg = msgpack.packb(items, use_bin_type=True)
        push = self._pushes[i]
        while True:
            try:
                push.send(msg)
                return
            except zmq.Again:
                self._read_reports()
                if self._stopping.is_set():
                    raise _Stopped() from None
                proc = self._procs[i]
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {i} (pid {proc.pid}) exited with "
                                       f"{proc.returncode}") from None

    def _read_reports(self) -> None:
        got = False
        while True:
            try:
                msg = self._report.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            i, handled, errors, last_ns = msgpack.unpackb(msg)
            self.handled[i], self.errors[i], self.last_ns[i] = handled, errors, last_ns
            got = True
        if got:
            with self._cv:
                self._cv.notify_all()

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        if self.on_error is not None:
            self.on_error(exc)
        else:
            log.error("workers: %s", exc)
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ the caller's side
    def stats(self) -> dict[str, Any]:
        return {"workers": self.n, "handed": list(self.handed),
                "handled": list(self.handled), "errors": list(self.errors),
                "last_ns": list(self.last_ns), "pids": self.pids,
                "watch_delivered": self._watch.delivered,
                "error": str(self.error) if self.error else None}

    @property
    def synced(self) -> bool:
        """The watch has delivered its ``synced`` marker (the map as it was, then live)."""
        return self._watch.synced

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def wait_idle(self, timeout_s: float) -> bool:
        """Until every change handed so far has been handled (True), or ``timeout_s``
        (False). Raises the hand-off's error if it failed."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                if self.error is not None:
                    raise self.error
                # the watch counts an entry as delivered when the hand-off takes it, so
                # one taken but not yet routed keeps delivered ahead of _routed
                if (self.handled == self.handed and self._watch.delivered == self._routed
                        and not self._watch.has_pending()):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(min(remaining, POLL_S))

    def close(self) -> None:
        """Stop handing off, let each worker finish what it holds (``stop_timeout_s``),
        end the processes by PID, remove the pipes."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._thread.join(self.stop_timeout_s)
        self._watch.close()
        deadline = time.monotonic() + self.stop_timeout_s
        unsent = list(range(self.n))
        while unsent and time.monotonic() < deadline:
            for i in list(unsent):   # after what each one holds (blocks while it is full)
                try:
                    self._pushes[i].send(_STOP)
                    unsent.remove(i)
                except zmq.Again:
                    if self._procs[i].poll() is not None:
                        unsent.remove(i)
        self._end_processes(max(0.0, deadline - time.monotonic()))
        self._read_reports()
        self._cleanup()

    def _end_processes(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self._procs:
            for end in (proc.terminate, proc.kill):
                if proc.poll() is None:
                    end()
                    try:
                        proc.wait(3)
                    except subprocess.TimeoutExpired:
                        pass
        for ready in self._ready:
            ready.close()
        for fd in self._lifelines:
            os.close(fd)
        self._lifelines.clear()

    def _cleanup(self) -> None:
        for sock in (*self._pushes, self._report):
            sock.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def forget_lifelines_after_fork(self) -> None:
        """Called in a child forked from the caller without exec (``os.register_at_fork``,
        for every pool): close the child's copies of this pool's lifeline write ends, and
        forget them (a ``close()`` of the pool there must not close those numbers again:
        by then they may be other files). The caller's own ends are untouched: its
        workers still end with it."""
        for fd in self._lifelines:
            try:
                os.close(fd)
            except OSError:
                pass
        self._lifelines = []

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Stopped(Exception):
    """The hand-off was closed while a worker's pipe was full."""


def _line_by(ready: IO[bytes], deadline: float) -> str | None:
    """The worker's first line on its READY pipe ("" if it exited first), None at the
    deadline."""
    readable, _, _ = select.select([ready], [], [], max(0.0, deadline - time.monotonic()))
    if not readable:
        return None
    return ready.readline().decode("utf-8", "replace").strip()


def _forget_lifelines_after_fork() -> None:
    for pool in list(Workers.pools):
        pool.forget_lifelines_after_fork()


os.register_at_fork(after_in_child=_forget_lifelines_after_fork)


def _end_with_caller(lifeline: int, index: int) -> None:
    """Wait for the end of file on ``lifeline``: the caller's process is gone (its
    ``close()`` ends the workers first, by PID). Nobody is left to hand this worker a
    change or to read its counts: it exits at once."""
    while True:
        try:
            if not os.read(lifeline, 1):
                break
        except InterruptedError:
            continue
    log.warning("worker %d: the process that started it is gone; exiting", index)
    logging.shutdown()
    os._exit(1)


def _main() -> None:
    """``python -m clonemap.client.workers``: one worker; its parameters pickled on stdin."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    (index, setup, args, codec, endpoint, report, queue_batches,
     ready_fd, lifeline) = pickle.loads(sys.stdin.buffer.read())
    threading.Thread(target=_end_with_caller, args=(lifeline, index), daemon=True,
                     name="clonemap-worker lifeline").start()
    with os.fdopen(ready_fd, "w") as out:
        worker_main(index, setup, args, codec, endpoint, report, queue_batches, out)


if __name__ == "__main__":
    _main()


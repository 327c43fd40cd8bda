"""``supervisor start CONFIG``: validate and place, host the MDP broker on the control
endpoint, start every server (a primary and a backup per shard), keep them alive, and
stop everything on Ctrl-C / SIGTERM / ``supervisor stop``.

    supervisor start CONFIG [--detach] [--run-dir DIR] [--demo-load] [--table/--no-table]

Foreground: a live status table when stdout is a terminal (``--no-table``: one line per
event instead). A shard with no ACTIVE server after ``--ready-timeout-s`` is named in an
``UNSERVED <shard>: ...`` line (its servers' states, and why), followed by
``NOT_READY supervisor ...`` instead of READY (the supervisor runs on; a detached start
then exits 1 with those lines on stderr). Once every shard has an ACTIVE server it prints
``READY supervisor cluster=C control=EP pid=N servers=8 running=8 active_shards=4/4 ...``
(a detached start prints it too, then returns); above the live table it prints a short
``READY C: 8/8 servers running, 4/4 shards active; run dir D`` instead (the long line goes
to the log). The run directory (default ``./run/<cluster>``; ``./run/<cluster>-demo`` with
``--demo-load``) holds ``supervisor.pid``, ``supervisor.log`` and
``logs/<shard>-<role>.log``.

Exit codes: 0 after a clean stop, 2 a config that does not fit (or a port taken at the
check), 3 the control or metrics port in use, or this cluster already running (one
line: "cluster C is already running (pid N, control EP)"), 1 anything else.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import click

from clonemap.shards.common.errors import ConfigError, PortInUse
from clonemap.shards.common.config import load_config
from clonemap.shards.common.rights import ENFORCED
from clonemap.shards.common.security import Security, check_keys_present
from clonemap.shards.common.hostfacts import local_host_facts
from clonemap.shards.common.memory import return_large_frees
from clonemap.shards.common.placement import Plan, check_ports_free, plan
from clonemap.supervisor import routing_state
from clonemap.supervisor.running import running_cluster
from clonemap.supervisor.policy import (BACKOFF_CAP_S, BACKOFF_INITIAL_S, CRASH_LIMIT, CRASH_WINDOW_S,
                               PolicyConfig)

RIGHTS_FILE = "rights.json"
"""In the run directory: every identity's rights, as servers and relays load them
(``--rights``; ``clonemap.shards.gate``)."""

log = logging.getLogger("clonemap.supervisor")

DETACH_READY_TIMEOUT_S = 60.0
DEMO_SUFFIX = "-demo"
"""``--demo-load`` without ``--run-dir`` runs in ``run/<cluster>-demo``: the demo's keys
(``/demo-N/k``) and their data stay out of the cluster a user starts later."""
ACTIVE_POLL_S = 0.1
EVENTS_KEPT = 50
"""Recent events the live view keeps; it shows as many as fit the terminal."""
LIVE_FIXED_LINES = 3
"""Lines of the live view besides the table and the events: the READY line above it, the
hint below it, and one spare line (a view as tall as the terminal scrolls it)."""
"""How often READY's wait for an ACTIVE server per shard asks the servers again."""
_LOG_FORMAT = "%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s"


def _fail(exc: Exception, code: int) -> None:
    for line in str(exc).splitlines():
        click.echo(f"error: {line}", err=True)
    raise SystemExit(code)


def _short_path(path: Path) -> str:
    """``path`` relative to the working directory when it is below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _connect_endpoint(control: str) -> str:
    return control.replace("tcp://*:", "tcp://127.0.0.1:")


# ===================================================================== detach

def unserved_lines(rows: list[dict], shards: list[str]) -> list[str]:
    """For each shard with no ACTIVE server: its servers' states, and why (a disk error,
    FAILED's reason, a Binary Star state waiting for its peer)."""
    out = []
    for shard in shards:
        parts = []
        for row in (r for r in rows if r.get("shard") == shard):
            why = row.get("disk_error") and f"disk error: {row['disk_error']}" or \
                (row.get("state") != "RUNNING" and row.get("reason")) or \
                (row.get("bstar") and f"Binary Star {row['bstar']}") or "no stats yet"
            parts.append(f"{row.get('role')} {row.get('state')} ({why})")
        out.append(f"{shard}: no ACTIVE server: " + "; ".join(parts))
    return out


def control_hint(config: str) -> str:
    """How to name this cluster in a control command: its config's absolute path (a
    CONFIG finds the control endpoint and, for a CURVE cluster, its keys, which
    ``--control`` alone would not), so the line works from any directory."""
    return shlex.quote(str(Path(config).resolve()))


def _detach(argv: list[str], run_dir: Path, config: str) -> int:
    """Re-run this command in a new session with stdout on a pipe until READY, stderr
    (then stdout too) on RUN_DIR/supervisor.log. Returns an exit code."""
    log_path = run_dir / "supervisor.log"
    with open(log_path, "ab") as log_file:
        child = subprocess.Popen(
            [sys.executable, "-m", "clonemap.supervisor", *argv, "--detached-child"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file,
            start_new_session=True, close_fds=True)
    deadline = time.monotonic() + DETACH_READY_TIMEOUT_S
    unserved: list[str] = []
    for raw in iter(child.stdout.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.startswith("UNSERVED "):
            unserved.append(line.removeprefix("UNSERVED "))
            continue
        if line.startswith("NOT_READY "):
            click.echo(line)
            for why in unserved:
                click.echo(f"error: not served: {why}", err=True)
            click.echo(f"error: the supervisor runs on in the background (pid {child.pid}; "
                       f"logs in {run_dir}) and keeps restarting what failed; see "
                       f"`supervisor status {control_hint(config)}`, or stop it with: "
                       f"supervisor stop {control_hint(config)}", err=True)
            child.stdout.close()
            return 1
        if line.startswith("READY "):
            click.echo(line)
            click.echo(f"supervisor running in the background: pid {child.pid}; logs in "
                       f"{run_dir}; stop it with: supervisor stop {control_hint(config)}")
            child.stdout.close()
            return 0
        if time.monotonic() > deadline:
            break
    child.stdout.close()
    try:
        code = child.wait(5)
    except subprocess.TimeoutExpired:
        child.kill()
        code = child.wait()
    click.echo(f"error: the detached supervisor did not start (exit {code}); the end of "
               f"{log_path}:", err=True)
    try:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
    except OSError:
        tail = []
    for line in tail:
        click.echo(f"  {line}", err=True)
    return code or 1


# ===================================================================== the supervisor

class Supervisor:
    def __init__(self, the_plan: Plan, run_dir: Path, *, table: bool, demo_load: bool,
                 detached: bool, ready_timeout_s: float, policy: PolicyConfig,
                 log_max_bytes: int, config_path: str = "CONFIG",
                 host_name: str | None = None):
        self.plan = the_plan
        self.host_name = host_name
        """``--host``: this supervisor's host in a config over several hosts."""
        self.config_path = config_path
        self.log_max_bytes = log_max_bytes
        self.policy = policy
        self.run_dir = run_dir
        self.table = table
        self.demo_load = demo_load
        self.detached = detached
        self.ready_timeout_s = ready_timeout_s
        self.events: deque[str] = deque(maxlen=EVENTS_KEPT)
        self.stop = asyncio.Event()

    def on_event(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.events.append(f"{stamp} {text}")
        if not self.table:
            print(f"EVENT {text}", flush=True)

    async def run(self) -> int:
        import zmq

        from clonemap.shards.common.mdp.broker import Broker
        from clonemap.shards.common.mdp.broker_config import budget_config
        from clonemap.supervisor.health import ClusterHealth
        from clonemap.supervisor.metrics import MetricsServer
        from clonemap.supervisor.services import ControlServices, StatsPoller
        from clonemap.supervisor.runner import Runner, ServerArgs

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self.stop.set)
        the_plan = self.plan
        if the_plan.access.identities:
            log.info("%s", ENFORCED)
        control = _connect_endpoint(the_plan.control)
        ctx = zmq.Context()
        security = (Security.load(the_plan.keys_dir, "server") if the_plan.curve
                    else Security.off())
        broker = Broker([the_plan.control], budget_config(*the_plan.control_limits), ctx=ctx,
                        security=security)
        extra: tuple[str, ...] = ("--keys-dir", the_plan.keys_dir) if the_plan.curve else ()
        rights_path = None
        if the_plan.access.identities:  # every server and relay enforces them
            from clonemap.shards.gate import write_rights

            self.run_dir.mkdir(parents=True, exist_ok=True)
            rights_path = str(write_rights(self.run_dir / RIGHTS_FILE, the_plan.access))
            extra += ("--rights", rights_path)
        runner = Runner(the_plan, self.run_dir,
                        ServerArgs(control=control, heartbeat_s=the_plan.heartbeat_s,
                                   parent_pid=os.getpid(), extra=extra),
                        policy=self.policy, on_event=self.on_event,
                        log_max_bytes=self.log_max_bytes)
        health = ClusterHealth([sh.name for sh in the_plan.shards], on_event=self.on_event)
        poller = StatsPoller(runner, control, ctx, security=security, health=health)
        from clonemap.supervisor.resharding import Resharding

        resharding = Resharding(the_plan, runner, self.run_dir, control, ctx, security,
                                on_changed=lambda plan: None,
                                load_plan=lambda path: plan(load_config(path),
                                                            local_host_facts(), source=path,
                                                            host=self.host_name))
        resharding.config_path = str(Path(self.config_path).resolve())
        ControlServices(the_plan, runner, self.stop, poller=poller, health=health,
                        config_path=str(Path(self.config_path).resolve()),
                        rights_path=rights_path, broker=broker,
                        resharding=resharding).register(broker)
        metrics = None
        if the_plan.metrics is not None:
            metrics = MetricsServer(the_plan.metrics, loop,
                                    self._metrics_snapshot(runner, health, broker,
                                                           resharding))
        tasks: list[asyncio.Task] = []
        pid_file = self.run_dir / "supervisor.pid"
        try:
            try:
                await broker.start()
            except PortInUse as exc:
                click.echo(f"error: control endpoint: {exc}", err=True)
                return exc.exit_code
            if metrics is not None:
                try:
                    metrics.start()
                except OSError as exc:
                    click.echo(f"error: metrics {metrics.url}: {exc.strerror or exc}; pick "
                               "another port (metrics: HOST:PORT) or turn it off "
                               "(metrics: off)", err=True)
                    return PortInUse.exit_code
                log.info("metrics on %s", metrics.url)
            pid_file.write_text(f"{os.getpid()}\n")
            tasks.append(loop.create_task(poller.run()))
            # every host serves etcd's routing; on one host, a server left on an older
            # routing than the supervisor's is given it
            tasks.append(loop.create_task(resharding.follow()))
            starting = loop.create_task(runner.start_all(self.ready_timeout_s))
            stopping = loop.create_task(self.stop.wait())
            await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not starting.done():  # a signal or cluster.stop while starting
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
                await runner.stop_all()
                print(f"STOPPED supervisor cluster={the_plan.cluster} pid={os.getpid()} "
                      "(before every server was ready)", flush=True)
                return 0
            missing = starting.result()
            running = len(runner.servers) - len(missing)
            if missing:
                log.warning("not running after %g s: %s", self.ready_timeout_s,
                            ", ".join(missing))
            without = await self._wait_for_actives(runner, poller)
            if without:
                log.warning("no ACTIVE server after %g s in: %s", self.ready_timeout_s,
                            ", ".join(without))
            active = len(the_plan.shards) - len(without)
            word = "NOT_READY" if without else "READY"
            ready = (f"{word} supervisor cluster={the_plan.cluster} control={the_plan.control} "
                     f"pid={os.getpid()} servers={len(runner.servers)} running={running} "
                     f"active_shards={active}/{len(the_plan.shards)} run_dir={self.run_dir}"
                     + (f" metrics={metrics.url}" if metrics is not None else ""))
            if without:  # which shard is not served, and why, one line each
                for line in unserved_lines(runner.describe(), without):
                    print(f"UNSERVED {line}", flush=True)
                    log.warning("not served after %g s: %s", self.ready_timeout_s, line)
            if self.table:  # the full line to the log; one that fits 80 columns on screen
                log.info("%s", ready)
                print(f"{word} {the_plan.cluster}: {running}/{len(runner.servers)} servers "
                      f"running, {active}/{len(the_plan.shards)} shards active; run dir "
                      f"{_short_path(self.run_dir)}", flush=True)
            else:
                print(ready, flush=True)
            if self.detached:  # from now on stdout goes to the log as well
                os.dup2(2, 1)
            if self.demo_load:
                from clonemap.supervisor.demo_load import DemoLoad

                tasks.append(loop.create_task(DemoLoad(the_plan, ctx,
                                                       security=security).run()))
                self.on_event(f"demo load: writing /demo-N/k keys; its data stays in "
                              f"{_short_path(self.run_dir)}")
            if self.table:
                tasks.append(loop.create_task(self._live(runner)))
            await self.stop.wait()
            log.info("stopping %d servers", len(runner.servers))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            tasks.clear()
            await poller.close()
            await runner.stop_all()
            print(f"STOPPED supervisor cluster={the_plan.cluster} pid={os.getpid()}",
                  flush=True)
            return 0
        finally:
            for task in tasks:
                task.cancel()
            await poller.close()
            if metrics is not None:
                metrics.stop()
            runner.kill_all_now()  # only if something above failed midway
            await broker.stop()
            ctx.destroy(linger=0)
            if pid_file.exists() and pid_file.read_text().strip() == str(os.getpid()):
                pid_file.unlink()

    async def _wait_for_actives(self, runner, poller) -> list[str]:
        """Until every shard has an ACTIVE server (fresh stats rounds), at most the ready
        timeout; returns the shards still without one."""
        from clonemap.supervisor.health import shards_without_active

        deadline = asyncio.get_running_loop().time() + self.ready_timeout_s
        while True:
            await poller.poll_round()
            without = shards_without_active(
                runner.describe(), [self.plan.shards[i].name for i in self.plan.across])
            if not without or asyncio.get_running_loop().time() > deadline:
                return without
            await asyncio.sleep(ACTIVE_POLL_S)

    @staticmethod
    def _metrics_snapshot(runner, health, broker, resharding=None):
        async def gather() -> dict:
            return {"cluster": runner.plan.cluster, "rows": runner.describe(),
                    "failovers": dict(health.failovers), "broker": broker.stats(),
                    "reshard": resharding.state() if resharding is not None else None}
        return gather

    async def _live(self, runner) -> None:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.text import Text

        from clonemap.supervisor.status_view import status_table, summary_line

        console = Console()

        def render():
            rows = runner.describe()
            title = (f"cluster {self.plan.cluster}  control {self.plan.control}  "
                     f"supervisor pid {os.getpid()}  {summary_line(rows)}")
            table = status_table(rows, title=title)
            # the events that fit the terminal as it is now (it may have been resized):
            # below the READY line, the table and the hint, with a line to spare
            used = len(console.render_lines(table, console.options.update(height=None)))
            room = console.size.height - used - LIVE_FIXED_LINES
            shown = list(self.events)[-room:] if room > 0 else []
            return Group(table,
                         Text("\n".join(shown), style="dim"),
                         Text(f"Ctrl-C stops all; drill: supervisor kill s0/primary "
                              f"{control_hint(self.config_path)}", style="italic"))

        with Live(render(), console=console, refresh_per_second=4,
                  transient=False) as live:
            while True:
                await asyncio.sleep(1.0)
                live.update(render())


# ===================================================================== command

@click.command("start")
@click.argument("config", metavar="CONFIG")
@click.option("--detach", is_flag=True, help="Run in the background (logs in the run dir).")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Where the pid file and logs go [default: ./run/<cluster>].")
@click.option("--demo-load", is_flag=True,
              help="Write a few keys per second across the shards (for make run).")
@click.option("--table/--no-table", default=None,
              help="Live status table [default: when stdout is a terminal].")
@click.option("--ready-timeout-s", type=click.FloatRange(min=1), default=20.0,
              show_default=True, help="How long to wait for every server's READY.")
@click.option("--backoff-initial-s", type=click.FloatRange(min=0), default=BACKOFF_INITIAL_S,
              show_default=True, help="First restart delay after a crash (doubles).")
@click.option("--backoff-cap-s", type=click.FloatRange(min=0), default=BACKOFF_CAP_S,
              show_default=True, help="Longest restart delay.")
@click.option("--crash-limit", type=click.IntRange(min=1), default=CRASH_LIMIT,
              show_default=True,
              help=f"Crashes within {CRASH_WINDOW_S:g} s after which a server is FAILED.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
              default="INFO", show_default=True)
@click.option("--log-max-mb", type=click.FloatRange(min=0, min_open=True), default=16.0,
              show_default=True,
              help="Rotate a server's log at this size (3 copies kept: <log>.1 .. .3).")
@click.option("--host", "host_name", metavar="NAME", default=None,
              help="A config over several hosts (hosts:): start this host's servers only, "
                   "and its control endpoint.")
@click.option("--detached-child", is_flag=True, hidden=True)
def command(config: str, detach: bool, run_dir: str | None, demo_load: bool,
            table: bool | None, ready_timeout_s: float, backoff_initial_s: float,
            backoff_cap_s: float, crash_limit: int, log_level: str, log_max_mb: float,
            host_name: str | None, detached_child: bool) -> None:
    """Start the cluster in CONFIG and keep it running (Ctrl-C stops it)."""
    return_large_frees()  # dropped request bodies go back to the OS, not to the heap
    try:
        policy = PolicyConfig(backoff_initial_s=backoff_initial_s,
                              backoff_cap_s=max(backoff_cap_s, backoff_initial_s),
                              crash_limit=crash_limit)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    try:
        cluster = load_config(config)
        the_plan = plan(cluster, local_host_facts(), source=config, host=host_name)
        if the_plan.curve:  # the keys must be there before anything starts
            check_keys_present(the_plan.keys_dir, config, the_plan.access.identities)
    except ConfigError as exc:
        _fail(exc, exc.exit_code)
    name = the_plan.cluster + (f"-{host_name}" if host_name else "")
    run_path = Path(run_dir or Path("run") / (name + (DEMO_SUFFIX if demo_load
                                                      else ""))).resolve()
    if not detached_child:
        running = running_cluster(the_plan.cluster, config, run_path, host=host_name)
        if running is not None:
            click.echo(f"error: {running.line()}", err=True)
            raise SystemExit(PortInUse.exit_code)
    try:
        check_ports_free(the_plan, source=config)
        if the_plan.curve:  # readable certificates, not only files
            Security.load(the_plan.keys_dir, "server")
    except ConfigError as exc:
        _fail(exc, exc.exit_code)
    run_path.mkdir(parents=True, exist_ok=True)
    try:  # the routing's epoch: the run directory's (a resharded cluster keeps its own)
        the_plan = routing_state.settle(run_path, the_plan,
                                        config=str(Path(config).resolve()))
    except ConfigError as exc:
        _fail(exc, exc.exit_code)
    if detach and not detached_child:
        argv = ["start", str(Path(config).resolve()), "--run-dir", str(run_path),
                "--no-table", "--ready-timeout-s", str(ready_timeout_s),
                "--log-level", log_level, "--backoff-initial-s", str(backoff_initial_s),
                "--backoff-cap-s", str(backoff_cap_s), "--crash-limit", str(crash_limit),
                "--log-max-mb", str(log_max_mb)] + (["--demo-load"] if demo_load else []) \
            + (["--host", host_name] if host_name else [])
        raise SystemExit(_detach(argv, run_path, config))
    if table is None:
        table = sys.stdout.isatty() and not detached_child
    handler: logging.Handler
    if table:  # keep the terminal for the table
        handler = logging.FileHandler(run_path / "supervisor.log")
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    logging.basicConfig(level=getattr(logging, log_level), handlers=[handler])
    import uvloop

    supervisor = Supervisor(the_plan, run_path, table=table, demo_load=demo_load,
                            detached=detached_child, ready_timeout_s=ready_timeout_s,
                            policy=policy, log_max_bytes=int(log_max_mb * 1024 * 1024),
                            config_path=config, host_name=host_name)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        code = runner.run(supervisor.run())
    raise SystemExit(code)

"""Is this cluster already running? Asked before ``start`` probes its ports, and by
``validate`` when the ports are taken, so that the answer is one line naming the running
supervisor instead of one error per port.

Two witnesses: the run directory's ``supervisor.pid`` (a live process), and the control
endpoint answering ``cluster.status`` with this cluster's name (its pid and control).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import psutil

from clonemap.shards.common.errors import ClonemapError

ASK_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Running:
    cluster: str
    pid: int | None
    control: str
    answers: bool
    """The control endpoint answered (else only the pid file says so)."""

    def line(self) -> str:
        pid = f"pid {self.pid}" if self.pid else "pid unknown"
        if self.answers:
            return f"cluster {self.cluster} is already running ({pid}, control {self.control})"
        return (f"cluster {self.cluster} seems to be running ({pid} from its pid file) but "
                f"its control endpoint {self.control} does not answer")


def _pid_from_file(run_dir: Path | None) -> int | None:
    if run_dir is None:
        return None
    try:
        pid = int((run_dir / "supervisor.pid").read_text().strip())
        proc = psutil.Process(pid)
        if proc.status() != psutil.STATUS_ZOMBIE and any(
                "supervisor" in part for part in proc.cmdline()):
            return pid
    except (OSError, ValueError, psutil.Error):
        pass
    return None


def running_cluster(cluster: str, config_path: str, run_dir: Path | None,
                    host: str | None = None) -> Running | None:
    """The supervisor of ``cluster`` (of its ``host`` for a config over several) if one
    runs (pid file in ``run_dir``, or the control endpoint named in the config answering
    with this cluster's name)."""
    from clonemap.supervisor.control import resolve_control, status_rows

    endpoint = resolve_control(None, config_path, host)
    pid = _pid_from_file(run_dir)
    try:
        _, summary = status_rows(endpoint, timeout_s=ASK_TIMEOUT_S)
    except (ClonemapError, ValueError, json.JSONDecodeError):
        summary = None
    if summary is not None and summary.get("cluster") == cluster:
        return Running(cluster, summary.get("pid") or pid, str(endpoint), True)
    if pid is not None:
        return Running(cluster, pid, str(endpoint), False)
    return None

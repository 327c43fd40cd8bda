"""The documentation's examples, run as a user would paste them after ``make run``.

Every README in the repository (``README.md`` and ``<room>/README.md``) is read, and:

* every ```` ```python ```` block runs as a script, with a real cluster of
  ``configs/4shard.yaml`` up (the one ``make run`` starts);
* every line of a ```` ```sh ```` block that starts with ``chp `` runs in bash against
  the same cluster; it must exit 0, or the code its comment names (``# exit 6: ...``);
* every ```` ```sh session ```` block runs whole, top to bottom, in a fresh directory
  (it starts and stops clusters of its own).

The examples name the real endpoints (control 5555, servers 6000-6173, metrics 9464);
the test runs them on free ports instead: each ``127.0.0.1:PORT`` of those is rewritten
to a port of a free range, and ``configs/*.yaml`` are copies rewritten the same way,
in the directory the examples run in. Nothing else in an example changes.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import PYTHON, ROOT, free_port_base

pytestmark = pytest.mark.timeout(300)

READMES = sorted([ROOT / "README.md", *ROOT.glob("*/README.md")])
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)
EXPECTED_EXIT = re.compile(r"#\s*exit (\d+)")
DOC_PORTS = ([5555, 5655, 5755, 9464, 9465] + list(range(6000, 6200)))
"""The ports the examples name: control (4shard, its restore twin, the MDP example),
metrics (both), and the servers of both configs."""
EXAMPLE_TIMEOUT_S = 90


def blocks(kind: str) -> list[tuple[str, int, str]]:
    """(file, line, code) of every fenced block whose info string is ``kind``."""
    found = []
    for path in READMES:
        text = path.read_text()
        for m in FENCE.finditer(text):
            if m.group(1).strip() == kind:
                line = text.count("\n", 0, m.start()) + 1
                found.append((str(path.relative_to(ROOT)), line, m.group(2)))
    return found


def chp_lines() -> list[tuple[str, int, str]]:
    return [(where, line + i + 1, text) for where, line, code in blocks("sh")
            for i, text in enumerate(code.splitlines()) if text.startswith("chp ")]


class Site:
    """A directory to run examples in: ``configs/`` copies on free ports, and the map
    from each documented port to its free one."""

    def __init__(self, root: Path):
        base = free_port_base(len(DOC_PORTS))
        self.ports = {doc: base + i for i, doc in enumerate(DOC_PORTS)}
        self.root = root
        (root / "configs").mkdir(parents=True)
        for name in ("4shard.yaml", "4shard-restore.yaml"):
            data = yaml.safe_load((ROOT / "configs" / name).read_text())
            data.setdefault("metrics", "127.0.0.1:9464")
            data["control"] = self.rewrite(data["control"])
            data["metrics"] = self.rewrite(data["metrics"])
            for shard in data["shards"]:
                for role in ("primary", "backup"):
                    shard[role]["port"] = self.ports[shard[role]["port"]]
            (root / "configs" / name).write_text(yaml.safe_dump(data))
        self.control = f"tcp://127.0.0.1:{self.ports[5555]}"

    def rewrite(self, text: str) -> str:
        """Each documented port, as ``127.0.0.1:PORT`` or as the value of ``supervisor
        init``'s port options, moved to its free port."""
        def moved(m: re.Match) -> str:
            return f"{m.group(1)}{self.ports.get(int(m.group(2)), m.group(2))}"

        text = re.sub(r"(127\.0\.0\.1:)(\d{4})\b", moved, text)
        return re.sub(r"(--(?:control-port|port-base|metrics-port)[ =])(\d{4})\b", moved, text)

    def env(self) -> dict:
        env = dict(os.environ)
        env["PATH"] = f"{Path(PYTHON).parent}{os.pathsep}{env['PATH']}"
        env["CLONEMAP_CONTROL"] = self.control
        env["PYTHONPATH"] = python_path()
        env.pop("CLONEMAP_KEYS", None)
        return env

    def run(self, args: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=self.root, env=self.env(), capture_output=True,
                              text=True, timeout=EXAMPLE_TIMEOUT_S, **kw)


def python_path() -> str:
    """The repository first, then whatever PYTHONPATH the suite runs with (a machine where
    the dependencies are on PYTHONPATH, not installed, lost them: on the 16-core host the
    cluster these examples use could not import zmq)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture(scope="module")
def make_run_cluster(tmp_path_factory):
    """``configs/4shard.yaml`` under ``supervisor start`` (foreground, ended by PID)."""
    from conftest import Procs

    site = Site(tmp_path_factory.mktemp("site"))
    procs = Procs()
    try:
        procs.spawn([PYTHON, "-m", "clonemap.supervisor", "start", "configs/4shard.yaml",
                     "--no-table", "--run-dir", str(site.root / "run" / "four")],
                    ready="READY supervisor", timeout_s=60, env={"PYTHONPATH": python_path()},
                    cwd=site.root)
        yield site
    finally:
        procs.stop_all()


def test_the_docs_have_examples_of_each_kind():
    assert len(blocks("python")) >= 4
    assert len(chp_lines()) >= 8
    assert blocks("sh session")


@pytest.mark.parametrize("where,line,code", blocks("python"),
                         ids=[f"{w}:{n}" for w, n, _ in blocks("python")])
def test_a_python_example_runs(make_run_cluster, where, line, code):
    site = make_run_cluster
    script = site.root / f"example_{line}.py"
    script.write_text(site.rewrite(code))
    out = site.run([PYTHON, str(script)])
    assert out.returncode == 0, f"{where}:{line}\n{out.stdout}\n{out.stderr}"
    assert out.stderr == "", out.stderr  # a client says nothing unless something is wrong


@pytest.mark.parametrize("where,line,command", chp_lines(),
                         ids=[f"{w}:{n}" for w, n, _ in chp_lines()])
def test_a_chp_line_runs(make_run_cluster, where, line, command):
    site = make_run_cluster
    expected = EXPECTED_EXIT.search(command)
    out = site.run(["bash", "-c", site.rewrite(command)])
    want = int(expected.group(1)) if expected else 0
    assert out.returncode == want, f"{where}:{line}: {command}\n{out.stdout}\n{out.stderr}"
    if want == 0:
        assert out.stderr == "" or command.startswith("chp trace"), out.stderr


@pytest.mark.parametrize("where,line,code", blocks("sh session"),
                         ids=[f"{w}:{n}" for w, n, _ in blocks("sh session")])
def test_a_session_runs_top_to_bottom(tmp_path, where, line, code):
    site = Site(tmp_path)
    script = "set -e\n" + site.rewrite(code)
    try:
        out = site.run(["bash", "-c", script])
        assert out.returncode == 0, f"{where}:{line}\n{out.stdout}\n{out.stderr}"
    finally:
        for config in ("configs/4shard-restore.yaml", "configs/4shard.yaml",
                       *sorted(p.relative_to(tmp_path).as_posix()
                               for p in tmp_path.glob("*/clonemap.yaml"))):
            site.run([PYTHON, "-m", "clonemap.supervisor", "stop", config])
    for line_no, text in enumerate(code.splitlines()):
        expected = re.search(r"#\s+(\w+)$", text)
        if text.startswith("chp ") and expected and " get " in text:
            assert expected.group(1) in out.stdout, (text, out.stdout)

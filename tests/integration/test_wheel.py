"""The package as a user gets it: the sdist and the wheel built from a clean checkout,
installed into a fresh virtual environment outside the repository, and used there.

* the wheel holds ``clonemap`` and nothing else at the top (no ``client``, ``shards``,
  ``supervisor``, ``bench`` or tests), every module of the three folders, ``py.typed`` and
  the example configs;
* ``pip install clonemap`` alone is a client: ``from clonemap import Clone`` and ``chp``
  work, the supervisor and a config-reading client say which extra they need;
* with ``clonemap[server]``, from a directory that is not the checkout: ``supervisor init``,
  ``supervisor start --detach`` on the written config, ``chp set/get``, a Python ``Clone``
  script beside an application module named ``client.py``, ``supervisor stop``;
* the installed client's public modules pass ``mypy --strict``.

The virtual environment gets its dependencies from the package index as any user's does
(pip's cache makes a second run quick).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import venv as venv_module
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from conftest import PYTHON, ROOT, free_port_base

pytestmark = pytest.mark.timeout(600)

BARE_NAMES = ("client", "shards", "supervisor", "bench", "tests", "configs")
"""Top-level import names the wheel must not install: the repository's folders."""
FOLDERS = ("client", "shards", "supervisor")
"""The repository's folders the wheel lays out under ``clonemap``."""
PUBLIC_MODULES = ("clonemap", "clonemap.client.api", "clonemap.client.clone",
                  "clonemap.client.sync", "clonemap.client.watch", "clonemap.client.options",
                  "clonemap.client.events", "clonemap.client.errors",
                  "clonemap.client.workers", "clonemap.client.metrics",
                  "clonemap.shards.common.errors")
"""The client's public modules, type-checked strictly as installed."""
SERVER_ONLY = ("yaml", "pydantic", "psutil", "rich", "prometheus_client")


def run(args: list, *, cwd: Path, env: dict | None = None, timeout_s: float = 180,
        check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if check and out.returncode != 0:
        raise AssertionError(f"{args[:3]} exited {out.returncode}\nstdout:\n{out.stdout}"
                             f"\nstderr:\n{out.stderr}")
    return out


def clean_checkout(dest: Path) -> Path:
    """The files a fresh clone of this working tree holds (tracked, and new files git does
    not ignore): no build output, no virtual environment, no compiled extension."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel (built from the sdist, as ``python -m build`` does)."""
    base = tmp_path_factory.mktemp("dist")
    src = clean_checkout(base / "checkout")
    out = base / "out"
    built = run([PYTHON, "-m", "build", "--no-isolation", "--outdir", out, src], cwd=base)
    assert re.search(r"Successfully built clonemap-\S+\.tar\.gz and clonemap-\S+\.whl",
                     built.stdout), built.stdout[-2000:]
    # setuptools' only note: the ext-modules table is experimental; nothing about packages
    assert "is absent from the `packages`" not in built.stdout + built.stderr
    return out


@dataclass
class Venv:
    """A virtual environment outside the checkout, and an environment for its commands
    that names nothing of the checkout or of the test's own environment."""

    root: Path
    work: Path
    base: dict = field(default_factory=dict)
    """What a client-only install (no extras) answered, before ``[server]`` was added."""

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def site(self) -> Path:
        (site,) = self.root.glob("lib/python3*/site-packages")
        return site

    def env(self) -> dict:
        keep = {k: os.environ[k] for k in ("HOME", "LANG", "TMPDIR") if k in os.environ}
        return {**keep, "PATH": f"{self.bin}:/usr/local/bin:/usr/bin:/bin",
                "VIRTUAL_ENV": str(self.root), "PYTHONUNBUFFERED": "1"}

    def run(self, *args, check: bool = True, timeout_s: float = 120,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        return run(list(args), cwd=cwd or self.work, env=self.env(), timeout_s=timeout_s,
                   check=check)

    def python(self, code: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(self.bin / "python", "-c", textwrap.dedent(code), check=check)


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> Venv:
    """``pip install clonemap`` (what a client-only application does), checked as such,
    then ``pip install 'clonemap[server]'`` into the same environment."""
    top = tmp_path_factory.mktemp("user")
    env = Venv(top / "venv", top / "app")
    env.work.mkdir()
    venv_module.create(env.root, with_pip=True)
    (wheel,) = dist.glob("clonemap-*.whl")
    env.run(env.bin / "pip", "install", "--quiet", wheel, timeout_s=300)
    env.base["import"] = env.python(f"""
        import sys
        from clonemap import AsyncClone, Clone, Conflict, __version__
        import clonemap.client.api
        print(__version__)
        print(sorted({{m.split(".")[0] for m in sys.modules}} & set({SERVER_ONLY!r})))
        """)
    env.base["config"] = env.python("""
        from clonemap import Clone
        from clonemap.shards.common.errors import MissingExtra
        try:
            Clone(config="nowhere.yaml")
        except MissingExtra as exc:
            print(exc.extra, exc)
        """)
    env.base["chp"] = env.run("chp", "--version")
    env.base["supervisor"] = env.run("supervisor", "--version", check=False)
    env.run(env.bin / "pip", "install", "--quiet", f"{wheel}[server]", timeout_s=300)
    return env


def test_the_wheel_holds_the_product_under_one_name(dist):
    (wheel,) = dist.glob("clonemap-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"clonemap", next(t for t in tops if t.endswith(".dist-info"))}
    for folder in FOLDERS:
        modules = {f"clonemap/{p.relative_to(ROOT).as_posix()}"
                   for p in (ROOT / folder).rglob("*.py")}
        assert len(modules) > 20 and modules <= set(names), modules - set(names)
    assert not [n for n in names if "/bench/" in n or "/tests/" in n or "test_" in n]
    for needed in ("clonemap/py.typed", "clonemap/configs/3host.yaml",
                   "clonemap/configs/grafana/clonemap-dashboard.json"):
        assert needed in names
    if shutil.which("cc") or shutil.which("gcc"):
        assert [n for n in names if re.fullmatch(r"clonemap/shards/common/_zframes\..*\.so", n)]
    meta = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = re.findall(r"^Requires-Dist: (\S+)(.*)$", meta, re.M)
    base = {name for name, rest in requires if "extra ==" not in rest}
    assert {n.split(">")[0].lower() for n in base} == {"pyzmq", "uvloop", "msgpack", "click"}
    (sdist,) = dist.glob("clonemap-*.tar.gz")
    in_sdist = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    assert {"shards/common/_zframes.c", "clonemap/__init__.py", "pyproject.toml"} <= in_sdist


def test_the_environment_has_no_generic_top_level_names(installed):
    site = installed.site
    assert (site / "clonemap" / "__init__.py").is_file()
    assert not [n for n in BARE_NAMES if (site / n).exists() or (site / f"{n}.py").exists()]
    (info,) = site.glob("clonemap-*.dist-info")
    assert (info / "top_level.txt").read_text().split() == ["clonemap"]


def test_a_client_only_install_embeds_the_client_and_names_the_extras(installed):
    version, loaded = installed.base["import"].stdout.splitlines()
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", version)
    assert loaded == "[]"  # the client pulls no server-side dependency
    assert installed.base["config"].stdout.startswith("config ")
    assert "pip install 'clonemap[config]'" in installed.base["config"].stdout
    assert installed.base["chp"].stdout.strip() == f"chp (clonemap) {version}"
    refused = installed.base["supervisor"]
    assert refused.returncode != 0
    assert "the supervisor needs clonemap's 'server' extra: pip install " \
           "'clonemap[server]'" in refused.stderr


def test_a_user_runs_a_cluster_from_the_installed_package(installed):
    """From a directory that is not the checkout, with only the installed commands."""
    env = installed
    assert env.run("supervisor", "--version").stdout.startswith("supervisor (clonemap) ")
    control, metrics, base = free_port_base(1), free_port_base(1), free_port_base(80)
    init = env.run("supervisor", "init", "cluster", "--control-port", control,
                   "--port-base", base, "--metrics-port", metrics)
    config = env.work / "cluster" / "clonemap.yaml"
    assert f"wrote cluster/clonemap.yaml" in init.stdout
    assert (env.work / "cluster" / "multi-host.example.yaml").is_file()
    started = env.run("supervisor", "start", "cluster/clonemap.yaml", "--detach",
                      timeout_s=90)
    stopped = False
    try:
        assert re.search(r"READY supervisor cluster=local .* servers=8 running=8 "
                         r"active_shards=4/4", started.stdout), started.stdout
        # the hint works from anywhere: the config's absolute path
        assert f"stop it with: supervisor stop {config}" in started.stdout
        env.run("chp", "--config", "cluster/clonemap.yaml", "set", "/hello", "world")
        got = env.run("chp", "--config", "cluster/clonemap.yaml", "get", "/hello")
        assert got.stdout == "world\n"
        # an application with a module of its own named client
        (env.work / "client.py").write_text('NAME = "the application\'s own client"\n')
        (env.work / "app.py").write_text(textwrap.dedent(f"""
            import client
            from clonemap import Clone

            with Clone(control="tcp://127.0.0.1:{control}") as clone:
                clone.set("/app/owner", client.NAME.encode(), wait=True)
                print(clone.get("/hello"), clone.get("/app/owner"))
            """))
        app = env.run(env.bin / "python", "app.py")
        assert app.stdout == "b'world' b\"the application's own client\"\n"
        assert app.stderr == ""
        pid_file = env.work / "run" / "local" / "supervisor.pid"
        supervisor = psutil.Process(int(pid_file.read_text().split()[0]))
        env.run("supervisor", "stop", config, cwd=env.root)  # from another directory
        stopped = True
    finally:
        if not stopped:
            env.run("supervisor", "stop", config, check=False)
    # the pid file goes before the process has quite exited: its exit is the event
    supervisor.wait(timeout=20)
    assert not pid_file.exists()
    assert not [line for line in env.run("ps", "-eo", "args").stdout.splitlines()
                if str(env.root) in line]


def test_the_installed_client_passes_mypy_strict(installed, tmp_path):
    """The public API's files as the wheel installed them, checked with the project's
    mypy settings (strict), against the dependencies installed beside them (whose own
    files mypy does not report on, as in any application's check)."""
    assert (installed.site / "clonemap" / "py.typed").is_file()
    shutil.copytree(installed.site / "clonemap", tmp_path / "clonemap")
    args = [PYTHON, "-m", "mypy", "--config-file", ROOT / "pyproject.toml",
            "--python-executable", installed.bin / "python",
            "--cache-dir", tmp_path / ".mypy_cache"]
    for module in PUBLIC_MODULES:
        args += ["-m", module]
    out = run(args, cwd=tmp_path, check=False, timeout_s=300)
    assert out.returncode == 0, out.stdout[-6000:]
    assert out.stdout.startswith("Success: no issues found")

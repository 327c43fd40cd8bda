"""The layout the code keeps (read from the files, nothing imported): no module over
``MAX_LINES`` outside the tests, no import cycle between modules, the client imports
nothing from the supervisor, the pure machines import no ZeroMQ, and the project is
imported by one name, ``clonemap`` (the folders ``client/``, ``shards/`` and
``supervisor/`` are ``clonemap.client``, ``clonemap.shards``, ``clonemap.supervisor``)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shards", "client", "supervisor", "bench")
INSTALLED = ("shards", "client", "supervisor")
"""The folders the wheel installs under ``clonemap``; ``bench`` stays in the checkout."""
MAX_LINES = 560
PURE = ("client/shard_machine.py", "client/options.py", "shards/bstar.py",
        "shards/replica_machine.py", "shards/pending.py", "shards/store.py")


def modules() -> dict[str, Path]:
    """Dotted name -> path, for every module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            if package in INSTALLED:
                parts.insert(0, "clonemap")
            out[".".join(parts)] = path
    return out


def imports_of(path: Path, known: dict[str, Path], top_level_only: bool) -> set[str]:
    """The project modules ``path`` imports (at module level only, when asked: an import
    inside a function runs later and cannot form a cycle at import time)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.If):  # ``if TYPE_CHECKING:`` blocks never run
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in subs if n in known] or [node.module]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def test_no_module_is_longer_than_the_limit():
    long = {str(path.relative_to(ROOT)): n for path in modules().values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_import_cycle_at_import_time():
    known = modules()
    # (a module's own packages are initialised before it: never a cycle)
    graph = {name: {d for d in imports_of(path, known, top_level_only=True)
                    if d != name and not name.startswith(d + ".")}
             for name, path in known.items()}
    assert sum(map(len, graph.values())) > 300, "the import graph lost its edges"
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    stack: list[str] = []

    def walk(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                walk(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)


def test_the_client_imports_nothing_from_the_supervisor():
    known = modules()
    leaks = {name: sorted(d for d in imports_of(path, known, top_level_only=False)
                          if d.startswith("clonemap.supervisor"))
             for name, path in known.items() if name.startswith("clonemap.client")}
    assert len(leaks) > 20
    assert not {k: v for k, v in leaks.items() if v}


def test_the_project_is_imported_by_one_name():
    """No module, test or benchmark imports ``client``, ``shards`` or ``supervisor`` as a
    top-level name: an application's own ``client.py`` must never be in the way."""
    bare = []
    paths = [*modules().values(), *sorted((ROOT / "tests").rglob("*.py"))]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and node.level == 0 else [])
            bare += [f"{path.relative_to(ROOT)}: {n}" for n in names
                     if n.split(".")[0] in INSTALLED]
    assert len(paths) > 200
    assert not bare


def test_the_pure_machines_import_no_zeromq():
    for rel in PURE:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "zmq" for a in node.names), rel
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] != "zmq", rel

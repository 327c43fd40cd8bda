"""The layout the code keeps (read from the files, nothing imported): how coupled it
is, not how long. No object reaches into another's private state (``x._name`` where
``x`` is not ``self``); no import cycle between modules, counting every import (those
under ``TYPE_CHECKING`` and inside functions too: a part that imports its owner back is
a cycle even when it only types with it); the client imports nothing from the
supervisor; the pure machines import no ZeroMQ; and the project is imported by one
name, ``clonemap`` (the folders ``client/``, ``shards/`` and ``supervisor/`` are
``clonemap.client``, ``clonemap.shards``, ``clonemap.supervisor``)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shards", "client", "supervisor", "bench")
INSTALLED = ("shards", "client", "supervisor")
"""The folders the wheel installs under ``clonemap``; ``bench`` stays in the checkout."""
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
"""Underscored by ``collections.namedtuple`` so as not to clash with field names: public."""
DOCUMENTED = {"os._exit"}
"""Underscored names the standard library documents as its API."""
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


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports: every import, wherever it is (under ``if
    TYPE_CHECKING:``, inside a function)."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
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


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, directly or around a circle
    (Tarjan's strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for dep in sorted(graph[name]):
            if dep not in index:
                visit(dep)
                low[name] = min(low[name], low[dep])
            elif dep in on_stack:
                low[name] = min(low[name], index[dep])
        if low[name] == index[name]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == name:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return groups


def test_import_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_counting_every_import():
    known = modules()
    # (a module's own packages are initialised before it: never a cycle)
    graph = {name: {d for d in imports_of(path, known)
                    if d != name and not name.startswith(d + ".")}
             for name, path in known.items()}
    assert sum(map(len, graph.values())) > 300, "the import graph lost its edges"
    assert import_cycles(graph) == []


def private_reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """``x._name`` where ``x`` is not ``self``/``cls`` (namedtuple's API and the standard
    library's documented names aside): (line, the expression)."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        text = ast.unparse(node)
        if node.attr in NAMEDTUPLE_API or text in DOCUMENTED:
            continue
        found.append((node.lineno, text))
    return sorted(found)


def test_the_private_reach_rule_sees_a_reach():
    tree = ast.parse("self._a\ncls._b\nother._c\nself.part._d\nrow._replace()\n"
                     "os._exit(1)\nx.__class__\n")
    assert private_reaches(tree) == [(3, "other._c"), (4, "self.part._d")]


def test_no_object_reaches_into_another_objects_private_state():
    reaches = []
    paths = [p for name, p in modules().items() if name.startswith("clonemap.")]
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        reaches += [f"{path.relative_to(ROOT)}:{line}: {text}"
                    for line, text in private_reaches(tree)]
    assert len(paths) > 100
    assert reaches == []


def test_the_client_imports_nothing_from_the_supervisor():
    known = modules()
    leaks = {name: sorted(d for d in imports_of(path, known)
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

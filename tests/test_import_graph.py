"""The import graph of ``attention_zoo``, ``tasks`` and ``experiments``, read with ``ast`` (nothing is imported).

Every import counts, at module level or inside a function, and so does a module named by a string that the code
imports later (``importlib.import_module``, the ``zoo`` command table, a forkserver preload list): a lazy import
changes when a module loads, not what it depends on. A string after ``"-m"`` is a program to run in a new
process, not an import. The layers: ``attention_zoo`` imports neither ``tasks`` nor ``experiments``, ``tasks``
does not import ``experiments``; inside ``experiments``, each top-level module and each subpackage is one node,
and the nodes import one another without a loop; no one imports a ``_private`` name from another top-level
package or another node of ``experiments``.
"""

from __future__ import annotations

import ast
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path

from tests.files import write_files

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attention_zoo", "tasks", "experiments")
#: package -> the packages it must not import
LOWER_THAN = {"attention_zoo": ("tasks", "experiments"), "tasks": ("experiments",)}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted
    name: str | None  # the name taken from it (``from target import name``), None for the module itself
    line: int


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the three packages under ``root``."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@functools.cache
def imports(root: Path = ROOT) -> tuple[Import, ...]:
    """Every import of the three packages' modules under ``root`` whose target is one of those modules."""
    known = modules(root)
    found = []
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        programs = _programs(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [Import(module, a.name, None, node.lineno) for a in node.names if a.name in known]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node.module, node.level, package)
                for alias in node.names:
                    if f"{base}.{alias.name}" in known:  # ``from package import module``
                        found.append(Import(module, f"{base}.{alias.name}", None, node.lineno))
                    elif base in known:
                        found.append(Import(module, base, alias.name, node.lineno))
            elif isinstance(node, ast.Constant) and node.value in known and id(node) not in programs:
                found.append(Import(module, node.value, None, node.lineno))
    return tuple(found)


def _programs(tree: ast.AST) -> set[int]:
    """The ids of the string nodes that follow ``"-m"`` in a list or tuple: modules run as programs."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple):
            for flag, after in itertools.pairwise(node.elts):
                if isinstance(flag, ast.Constant) and flag.value == "-m":
                    found.add(id(after))
    return found


def _absolute(module: str | None, level: int, package: str) -> str:
    if not level:
        return module or ""
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{module}" if module else base


def node(module: str) -> str:
    """The unit a module belongs to: ``experiments.bench.runner`` -> ``experiments.bench``, a top-level module
    of a package -> itself, a package's ``__init__`` -> the package."""
    return ".".join(module.split(".")[:2])


def experiment_edges(found: tuple[Import, ...]) -> dict[str, set[str]]:
    """Between the nodes of ``experiments``: node -> the nodes it imports (itself left out)."""
    edges: dict[str, set[str]] = {}
    for item in found:
        if item.source.startswith("experiments.") and item.target.startswith("experiments."):
            source, target = node(item.source), node(item.target)
            if source != target:
                edges.setdefault(source, set()).add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a closed path) per strongly connected component of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(vertex: str) -> None:
        index[vertex] = low[vertex] = len(index)
        stack.append(vertex)
        for nxt in sorted(edges.get(vertex, ())):
            if nxt not in index:
                visit(nxt)
                low[vertex] = min(low[vertex], low[nxt])
            elif nxt in stack:
                low[vertex] = min(low[vertex], index[nxt])
        if low[vertex] == index[vertex]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == vertex:
                    break
            if len(component) > 1:
                components.append(set(component))

    for vertex in sorted(edges):
        if vertex not in index:
            visit(vertex)
    return [_closed_path(min(c), c, edges) for c in components]


def _closed_path(start: str, component: set[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest path from ``start`` back to itself inside ``component`` (breadth first)."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        vertex = queue.pop(0)
        for nxt in sorted(edges.get(vertex, set()) & component):
            if nxt == start:
                return [*paths[vertex], start]
            if nxt not in paths:
                paths[nxt] = [*paths[vertex], nxt]
                queue.append(nxt)
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def private_imports(found: tuple[Import, ...]) -> list[Import]:
    """Imports of a ``_name`` (not ``__dunder__``) across top-level packages or across nodes of ``experiments``;
    a private module counts as a private name."""
    crossing = []
    for item in found:
        names = [item.name] if item.name else item.target.split(".")
        if not any(n.startswith("_") and not n.startswith("__") for n in names):
            continue
        other_package = item.source.split(".")[0] != item.target.split(".")[0]
        other_node = item.source.startswith("experiments.") and node(item.source) != node(item.target)
        if other_package or other_node:
            crossing.append(item)
    return crossing


def layer_violations(found: tuple[Import, ...]) -> list[str]:
    """Imports of a package above the importing one (:data:`LOWER_THAN`)."""
    return [
        f"{i.source}:{i.line} imports {i.target}"
        for i in found
        if i.target.split(".")[0] in LOWER_THAN.get(i.source.split(".")[0], ())
    ]


def test_experiments_nodes_import_one_another_without_a_loop():
    edges = experiment_edges(imports())
    assert edges, "no import found between the nodes of experiments: update this test"
    assert cycles(edges) == []


def test_no_private_name_is_imported_across_packages_or_experiments_nodes():
    crossing = private_imports(imports())
    assert [f"{i.source}:{i.line} takes {i.name or i.target} from {i.target}" for i in crossing] == []


def test_attention_zoo_and_tasks_import_nothing_above_them():
    assert layer_violations(imports()) == []


def test_the_graph_sees_lazy_imports_string_imports_and_cycles(tmp_path):
    """The reader on a small tree: a function-level import, ``from package import module``, a relative import,
    a module named by a string, a ``-m`` program that is not an import, and the cycle, the private name and the
    upward import they make."""
    files = {
        "experiments/__init__.py": "",
        "experiments/cli.py": 'COMMANDS = {"a": ("experiments.a.command", "main")}\n',
        "experiments/a/__init__.py": "",
        "experiments/a/command.py": "def main():\n    from experiments.b import runs\n",
        "experiments/a/shared.py": "_SECRET = 1\n",
        "experiments/b/__init__.py": "",
        "experiments/b/runs.py": "from ..a.shared import _SECRET\nCMD = ['-m', 'experiments.cli']\n",
        "attention_zoo/__init__.py": "",
        "attention_zoo/core.py": "def f():\n    import tasks.base\n",
        "tasks/__init__.py": "",
        "tasks/base.py": "",
    }
    found = imports(write_files(tmp_path, files))
    edges = experiment_edges(found)
    assert edges == {"experiments.cli": {"experiments.a"}, "experiments.a": {"experiments.b"},
                     "experiments.b": {"experiments.a"}}  # fmt: skip
    assert cycles(edges) == [["experiments.a", "experiments.b", "experiments.a"]]
    (private,) = private_imports(found)
    assert (private.source, private.target, private.name) == ("experiments.b.runs", "experiments.a.shared", "_SECRET")
    assert layer_violations(found) == ["attention_zoo.core:2 imports tasks.base"]

"""The library's layers, read from its source: every hbp module's imports (module level and
inside functions) go one way, down the pipeline capture -> IR -> simulator/planner ->
executor -> API (docs/architecture.md), with no cycle between top-level packages nor between
modules, and the runtime imports no solver."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HBP = ROOT / "hbp"

# Each top-level part of hbp and its layer: a module may import from its own layer and the
# ones below, never from above. Foundations (no hbp imports but each other) at the bottom;
# the capture and the IR; the simulator; the planner (never the runtime); the runtime (never
# the workloads); the integrations, thin adapters over graph + planner + runtime; the tools
# and the bench on top.
LAYERS: dict[str, int] = {
    "units": 0,
    "errors": 1,
    "files": 1,
    "allocator": 1,
    "graph": 2,
    "ops": 2,
    "analysis": 3,
    "planner": 4,
    "runtime": 5,
    "workloads": 6,
    "integrations": 7,
    "jax": 8,
    "estimate": 8,
    "optimum": 8,
    "modes": 9,
    "telemetry": 9,
    "report": 9,
    "bench": 10,
    "": 11,  # hbp/__init__.py: the public API
}

# Packages whose files this repository keeps short (one concern per file).
SHORT_FILES = ("hbp/analysis", "hbp/graph/torch", "hbp/runtime/executors", "hbp/planner/milp.py")
MAX_LINES = 600


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def hbp_imports(path: Path, root: Path = ROOT) -> set[str]:
    """The hbp modules (or packages) `path` imports, wherever the import statement is."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "hbp"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "hbp":
                out.add(module)
    return out


def part(module: str) -> str:
    """The top-level part of hbp a module belongs to ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def part_edges() -> dict[tuple[str, str], list[str]]:
    """(importer part, imported part) -> "importer -> imported" module pairs."""
    edges = defaultdict(list)
    for path in sorted(HBP.rglob("*.py")):
        source = module_name(path)
        for target in hbp_imports(path):
            a, b = part(source), part(target)
            if a != b and b != "":
                edges[a, b].append(f"{source} -> {target}")
    return edges


def strongly_connected(edges) -> list[set[str]]:
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def module_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """hbp module -> {hbp module it imports: line of the first such import}, for every import
    statement anywhere in the module (module level, `if TYPE_CHECKING:`, inside functions),
    relative ones resolved; `from package import name` counts as importing the submodule
    `package.name` when there is one, else the package."""
    paths = {module_name(p, root): p for p in sorted((root / "hbp").rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [
                    f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module
                    for a in node.names
                ]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "hbp" and target != name:
                    out.setdefault(target, node.lineno)
        graph[name] = out
    return graph


def a_cycle(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """One cycle through the strongly connected `component`, as "a:line -> b" steps."""
    start = min(component)
    path, seen = [start], {start: 0}
    while True:
        here = path[-1]
        step = min(t for t in graph[here] if t in component)
        if step in seen:
            cycle = path[seen[step] :] + [step]
            return [f"{a}:{graph[a][b]} -> {b}" for a, b in zip(cycle, cycle[1:])]
        seen[step] = len(path)
        path.append(step)


def module_cycles(root: Path = ROOT) -> list[list[str]]:
    graph = module_graph(root)
    edges = [(a, b) for a, targets in graph.items() for b in targets]
    return [a_cycle(graph, c) for c in strongly_connected(edges)]


def test_every_part_of_hbp_has_a_layer():
    parts = {part(module_name(p)) for p in HBP.rglob("*.py")}
    assert parts <= set(LAYERS), sorted(parts - set(LAYERS))


def test_imports_go_down_the_layers():
    upward = [
        pair for (a, b), pairs in part_edges().items() if LAYERS[b] > LAYERS[a] for pair in pairs
    ]
    assert not upward, "\n".join(upward)


def test_no_cycle_between_parts_of_hbp():
    edges = part_edges()
    cycles = strongly_connected(edges)
    detail = [
        pair for c in cycles for (a, b), pairs in edges.items() if {a, b} <= c for pair in pairs
    ]
    assert not cycles, f"{cycles}:\n" + "\n".join(detail)


def test_the_layer_check_finds_an_upward_import(tmp_path):
    """The checks read what they must: an import inside a function counts."""
    module = tmp_path / "hbp" / "planner" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from hbp.runtime.executors import make_executor\n")
    assert hbp_imports(module, tmp_path) == {"hbp.runtime.executors"}
    assert LAYERS[part("hbp.runtime.executors")] > LAYERS[part("hbp.planner.probe")]
    assert strongly_connected([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [{"a", "b", "c"}]


def test_no_cycle_between_modules_of_hbp():
    """No hbp module imports, however indirectly, one that imports it back: a type-only or a
    function-local import counts too (a shared piece moves to the lower module instead)."""
    cycles = module_cycles()
    assert not cycles, "\n\n".join("\n".join(c) for c in cycles)


def test_the_module_cycle_check_finds_hidden_and_relative_imports(tmp_path):
    package = tmp_path / "hbp" / "pkg"
    package.mkdir(parents=True)
    (tmp_path / "hbp" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hbp.pkg.c import C\n"
    )
    (package / "c.py").write_text("def f():\n    from ..pkg.a import x\n")
    assert module_graph(tmp_path)["hbp.pkg.a"] == {"hbp.pkg.b": 1}
    assert module_cycles(tmp_path) == [
        ["hbp.pkg.a:1 -> hbp.pkg.b", "hbp.pkg.b:3 -> hbp.pkg.c", "hbp.pkg.c:2 -> hbp.pkg.a"]
    ]
    (package / "c.py").write_text("X = 1\n")
    assert module_cycles(tmp_path) == []


@pytest.mark.parametrize("where", SHORT_FILES)
def test_library_files_are_short(where):
    path = ROOT / where
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    long = {
        str(f.relative_to(ROOT)): n
        for f in files
        if (n := len(f.read_text().splitlines())) > MAX_LINES
    }
    assert files and not long, long


def test_the_runtime_imports_no_solver():
    """The schedule executor reads the schedule model; the MILP (HiGHS) is the planner's."""
    script = (
        "import sys\n"
        "import hbp.runtime.executors\n"
        "assert 'highspy' not in sys.modules and 'hbp.planner.milp' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]

"""fp8kit's own import graph has no cycle, counting imports inside functions too.

A lazy import inside a function hides a circle from Python's import machinery, not from the design: both modules
still depend on each other. This test reads every module under fp8kit/ with `ast`, resolves relative imports,
maps `from package import name` to the submodule when `name` is one, and fails on any cycle, printing it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "fp8kit"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _resolve(base: str, level: int, current: str, is_package: bool) -> str:
    """The absolute module a (possibly relative) `from` import names."""
    if level == 0:
        return base
    package = current.split(".") if is_package else current.split(".")[:-1]
    package = package[: len(package) - (level - 1)]
    return ".".join(package + ([base] if base else []))


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The fp8kit modules one module imports, anywhere in its body."""
    return _imports_of_source(path.read_text(), name, path.name == "__init__.py", known)


def _imports_of_source(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, name, is_package)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` depends on a.b.c (and runs the packages above it; those edges are the packages' own).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (its smallest name first)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    # breadth-first search back to start inside the component
    parents = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                path = [v]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return list(reversed(path)) + [start]
            if w not in parents:
                parents[w] = v
                queue.append(w)
    return sorted(component)


def test_import_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert {"fp8kit.pytorch.cast", "fp8kit.pytorch.tensor.float8_tensor"} <= graph["fp8kit.pytorch.quantize_api"]
    assert "fp8kit.pytorch.fsdp" in graph["fp8kit.pytorch"]  # `from . import fsdp` in a package __init__
    # the walker itself finds a cycle made of a function-level import
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(fake) == [["a", "b", "c", "a"]]
    # a function-level, relative `from .. import x` is an edge (Float8Tensor's hooks once imported fsdp that way)
    source = "def f():\n    from .. import fsdp\n    from ..cast import amax\n"
    found = _imports_of_source(source, "fp8kit.pytorch.tensor.float8_tensor", False, set(graph))
    assert found == {"fp8kit.pytorch.fsdp", "fp8kit.pytorch.cast"}


def test_fp8kit_has_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    message = "\n".join(" -> ".join(c) for c in cycles)
    assert not cycles, f"import cycles in fp8kit:\n{message}"

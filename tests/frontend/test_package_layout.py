"""The package's layout as a contract (the README's "What is where"): the import graph of
``numba_flash`` has no cycle, the kernels import neither the FlexAttention front end nor the
tooling, the runtime never imports the tooling, and ``kernels/`` keeps its kinds in subfolders.

The graph is read from the source with :mod:`ast` (every ``import`` and ``from ... import``,
at module level or inside a function), so the test needs no import of the package."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "numba_flash"


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name):
    """The package's modules that module ``name`` imports (a ``from X import y`` of a submodule
    ``y`` counts as an import of ``X.y``; of a name, as one of ``X``)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    assert cycles(GRAPH) == []


def test_cycle_finder_finds_a_planted_cycle():
    """The check above can fail: a graph with a -> b -> c -> a reports that cycle."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_kernels_import_neither_flex_nor_tools():
    bad = sorted((m, t) for m, targets in GRAPH.items() if m.startswith("numba_flash.kernels")
                 for t in targets if t.startswith(("numba_flash.flex", "numba_flash.tools")))
    assert bad == []


def test_the_runtime_never_imports_the_tooling():
    """Only the tooling itself and the command line (``numba-flash compile-check``, ``warmup``,
    ``pictures``) import :mod:`numba_flash.tools`."""
    outside = ("numba_flash.tools", "numba_flash.__main__")
    bad = sorted((m, t) for m, targets in GRAPH.items() if not m.startswith(outside)
                 for t in targets if t.startswith("numba_flash.tools"))
    assert bad == []


def test_kernels_keep_their_kinds_in_subfolders():
    top = sorted(p.name for p in (PACKAGE / "kernels").glob("*.py"))
    assert len(top) <= 4, top
    kinds = sorted(p.name for p in (PACKAGE / "kernels").iterdir()
                   if p.is_dir() and (p / "__init__.py").exists())
    assert kinds == ["backward", "cache", "core", "decode", "forward", "mainloop", "ptx"]



def op_imports(graph):
    """The ``(op module, op module)`` edges of ``graph``: an op importing another op."""
    return sorted((m, t) for m, targets in graph.items() if m.startswith("numba_flash.ops.")
                  for t in targets if t.startswith("numba_flash.ops"))


def test_no_op_module_imports_another():
    """The ops share their host code through :mod:`numba_flash.frontend` (issue 45): no module
    of :mod:`numba_flash.ops` imports another (the tensor-core ops are imported by name, once
    per call, by the front end's kernel choice)."""
    assert op_imports(GRAPH) == []


def test_op_rule_finds_a_planted_import():
    """The rule above can fail: an op importing a sibling is reported; the front end importing
    an op is not."""
    graph = {"numba_flash.ops.decode": {"numba_flash.ops.kv_cache",
                                        "numba_flash.frontend.cache_args"},
             "numba_flash.frontend.kernel_choice": {"numba_flash.ops.forward_mma"}}
    assert op_imports(graph) == [("numba_flash.ops.decode", "numba_flash.ops.kv_cache")]

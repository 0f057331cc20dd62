"""The package's modules import one another without a circle.

A circle is read from the source (ast), not by importing: every `import kdtree_jax...` and
`from kdtree_jax... import ...` in every module, at the top or inside a function (a function-local import
only hides a circle until the function runs). Two kinds of edge are left out, because neither runs code at
import time that could meet a half-initialised module:
  - imports under `if TYPE_CHECKING:` (read by type checkers only);
  - a submodule's implicit import of its parent package: the package's `__init__` re-exports its
    submodules' names, so it sits above them; an explicit `import kdtree_jax` still counts.
"""

import ast
from pathlib import Path

PACKAGE = "kdtree_jax"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def _top_level_names(tree: ast.Module) -> set:
    """Names a module binds at its top level (what `from module import name` can find without a submodule)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def import_graph(root: Path = ROOT) -> dict:
    """{module: set of package modules it imports} over every .py file under `root`.

    `from package import x` is an edge to the submodule `package.x` when it is one, to the package when its
    `__init__` binds x, and to nothing otherwise: x is then a compiled submodule (the nanobind extensions),
    which imports no Python module of the package."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in files.items()}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _imports(trees[name]):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in files)
                continue
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from .y import z`
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in files:  # `from pkg import submodule`
                    edges.add(sub)
                elif base in files and (files[base].name != "__init__.py"
                                        or alias.name in _top_level_names(trees[base])):
                    edges.add(base)  # `from module import name`
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict):
    """One import circle as a list [a, b, ..., a], or None."""
    state = {}  # module -> "open" while on the DFS stack, "done" after
    stack = []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_graph_sees_local_and_relative_imports(tmp_path):
    """The reader itself: a circle closed by a function-local or relative import is found; a TYPE_CHECKING
    import and the implicit parent-package import are not edges."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from kdtree_jax.a import f\n")
    (pkg / "a.py").write_text("from kdtree_jax.sub import b\ndef f():\n    pass\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kdtree_jax import a\n"
        "from kdtree_jax import _compiled_extension\ndef g():\n    from ..c import h\n")
    (pkg / "c.py").write_text("def h():\n    pass\n")
    graph = import_graph(pkg)
    assert graph["kdtree_jax.sub.b"] == {"kdtree_jax.c"}
    assert find_cycle(graph) is None
    (pkg / "c.py").write_text("def h():\n    from kdtree_jax.a import f\n")
    assert find_cycle(graph := import_graph(pkg)) == ["kdtree_jax.a", "kdtree_jax.sub.b", "kdtree_jax.c",
                                                      "kdtree_jax.a"], graph


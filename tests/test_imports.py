"""No import cycles among the modules of ``genlm.backend``.

The graph is read from the source with `ast`, not by importing: every ``import`` and
``from ... import`` at any depth (module level and inside functions, whose imports run
later but still tie the two modules together), plus the names a package ``__init__``
exports lazily (`genlm.backend._lazy.lazy_exports`); imports under ``if TYPE_CHECKING:``
never run and are left out. A plain module's lazy exports are older paths of names that
moved to a module built on it (SPEC's ``genlm.backend.llm.base.MockAsyncLM``): resolved
only when that path is used, after both modules are loaded, they are not edges;
`test_a_module_s_lazy_exports_are_aliases_resolved_on_use` checks that they stay so. An edge goes to the most specific module named (``from a
import b`` reaches module ``a.b`` when there is one), never to the parent packages that
Python also runs on the way.
"""

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "genlm.backend"


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` by dotted name (a package by its own)."""
    modules = {}
    for path in sorted((root / "genlm" / "backend").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield child
                yield from _nodes(child)
            continue
        yield node
        yield from _nodes(node)


def _absolute(name: str, level: int, module: str, is_package: bool) -> str:
    """The absolute name of a (possibly relative) import made in ``module``."""
    if not level:
        return name
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports, eagerly or not."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in _nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", node.level, module, is_package)
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif is_package:
            names.update(lazy_targets(node, module, is_package).values())
    edges = set()
    for name in names:
        while name and name not in modules:  # ``import a.b.c`` of an attribute path
            name = name.rpartition(".")[0]
        if name.startswith(PACKAGE) and name != module:
            edges.add(name)
    return edges


def lazy_targets(node: ast.AST, module: str, is_package: bool) -> dict[str, str]:
    """Name -> module of a ``lazy_exports(__name__, {...})`` call (else empty)."""
    if not (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "lazy_exports"
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Dict)
    ):
        return {}
    targets = {}
    for key, value in zip(node.args[1].keys, node.args[1].values, strict=True):
        assert isinstance(key, ast.Constant) and isinstance(value, ast.Constant)
        target = value.value
        level = len(target) - len(target.lstrip("."))
        targets[key.value] = _absolute(target.lstrip("."), level, module, is_package)
    return targets


def module_aliases(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """Per plain module (not a package), the names it exports lazily and their modules."""
    aliases = {}
    for module, path in module_files(root).items():
        if path.name == "__init__.py":
            continue
        for node in _nodes(ast.parse(path.read_text(), str(path))):
            aliases.setdefault(module, {}).update(lazy_targets(node, module, False))
    return {module: names for module, names in aliases.items() if names}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {module: imported(module, path, modules) for module, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module,
    written ``a -> b -> ... -> a`` as a list (Tarjan's algorithm, then a path inside)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, component) for component in sorted(components)]


def _cycle_in(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def test_the_package_has_no_import_cycles():
    found = [" -> ".join(cycle) for cycle in cycles(import_graph())]
    assert not found, "import cycles:\n" + "\n".join(found)


# -- the checker itself -------------------------------------------------------------------


def test_cycles_are_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_holds_every_kind_of_import(tmp_path):
    package = tmp_path / "genlm" / "backend"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": 'lazy_exports(__name__, {"Name": ".sub"})\n',
        "top.py": "import genlm.backend.sub.leaf\n",
        "other.py": "def later():\n    from .sub import leaf\n",
        "hidden.py": "if TYPE_CHECKING:\n    from genlm.backend import top\nelse:\n    x = 1\n",
        "sub/__init__.py": "from ..top import something\n",
        "sub/leaf.py": "from genlm.backend.sub import helper\nimport os\n",
        "alias.py": '__getattr__, _ = lazy_exports(__name__, {"Old": "genlm.backend.top"})\n',
    }
    for name, text in files.items():
        (package / name).write_text(text)
    assert import_graph(tmp_path) == {
        "genlm.backend": {"genlm.backend.sub"},
        "genlm.backend.top": {"genlm.backend.sub.leaf"},
        "genlm.backend.other": {"genlm.backend.sub.leaf"},
        "genlm.backend.hidden": set(),
        "genlm.backend.sub": {"genlm.backend.top"},
        "genlm.backend.sub.leaf": {"genlm.backend.sub"},
        "genlm.backend.alias": set(),
    }
    assert module_aliases(tmp_path) == {"genlm.backend.alias": {"Old": "genlm.backend.top"}}
    assert cycles(import_graph(tmp_path)) == [
        ["genlm.backend.sub", "genlm.backend.top", "genlm.backend.sub.leaf", "genlm.backend.sub"]
    ]


def test_the_graph_reads_the_package():
    """The edges of the two pairs that once closed cycles are seen, one way only."""
    graph = import_graph()
    assert "genlm.backend.kv.pool" in graph["genlm.backend.kv.store"]
    assert "genlm.backend.trie._draw" in graph["genlm.backend.trie.base"]
    assert "genlm.backend.kv.store" not in graph["genlm.backend.kv.pool"]
    assert "genlm.backend.trie.base" not in graph["genlm.backend.trie._draw"]


def test_a_module_s_lazy_exports_are_aliases_resolved_on_use():
    """Each name a plain module exports lazily is defined in a module that imports it (else a
    plain import would do), is not imported with it, and is the same object by both paths."""
    aliases = module_aliases()
    assert aliases == {"genlm.backend.llm.base": {"MockAsyncLM": "genlm.backend.llm.mock"}}
    graph = import_graph()
    for module, names in aliases.items():
        for name, target in names.items():
            assert module in graph[target]
            code = (
                f"import sys, {module} as m\n"
                f"assert {target!r} not in sys.modules\n"
                f"from {target} import {name} as defined\n"
                f"assert m.{name} is defined and {name!r} in dir(m)\n"
            )
            subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_vllm_package_gives_type_checkers_every_name_it_exports_lazily():
    """Each name of ``genlm.backend.llm.vllm``'s ``__all__`` resolves lazily and is imported,
    from the same module, under ``if TYPE_CHECKING:`` (else mypy sees it as ``Any``)."""
    path = ROOT / "genlm" / "backend" / "llm" / "vllm" / "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    exported, lazy, typed = set(), {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__":
            exported = set(ast.literal_eval(node.value))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
            lazy = ast.literal_eval(node.args[1])
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for imported_from in node.body:
                assert isinstance(imported_from, ast.ImportFrom)
                module = "." * imported_from.level + (imported_from.module or "")
                typed.update({alias.name: module for alias in imported_from.names})
    assert exported and set(lazy) == exported
    assert typed == lazy

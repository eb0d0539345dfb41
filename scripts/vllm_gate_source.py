"""Running pieces of a vLLM release without importing vLLM, for scripts/vllm_gate_probe.py
and scripts/vllm_gate_replay.py: stand-in packages, a module executed from its file, and
one function or method compiled alone from its module's source.

A compiled function gets only the globals it uses: those given (stand-ins for vLLM's
names), else what its module imports from outside vLLM (numpy, torch, the standard
library). A vLLM name it uses and is not given is an error that names it: the release's
code changed, and the gate needs a stand-in for the new name.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SamplingParams:
    """Stands in for ``vllm.SamplingParams``: the fields our processor (``extra_args``) and
    the replayed model-runner code read (the static checks confirm ``extra_args``)."""

    extra_args: dict | None = None
    temperature: float = 0.0
    max_tokens: int = 1


class MissingDefinition(LookupError):
    """The release has no such function or method (its message names file and name)."""


def stand_in_module(name: str, **attributes: object) -> types.ModuleType:
    """A stand-in module ``name`` (a package, so that submodules can sit under it)."""
    stand_in = types.ModuleType(name)
    stand_in.__path__ = []
    stand_in.__dict__.update(attributes)
    sys.modules[name] = stand_in
    return stand_in


def load_source(name: str, path: Path) -> types.ModuleType:
    """The module at ``path``, executed as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def definition(tree: ast.Module, qualname: str) -> ast.FunctionDef | None:
    """``function`` or ``Class.method`` at the top of ``tree``."""
    *owner, name = qualname.split(".")
    body: list[ast.stmt] = tree.body
    if owner:
        cls = next(
            (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner[0]), None
        )
        body = [] if cls is None else cls.body
    return next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Each name the module imports: (module, attribute, "" for the module itself)."""
    imported: dict[str, tuple[str, str]] = {}
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
            for alias in stmt.names:
                imported[alias.asname or alias.name] = (stmt.module, alias.name)
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                imported[alias.asname or alias.name.partition(".")[0]] = (
                    alias.name if alias.asname else alias.name.partition(".")[0],
                    "",
                )
    return imported


def _free_names(function: ast.FunctionDef) -> set[str]:
    """The globals ``function`` reads (builtins aside)."""
    local = {arg.arg for arg in ast.walk(function) if isinstance(arg, ast.arg)}
    local |= {
        node.id
        for node in ast.walk(function)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }
    local |= {node.name for node in ast.walk(function) if isinstance(node, ast.ExceptHandler)}
    loaded = {
        node.id
        for node in ast.walk(function)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }
    return loaded - local - set(dir(builtins))


def compiled_function(
    root: Path, relative: str, qualname: str, given: Mapping[str, object]
) -> types.FunctionType:
    """``qualname`` (``function`` or ``Class.method``) of the module at ``root / relative``,
    compiled alone, without its decorators and annotations (vLLM's types need not exist
    here), with the globals it reads (see the module doc). Raises `MissingDefinition`."""
    path = root / relative
    tree = ast.parse(path.read_text()) if path.is_file() else ast.Module([], [])
    function = definition(tree, qualname)
    if function is None:
        raise MissingDefinition(f"{relative} has no {qualname}")
    function.decorator_list, function.returns = [], None
    for node in ast.walk(function.args):
        if isinstance(node, ast.arg):
            node.annotation = None
    imported = _imports(tree)
    namespace: dict[str, object] = {"__name__": relative}
    for name in sorted(_free_names(function)):
        origin, attribute = imported.get(name, ("", ""))
        if name in given:
            namespace[name] = given[name]
        elif origin and origin.partition(".")[0] != "vllm":
            module = importlib.import_module(origin)
            namespace[name] = getattr(module, attribute) if attribute else module
        else:
            raise RuntimeError(
                f"{relative}:{qualname} now uses {name!r} ({origin or 'defined there'}): "
                "give the gate (scripts/vllm_gate_probe.py, vllm_gate_replay.py) a stand-in"
            )
    exec(compile(ast.Module([function], []), str(path), "exec"), namespace)
    compiled = namespace[function.name]
    assert isinstance(compiled, types.FunctionType)
    return compiled

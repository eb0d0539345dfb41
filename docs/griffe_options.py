"""A griffe extension (mkdocs.yml): the API pages show a constructor's option defaults as
declared (``batch_size: int = 20``), not the expression by which the constructor reads
them from the declaration (``batch_size: int = batch_size.default``), since an option's
default lives in its `genlm.backend.llm.options.Option` class attribute (or a backend's
``with_default`` of one)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import griffe


class OptionDefaults(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for cls in classes(pkg):
            init = cls.members.get("__init__")
            if not isinstance(init, griffe.Function):
                continue
            for parameter in init.parameters:
                declared = declared_default(cls, parameter.default)
                if declared is not None:
                    parameter.default = declared


def classes(scope: griffe.Object) -> Iterator[griffe.Class]:
    """The classes defined in a module or class, at any depth (not those imported)."""
    for member in scope.members.values():
        if isinstance(member, griffe.Module | griffe.Class):
            if isinstance(member, griffe.Class):
                yield member
            yield from classes(member)


def declared_default(cls: griffe.Class, default: Any) -> Any:
    """The default declared for the option that ``default`` reads (``option.default`` or
    ``SomeLM.option.default``), or None where it reads none."""
    if not isinstance(default, griffe.ExprAttribute) or str(default.last) != "default":
        return None
    *owner, name = [str(value) for value in default.values[:-1]]
    scope: Any = cls
    if owner:
        scope = cls.module.members.get(owner[0])
        scope = getattr(scope, "final_target", scope)
    if not isinstance(scope, griffe.Class) or name not in scope.all_members:
        return None
    option = scope.all_members[name]
    value = getattr(getattr(option, "final_target", option), "value", None)
    if not isinstance(value, griffe.ExprCall) or not value.arguments:
        return None
    function = str(value.function)
    if function == "Option" or function.endswith(".with_default"):
        return value.arguments[0]
    return None

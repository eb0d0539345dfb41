"""`Option`: an LM's constructor option, declared once, as a class attribute.

A declaration holds the option's default and its check (`genlm.backend.checks`); the
docstring under it is its doc, which the API docs render as the class's attribute. The
constructor's signature takes the declared default (``batch_size: int =
batch_size.default``), `takes_options` checks what the constructor is given before any
work, and `AsyncLM.check_constructor_options` checks ``from_name``'s options by the same
declarations before a model loads. On an LM, the option reads and assigns the value
where it lives (``at``: in the object that uses it, so an assignment takes effect where
the next batches read it), checked on assignment as the constructor checks it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast, overload

from genlm.backend.checks import OptionCheck

T = TypeVar("T")
Init = TypeVar("Init", bound=Callable[..., None])


class Option(Generic[T]):
    """A constructor option and the LM's attribute of that name.

    Args:
        default: the constructor's default.
        check: ``check(name, value)`` raises for a value the option does not take.
        at: where the value lives: ``"holder.attribute"`` paths from the LM (the
            batcher, the runner, the store: the first path is read, every path
            assigned), or None: in the LM itself (`takes_options` gives it the
            constructor's value).
        assignable: False for an option fixed at construction: an assignment raises
            ``AttributeError``.
    """

    def __init__(
        self,
        default: T,
        check: OptionCheck,
        *,
        at: str | tuple[str, ...] | None = None,
        assignable: bool = True,
    ):
        self.default = default
        self.check = check
        self.at = at
        self.paths = [path.split(".") for path in ((at,) if isinstance(at, str) else at or ())]
        self.assignable = assignable
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def with_default(self, default: T) -> Option[T]:
        """This option with another default (a backend's own)."""
        return Option(default, self.check, at=self.at, assignable=self.assignable)

    @overload
    def __get__(self, lm: None, owner: type) -> Option[T]: ...

    @overload
    def __get__(self, lm: object, owner: type | None = None) -> T: ...

    def __get__(self, lm: object | None, owner: type | None = None) -> Option[T] | T:
        if lm is None:
            return self
        if not self.paths:
            try:
                return cast(T, vars(lm)[self.name])
            except KeyError:  # a constructor without `takes_options`
                raise AttributeError(f"{self.name} is not set") from None
        holder, attribute = self.paths[0]
        return cast(T, getattr(getattr(lm, holder), attribute))

    def __set__(self, lm: object, value: T) -> None:
        if not self.assignable:
            raise AttributeError(
                f"{self.name} is fixed when {type(lm).__name__} is built: build a new one "
                f"with {self.name}={value!r}"
            )
        self.check(self.name, value)
        if not self.paths:
            vars(lm)[self.name] = value
        for holder, attribute in self.paths:
            setattr(getattr(lm, holder), attribute, value)


def declared_options(cls: type) -> dict[str, Option[Any]]:
    """The options ``cls`` declares or inherits, by name (a subclass's attribute of that
    name wins, and one that is not an `Option` removes it)."""
    options: dict[str, Option[Any]] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Option):
                options[name] = value
            else:
                options.pop(name, None)
    return options


def takes_options(init: Init) -> Init:
    """A constructor taking the class's declared options (`declared_options`): each is
    checked before any work, as an assignment checks it, and the LM given the values it
    holds itself (``at=None``); the constructor hands the others to the objects it builds
    (the batcher, the runner, the store)."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def taking(lm: Any, *args: Any, **kwargs: Any) -> None:
        try:
            arguments = signature.bind(lm, *args, **kwargs)
        except TypeError:  # a call the constructor refuses: its own error says why
            return init(lm, *args, **kwargs)
        arguments.apply_defaults()
        options = declared_options(type(lm))
        given = {name: v for name, v in arguments.arguments.items() if name in options}
        for name, value in given.items():
            options[name].check(name, value)
        for name, value in given.items():
            if not options[name].paths:
                vars(lm)[name] = value
        return init(lm, *args, **kwargs)

    return cast(Init, taking)

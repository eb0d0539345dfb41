"""Argument checks: what every constructor and option is refused with, and how it is said.

Each check raises before any work, in the caller's thread, with a message naming the
argument, the value given and what is allowed: ``TypeError`` for a value of the wrong
type (ints, budgets), ``ValueError`` for one out of range.

An `OptionCheck` is a check of one named option (``check(name, value)``); an LM declares
each of its options with one (`genlm.backend.llm.options.Option`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

# Seeds go to torch.Generator.manual_seed (and vLLM's sampler): signed 64-bit integers.
SEED_LIMIT = 2**63

OptionCheck = Callable[[str, Any], None]


def first_line(error: BaseException) -> str:
    """The first line of an error's message: how a refusal quotes the error underneath
    (loaders chain long explanations)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def check_int(name: str, value: Any, minimum: int = 0, optional: bool = False) -> None:
    """Raise ``TypeError`` unless ``value`` is an int (or None, if ``optional``; never a
    bool), and ``ValueError`` if it is below ``minimum``; the message names the argument."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_budget(name: str, value: Any) -> None:
    """A memory budget: an int number of bytes >= 0, or None for unbounded (a float such
    as nan, inf or 1.5e9, or a bool, is refused rather than rounded)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an int number of bytes >= 0 or None (unbounded), got "
            f"{type(value).__name__}: {value!r} (e.g. {name}=2 << 30 for 2 GiB)"
        )
    if value < 0:
        raise ValueError(
            f"{name} must be an int number of bytes >= 0 or None (unbounded), got {value}"
        )


def check_seconds(name: str, value: Any, optional: bool = True) -> None:
    """A duration: a finite number of seconds >= 0 (or None, if ``optional``), one that a
    float holds (an int such as ``10**400`` does not)."""
    if value is None and optional:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not _finite_float(value)
        or value < 0
    ):
        allowed = " or None" if optional else ""
        raise ValueError(f"{name} must be a finite number of seconds >= 0{allowed}, got {value!r}")


def _finite_float(value: numbers.Real) -> bool:
    """Whether ``value`` converts to a finite float (a huge int overflows it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    """``value`` is one of ``choices``."""
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_batching(batch_size: Any, timeout: Any) -> None:
    """An `AutoBatcher`'s ``batch_size`` (an int >= 1) and ``timeout`` (seconds or None)."""
    check_int("batch_size", batch_size, minimum=1)
    check_seconds("timeout", timeout)


# -- option checks (``check(name, value)``), as `Option` declarations take them ----------


def int_option(minimum: int = 0) -> OptionCheck:
    """An option that is an int >= ``minimum``."""

    def check(name: str, value: Any) -> None:
        check_int(name, value, minimum)

    return check


def choice_option(*choices: Any) -> OptionCheck:
    """An option that is one of ``choices``."""

    def check(name: str, value: Any) -> None:
        check_choice(name, value, choices)

    return check


def fraction_option(name: str, value: Any) -> None:
    """An option that is a share strictly between 0 and 1 (a finite real number)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not _finite_float(value)
        or not 0 < float(value) < 1
    ):
        raise ValueError(f"{name} must be a number strictly between 0 and 1, got {value!r}")


def dict_option(name: str, value: Any) -> None:
    """An option that is a dict of keyword arguments or None."""
    if value is not None and not isinstance(value, dict):
        raise TypeError(
            f"{name} must be a dict of keyword arguments or None, got "
            f"{type(value).__name__}: {value!r}"
        )

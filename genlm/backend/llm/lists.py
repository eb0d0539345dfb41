"""Handles for an `AsyncLM` subclass a user wrote for lists of token ids: each of its
methods that take token ids (`TOKEN_ID_METHODS`), unless marked `takes_handles`, gets a
handle's ids as ``list(h.ids)`` and the handle's adapter as ``lora_name``
(`AsyncLM.__init_subclass__` wraps them with `lists_for_handles`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from genlm.backend.llm.handle import PrefixHandle, takes_handles

if TYPE_CHECKING:
    from genlm.backend.llm.base import AsyncLM


# The methods that take token ids (True: a list of prefixes), where a user's subclass may
# get handles (`AsyncLM.__init_subclass__`).
TOKEN_ID_METHODS = {
    "next_token_logprobs": False,
    "next_token_logprobs_sync": False,
    "batch_next_token_logprobs": True,
    "batch_next_token_logprobs_sync": True,
    "sample": False,
    "batch_sample": True,
    "next_token_logprobs_uncached": False,
    "cache_kv": False,
    "walk_cache": False,
    "add_query": False,
}


def listed(ids: Sequence[int]) -> Any:
    """A handle's ids as a list (what a method written for lists gets), other ids as they are."""
    return list(ids.ids) if type(ids) is PrefixHandle else ids


def lists_for_handles(method: Callable[..., Any], batched: bool) -> Callable[..., Any]:
    """``method`` (of an `AsyncLM` subclass, taking token ids first, a list of prefixes if
    ``batched``) called with each handle among them as ``list(h.ids)`` and the handles'
    adapter as ``lora_name`` (`as_lists`)."""
    names = list(inspect.signature(method).parameters)
    first = names[1] if len(names) > 1 else None

    def converted(self: AsyncLM, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if args:
            value, rest = args[0], args[1:]
        elif first in kwargs:
            value, rest = kwargs.pop(first), ()
        else:
            return args
        value, lora = as_lists(self, value, kwargs.get("lora_name"), batched)
        if lora is not None:
            kwargs["lora_name"] = lora
        return (value, *rest)

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def wrapped_async(self: AsyncLM, *args: Any, **kwargs: Any) -> Any:
            return await method(self, *converted(self, args, kwargs), **kwargs)

        return takes_handles(wrapped_async)

    @functools.wraps(method)
    def wrapped(self: AsyncLM, *args: Any, **kwargs: Any) -> Any:
        return method(self, *converted(self, args, kwargs), **kwargs)

    return takes_handles(wrapped)


def as_lists(
    lm: AsyncLM, value: Any, lora_name: str | None, batched: bool
) -> tuple[Any, str | None]:
    """A method's token ids, for ``lm`` (``batched``: a list of prefixes) with each handle of this
    LM as ``list(h.ids)``, and the adapter the handles name (else ``lora_name``):
    ``ValueError`` for handles of another LM or of another adapter than ``lora_name``
    or each other's."""
    if not batched:
        if type(value) is not PrefixHandle:
            return value, lora_name
        return list(value.ids), lm._handle_lora(value, lora_name)
    if type(value) is not list and type(value) is not tuple:
        return value, lora_name
    handles = [ids for ids in value if type(ids) is PrefixHandle]
    if not handles:
        return value, lora_name
    loras = {lm._handle_lora(handle, lora_name) for handle in handles}
    if len(loras) > 1 or (len(handles) < len(value) and loras != {lora_name}):
        raise ValueError(
            f"{type(lm).__name__} takes one lora_name per batch: its handles name "
            f"{sorted(map(repr, loras))} and lora_name is {lora_name!r}; send a batch "
            "per adapter"
        )
    return [listed(ids) for ids in value], loras.pop()

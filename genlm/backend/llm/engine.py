"""`EngineLM`: what the backends over an external serving engine (vLLM, SGLang) share.

The engine keeps its own KV cache; on our side there is an optional `OutputCache` of
log-probabilities (keyed by `Query`: prefix and adapter) in front of the shared
`AutoBatcher`, and a closed state: after `cleanup` (or `close`) the engine is gone and
every call raises `RuntimeError`. Requests with a `PrefixHandle` pass the output cache by:
a key would keep the handle (and what it remembers) alive, and hashing its ids costs
what a handle saves; the engine's own prefix cache serves them.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from genlm.backend.cache import OutputCache
from genlm.backend.checks import dict_option, int_option
from genlm.backend.llm.base import BatchedAsyncLM
from genlm.backend.llm.handle import PrefixHandle, takes_handles
from genlm.backend.llm.options import Option
from genlm.backend.llm.request import Query


def check_cache_opts(name: str, value: Any) -> None:
    """Raise unless ``value`` is None or a dict of `OutputCache` options with valid values
    (``TypeError`` naming the option and the ones there are)."""
    dict_option(name, value)
    if value is None:
        return
    allowed = [key for key in inspect.signature(OutputCache).parameters if key != "maxsize"]
    for key in value:
        if key not in allowed:
            raise TypeError(f"{name}: OutputCache takes no option {key!r}; it takes: {allowed}")
    OutputCache(0, **value)  # checks the values, naming the option


class EngineLM(BatchedAsyncLM):
    """A `BatchedAsyncLM` over an engine object, with an output cache and `cleanup`.

    Subclasses implement `_compute_batch` (one engine call per batch) and
    `_stop_engine`. Their constructors take all their options (this class's too) with
    `takes_options`, which checks them first, before any work; this one checks none again.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        cache_size: as the option below.
        cache_opts: as the option below.
        batch_size: as `BatchedAsyncLM`'s option.
        timeout: as `BatchedAsyncLM`'s option.
        name: the batcher's worker thread name.
    """

    cache_size = Option(0, int_option(minimum=0), assignable=False)
    """Entries of the logprobs `OutputCache` (0: no cache). Fixed at construction."""

    cache_opts: Option[dict[str, Any] | None] = Option(None, check_cache_opts, assignable=False)
    """Keyword arguments for `OutputCache` (e.g. ``move_to_cpu``). Fixed at construction."""

    def __init__(
        self,
        tokenizer: Any,
        cache_size: int,
        cache_opts: dict[str, Any] | None,
        batch_size: int,
        timeout: float | None,
        name: str,
    ):
        self.output_cache = (
            OutputCache(cache_size, **(cache_opts or {})) if cache_size > 0 else None
        )
        self.batcher = self._make_batcher(batch_size, timeout, name)
        super().__init__(tokenizer)

    def _stop_engine(self) -> None:
        """Stop the engine and free its memory (called once, by `close`)."""
        raise NotImplementedError

    async def _answer(self, query: Query) -> torch.Tensor:
        """From the output cache, else auto-batched with concurrent requests (and cached)."""
        if self.output_cache is not None and self._cached(query):
            return self.output_cache[query].clone()  # the caller's own: its edits stay its own
        logprobs = await self.batcher.submit(query)
        self._cache_output(query, logprobs)
        return logprobs

    @takes_handles
    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking `next_token_logprobs` (consults and fills the cache)."""
        query = self._query(token_ids, lora_name)
        if self.output_cache is not None and self._cached(query):
            return self.output_cache[query].clone()
        logprobs = self._rows_sync([query])[0]
        self._cache_output(query, logprobs)
        return logprobs

    def _cached(self, query: Query) -> bool:
        """Whether the output cache holds the row of ``query`` (never one with a handle)."""
        cache = self.output_cache
        return cache is not None and type(query.token_ids) is not PrefixHandle and query in cache

    def _cache_output(self, query: Query, logprobs: torch.Tensor) -> None:
        """Cache a copy of the row (of its own: no batch storage kept; a caller's edit of the
        row it got does not reach the cache), unless its prefix is a handle."""
        if self.output_cache is not None and type(query.token_ids) is not PrefixHandle:
            self.output_cache[query] = logprobs.clone()

    def clear_cache(self) -> None:
        """Forget cached log-probabilities."""
        self._check_open()
        if self.output_cache is not None:
            self.output_cache.clear()

    def _clear_lora_results(self, lora_name: str) -> None:
        """Drop the cached results of one adapter (its weights were replaced or removed)."""
        if self.output_cache is not None:
            self.output_cache.discard(lambda query: query.lora == lora_name)

    def _close(self) -> None:
        self.batcher.close(self._closed_message())
        if self.output_cache is not None:
            self.output_cache.clear()
        self._stop_engine()

    def cleanup(self) -> None:
        """Stop the engine and free its memory: `close` under its older name."""
        self.close()

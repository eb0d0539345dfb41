"""`EngineLM`: what the backends over an external serving engine (vLLM, SGLang) share.

The engine keeps its own KV cache; on our side there is an optional `OutputCache` of
log-probabilities in front of the shared `AutoBatcher`, and a closed state: after
`cleanup` the engine is gone and every call raises `RuntimeError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from genlm.backend.batching import AutoBatcher
from genlm.backend.cache import OutputCache
from genlm.backend.llm.base import BatchedAsyncLM


class EngineLM(BatchedAsyncLM):
    """A `BatchedAsyncLM` over an engine object, with an output cache and `cleanup`.

    Subclasses implement `_process_batch` (one engine call per batch) and
    `_shutdown_engine`.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        cache_size: entries of the logprobs `OutputCache` (0: no cache).
        cache_opts: keyword arguments for `OutputCache` (e.g. ``move_to_cpu``).
        batch_size: most requests per batch of the `AutoBatcher`.
        timeout: longest wait (seconds) for a batch to fill while the event loop is busy.
        name: the batcher's worker thread name.
    """

    def __init__(
        self,
        tokenizer: Any,
        cache_size: int,
        cache_opts: dict[str, Any] | None,
        batch_size: int,
        timeout: float | None,
        name: str,
    ):
        super().__init__(tokenizer)
        self.cache = OutputCache(cache_size, **(cache_opts or {})) if cache_size > 0 else None
        self.batcher = AutoBatcher(self._process_batch, batch_size, timeout, name=name)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} used after cleanup(): the engine is gone")

    def _shutdown_engine(self) -> None:
        """Stop the engine and free its memory (called once, by `cleanup`)."""
        raise NotImplementedError

    async def next_token_logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Next-token log-probabilities, auto-batched with concurrent requests (cached)."""
        self._check_open()
        key = self.validate_token_ids(token_ids)
        if self.cache is not None and key in self.cache:
            return self.cache[key]
        logprobs = await self.batcher.submit(key)
        self._store(key, logprobs)
        return logprobs

    def next_token_logprobs_sync(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Blocking `next_token_logprobs` (consults and fills the cache)."""
        self._check_open()
        key = self.validate_token_ids(token_ids)
        if self.cache is not None and key in self.cache:
            return self.cache[key]
        logprobs = self._run_batch([key])[0]
        self._store(key, logprobs)
        return logprobs

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """One engine call for all prefixes, bypassing the cache: a ``[B, V]`` tensor."""
        self._check_open()
        return super().batch_next_token_logprobs_sync(token_ids_list)

    def _store(self, key: tuple[int, ...], logprobs: torch.Tensor) -> None:
        if self.cache is not None:
            self.cache[key] = logprobs.clone()

    def clear_cache(self) -> None:
        """Forget cached log-probabilities."""
        if self.cache is not None:
            self.cache.clear()

    def cleanup(self) -> None:
        """Stop the engine and free its memory. Idempotent; other calls then raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        self.batcher.close()
        self.clear_cache()
        self._shutdown_engine()

    def __enter__(self) -> EngineLM:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.cleanup()

    async def __aenter__(self) -> EngineLM:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.cleanup()

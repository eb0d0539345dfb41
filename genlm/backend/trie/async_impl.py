"""`AsyncTokenCharacterTrie`: concurrent ``await trie.weight_sum(ws)`` calls, batched.

Each particle of an SMC run awaits its own prefix weights; the shared
`genlm.backend.batching.AutoBatcher` gathers the concurrent requests into one
``batch_weight_sum`` (or ``batch_weight_max``) call that runs on a worker thread,
so the event loop keeps scheduling particles meanwhile. Each caller's row is a view of
the batch's result block, leased by the trie (`trie._results.ResultBlocks`): the block is
reused only once every caller has dropped its row and all views of it.

Lifecycle: `pause` stops the worker threads, which restart if the trie is used again
(`cleanup` and `shutdown`, the reference design's names, pause too); `close` (also run
by ``with`` / ``async with``) stops them for good: after it every method, the pausing
ones and `start` included, raises `RuntimeError`, as on every LM, and so do the awaits of
requests still queued at the close; only `close` itself may be called again, and does
nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from genlm.backend.batching import AutoBatcher
from genlm.backend.trie._weights import checked_weights
from genlm.backend.trie.base import TokenCharacterTrie

_BACKENDS = ("sequential", "parallel")
# What a call after `AsyncTokenCharacterTrie.close` is told (and a request waiting at it).
_CLOSED = (
    "AsyncTokenCharacterTrie used after close(): create a new one (pause(), cleanup() and "
    "shutdown() only pause it)"
)


@dataclass(frozen=True, slots=True, eq=False)
class _Request:
    """One caller's weights; hashed by identity, since arrays are not hashable by value."""

    ws: Any


class AsyncTokenCharacterTrie:
    """Asynchronous, auto-batched front end of a (sequential or parallel) trie.

    Args:
        trie: the `TokenCharacterTrie` or `ParallelTokenCharacterTrie` doing the work.
        batch_size: most distributions per batched call.
        timeout: longest wait (seconds) for a batch to fill while the loop stays busy.
    """

    def __init__(self, trie: TokenCharacterTrie, batch_size: int = 64, timeout: float = 0.02):
        if not isinstance(trie, TokenCharacterTrie):
            raise TypeError(
                f"trie must be a TokenCharacterTrie or ParallelTokenCharacterTrie, got "
                f"{type(trie).__name__} (to build one from a vocabulary: "
                "AsyncTokenCharacterTrie.from_vocab(vocab))"
            )
        self.trie = trie
        self._closed = False
        self._batchers = {
            name: AutoBatcher(
                self._batch_function(name), batch_size, timeout, name=f"genlm-trie-{name}"
            )
            for name in ("sum", "max")
        }

    @classmethod
    def from_vocab(
        cls, vocab: Sequence[Any], backend: str = "parallel", **kwargs: Any
    ) -> AsyncTokenCharacterTrie:
        """Build the trie for ``vocab`` (``backend`` "sequential" or "parallel") and wrap it.

        ``kwargs`` go to the trie (e.g. ``device`` for the parallel one).
        """
        if backend == "sequential":
            trie = TokenCharacterTrie(vocab, **kwargs)
        elif backend == "parallel":
            from genlm.backend.trie.parallel import ParallelTokenCharacterTrie

            trie = ParallelTokenCharacterTrie(vocab, **kwargs)
        else:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        return cls(trie)

    def _batch_function(self, name: str):
        def process(requests: list[_Request]) -> np.ndarray:
            method = getattr(self.trie, f"batch_weight_{name}")
            return method([request.ws for request in requests])

        return process

    def weight_sum(self, ws: Any) -> Coroutine[Any, Any, np.ndarray]:
        """`TokenCharacterTrie.weight_sum`, batched with concurrent calls (await the result).

        ``ws`` is read when called, not when the batch runs: changing it afterwards
        does not change the result.
        """
        return self._submit("sum", self._take(ws))

    def weight_max(self, ws: Any) -> Coroutine[Any, Any, np.ndarray]:
        """`TokenCharacterTrie.weight_max`, batched with concurrent calls (await the result).

        ``ws`` is read when called, as for `weight_sum`.
        """
        return self._submit("max", self._take(ws))

    def _take(self, ws: Any) -> Any:
        """A copy of checked weights (numpy copy, or a clone on the tensor's own device), or
        the error bad weights get: raised when awaited, to their caller alone."""
        try:
            ws = checked_weights(ws, len(self.trie.decode))
        except (TypeError, ValueError) as error:
            return error
        return ws.copy() if isinstance(ws, np.ndarray) else ws.detach().clone()

    async def _submit(self, name: str, ws: Any) -> np.ndarray:
        self._check_open()
        # Bad input fails its own caller here, not the whole batch it would have joined.
        if isinstance(ws, BaseException):
            raise ws
        return await self._batchers[name].submit(_Request(ws))

    def start(self) -> None:
        """Start the worker threads now rather than on the first request."""
        self._check_open()
        for batcher in self._batchers.values():
            batcher.run_sync(lambda: None)

    def pause(self) -> None:
        """Drop queued requests and stop the worker threads; they restart on demand."""
        self._check_open()
        self._stop_workers()

    async def cleanup(self) -> None:
        """`pause`, off the event loop (the reference design's name: it does not close)."""
        self._check_open()
        await asyncio.to_thread(self._stop_workers)

    def shutdown(self) -> None:
        """`pause` (the reference design's name: it does not close)."""
        self.pause()

    def close(self) -> None:
        """Stop the worker threads for good (idempotent); later calls raise `RuntimeError`."""
        if self._closed:
            return
        self._closed = True
        for batcher in self._batchers.values():
            batcher.close(_CLOSED)

    def _stop_workers(self) -> None:
        for batcher in self._batchers.values():
            batcher.pause()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(_CLOSED)

    def __enter__(self) -> AsyncTokenCharacterTrie:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    async def __aenter__(self) -> AsyncTokenCharacterTrie:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await asyncio.to_thread(self.close)

    @property
    def batch_sizes(self) -> list[int]:
        """Sizes of the latest batches (sums, then maxima; bounded), for monitoring."""
        return [*self._batchers["sum"].batch_sizes, *self._batchers["max"].batch_sizes]

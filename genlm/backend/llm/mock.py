"""`MockAsyncLM`: a stand-in LM for tests, with pseudo-random next-token distributions."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from genlm.backend.llm.base import BatchedAsyncLM
from genlm.backend.llm.handle import PrefixHandle, takes_handles
from genlm.backend.llm.options import takes_options
from genlm.backend.llm.request import Query


class MockAsyncLM(BatchedAsyncLM):
    """A stand-in LM with pseudo-random next-token distributions.

    The distribution is a pure function of ``token_ids`` and the adapter (the same in
    every process): a stable hash of the prefix (and of the adapter's name, for an
    adapter) picks one of a few fixed random log-probability tables and a cyclic shift
    of it. Any path registers as an adapter. Cheap enough to serve thousands of
    concurrent requests, for testing code built on `AsyncLM`.

    Each returned vector is a copy of its own: editing it changes nothing else.
    """

    NUM_TABLES = 8

    batch_size = BatchedAsyncLM.batch_size.with_default(64)

    @takes_options
    def __init__(
        self,
        tokenizer: Any,
        batch_size: int = batch_size.default,
        timeout: float | None = BatchedAsyncLM.timeout.default,
    ):
        self.batcher = self._make_batcher(batch_size, timeout, "genlm-mock")
        super().__init__(tokenizer)
        rng = np.random.default_rng(0)
        logits = torch.from_numpy(rng.standard_normal((self.NUM_TABLES, self.vocab_size)) * 3)
        tables = torch.log_softmax(logits.float(), dim=-1)
        # Each table twice in a row: any cyclic shift of it is a contiguous slice.
        self._tables = torch.cat([tables, tables], dim=1)

    @classmethod
    def from_name(cls, model_name: str, **kwargs: Any) -> MockAsyncLM:
        """Load only the tokenizer of ``model_name`` (a hub id, a local dir or a .gguf file)."""
        from genlm.backend.models import load_tokenizer

        cls.check_constructor_options(kwargs)
        return cls(load_tokenizer(model_name), **kwargs)

    def _logprobs(self, query: Query) -> torch.Tensor:
        """The query's row: a view of the tables (`_owned` copies a batch's rows)."""
        ids = query.token_ids
        if type(ids) is PrefixHandle:
            digest = _handle_digest(ids)
            if query.lora is not None:
                digest = digest.copy()
        else:
            digest = hashlib.blake2b(_id_bytes(ids), digest_size=8)
        if query.lora is not None:
            digest.update(b"\0lora:" + query.lora.encode("utf-8"))
        code = int.from_bytes(digest.digest(), "little")
        shift = (code // self.NUM_TABLES) % self.vocab_size
        start = self.vocab_size - shift  # torch.roll(table, shift) starts here
        return self._tables[code % self.NUM_TABLES, start : start + self.vocab_size]

    def _compute_batch(self, keys: list[Query]) -> list[torch.Tensor]:
        return [self._logprobs(key) for key in keys]

    @takes_handles
    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking `next_token_logprobs` (computed in the calling thread: it is cheap)."""
        return self._logprobs(self._query(token_ids, lora_name)).clone()

    def _load_lora(self, lora_path: str, lora_name: str) -> None:
        """Nothing to load: an adapter's distributions derive from its name."""


def _id_bytes(ids: Sequence[int]) -> bytes:
    """What the mock hashes of a prefix: its ids as little-endian int64s."""
    return np.asarray(ids, dtype="<i8").tobytes()


def _handle_digest(handle: PrefixHandle) -> Any:
    """The blake2b state of a handle's ids (`_id_bytes`), remembered in the handle (its
    ``memo``: ``(length, state)``, inherited by its extensions): from its parent's state,
    updated with its new ids alone, or from its ids where none was remembered."""
    memo = handle.memo
    length = len(handle)
    if type(memo) is tuple and memo[0] <= length:
        done, state = memo
        if done == length:
            return state
        state = state.copy()
        state.update(_id_bytes(handle[done:]))
    else:
        state = hashlib.blake2b(_id_bytes(handle.ids), digest_size=8)
    handle.memo = (length, state)
    return state

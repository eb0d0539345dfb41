"""`AsyncLM`, the interface every backend implements, and `MockAsyncLM`.

A backend provides ``next_token_logprobs`` (auto-batched, awaited by many
particles at once) and ``next_token_logprobs_sync``; this base class adds input
validation, batched variants, and ancestral sampling on top of them.
"""

from __future__ import annotations

import asyncio
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from genlm.backend.batching import AutoBatcher
from genlm.backend.tokenization import decode_vocab


class AsyncLM(ABC):
    """Asynchronous language model over a Hugging Face tokenizer.

    Attributes:
        tokenizer: the Hugging Face tokenizer object.
        byte_vocab: ``byte_vocab[i]`` is a `Token` with the exact bytes of token ``i``.
        str_vocab: ``str_vocab[i]`` is token ``i`` as a string.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_vocab, self.str_vocab = decode_vocab(tokenizer)

    @property
    def vocab_size(self) -> int:
        """Number of tokens: the length of every next-token log-probability vector."""
        return len(self.byte_vocab)

    def validate_token_ids(self, token_ids: Any) -> tuple[int, ...]:
        """Check a token-id prefix before any model work and return it as a tuple of ints.

        Raises ``ValueError`` for an empty prefix or an id outside ``[0, vocab_size)``,
        ``TypeError`` for a non-integer id; both name the offending id.
        """
        if isinstance(token_ids, torch.Tensor | np.ndarray):
            if token_ids.ndim != 1:
                raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
            token_ids = token_ids.tolist()
        if isinstance(token_ids, str | bytes):
            raise TypeError("token_ids must be a sequence of integer token ids, not a string")
        try:
            ids = tuple(token_ids)
        except TypeError:
            raise TypeError(
                f"token_ids must be a sequence of integer token ids, got {type(token_ids).__name__}"
            ) from None
        if not ids:
            raise ValueError("token_ids is empty: the model needs at least one token of context")
        vocab_size = self.vocab_size
        checked = []
        for position, token_id in enumerate(ids):
            if isinstance(token_id, bool) or not isinstance(token_id, int | np.integer):
                raise TypeError(
                    f"token id {token_id!r} at position {position} is not an integer "
                    f"({type(token_id).__name__})"
                )
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"token id {token_id} at position {position} is outside the vocabulary "
                    f"[0, {vocab_size})"
                )
            checked.append(int(token_id))
        return tuple(checked)

    @abstractmethod
    async def next_token_logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Log-probabilities of the next token after ``token_ids`` (1-D, normalized)."""

    @abstractmethod
    def next_token_logprobs_sync(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Blocking `next_token_logprobs`, without auto-batching."""

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Next-token log-probabilities for several prefixes: a ``[B, V]`` tensor."""
        rows = await asyncio.gather(*(self.next_token_logprobs(ids) for ids in token_ids_list))
        return torch.stack(rows)

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Blocking `batch_next_token_logprobs`."""
        return torch.stack([self.next_token_logprobs_sync(ids) for ids in token_ids_list])

    def clear_cache(self) -> None:
        """Forget cached results (no-op for backends without a cache)."""

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Load a LoRA adapter without activating it."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def set_lora(self, lora_path: str | None = None, lora_name: str = "lora_1") -> None:
        """Activate a previously added LoRA adapter."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def clear_lora(self) -> None:
        """Deactivate any LoRA adapter."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    async def sample(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[int]:
        """Ancestral sampling from the model.

        Stops at the first token in ``eos_token_ids`` (not included) or after
        ``max_tokens`` tokens. The same ``seed`` gives the same tokens.
        """
        check_sampling_args(max_tokens, temperature)
        context = list(self.validate_token_ids(prompt_token_ids))
        eos = set(eos_token_ids)
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        generated: list[int] = []
        for _ in range(max_tokens):
            logprobs = await self.next_token_logprobs(context)
            probs = torch.softmax(logprobs.float().cpu() / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator).item())
            if token in eos:
                break
            generated.append(token)
            context.append(token)
        return generated

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[Sequence[int]],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[list[int]]:
        """`sample` for several prompts at once (their steps are batched together)."""
        return list(
            await asyncio.gather(
                *(
                    self.sample(
                        prompt,
                        max_tokens,
                        eos_token_ids,
                        temperature,
                        None if seed is None else seed + i,
                    )
                    for i, prompt in enumerate(prompt_token_ids_list)
                )
            )
        )


def check_sampling_args(max_tokens: int, temperature: float) -> None:
    """Raise ValueError for a negative ``max_tokens`` or a non-positive ``temperature``."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


class BatchedAsyncLM(AsyncLM):
    """An `AsyncLM` whose requests all go through one `AutoBatcher`.

    Subclasses create ``self.batcher = AutoBatcher(self._process_batch, ...)`` and
    implement `_process_batch`; this class routes the public calls through it (the
    blocking ones run on the batcher's worker thread too, so they never race a batch).
    """

    batcher: AutoBatcher

    @abstractmethod
    def _process_batch(self, keys: list[Hashable]) -> Sequence[Any]:
        """The answers for ``keys`` (token-id tuples), in order, for one batch."""

    async def next_token_logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Next-token log-probabilities after ``token_ids``, batched with concurrent calls."""
        return await self.batcher.submit(self.validate_token_ids(token_ids))

    def next_token_logprobs_sync(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Blocking `next_token_logprobs` (a batch of one)."""
        return self._run_batch([self.validate_token_ids(token_ids)])[0]

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Blocking next-token log-probabilities for several prefixes, in one batch: ``[B, V]``."""
        keys = [self.validate_token_ids(token_ids) for token_ids in token_ids_list]
        if not keys:
            return torch.empty(0, self.vocab_size)
        return torch.stack(self._run_batch(keys))

    def _run_batch(self, keys: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """`_process_batch` on the distinct ``keys`` (worker thread, blocking), in ``keys`` order."""
        distinct = list(dict.fromkeys(keys))
        results = self.batcher.run_sync(self._process_batch, distinct)
        by_key = dict(zip(distinct, results, strict=True))
        return [by_key[key] for key in keys]

    def reset_async_queries(self) -> None:
        """Drop queued requests (after an aborted run); their callers get CancelledError."""
        self.batcher.reset()


class MockAsyncLM(BatchedAsyncLM):
    """A stand-in LM with pseudo-random next-token distributions.

    The distribution is a pure function of ``token_ids`` (the same in every
    process): a stable hash of the prefix picks one of a few fixed random
    log-probability tables and a cyclic shift of it. Cheap enough to serve
    thousands of concurrent requests, for testing code built on `AsyncLM`.

    Returned vectors are views of the shared tables (no copy per request): read
    them, do not modify them in place.
    """

    NUM_TABLES = 8

    def __init__(self, tokenizer: Any, batch_size: int = 64, timeout: float | None = 0.02):
        super().__init__(tokenizer)
        rng = np.random.default_rng(0)
        logits = torch.from_numpy(rng.standard_normal((self.NUM_TABLES, self.vocab_size)) * 3)
        tables = torch.log_softmax(logits.float(), dim=-1)
        # Each table twice in a row: any cyclic shift of it is a contiguous slice.
        self._tables = torch.cat([tables, tables], dim=1)
        self.batcher = AutoBatcher(self._process_batch, batch_size, timeout, name="genlm-mock")

    @classmethod
    def from_name(cls, model_name: str, **kwargs: Any) -> MockAsyncLM:
        """Load only the tokenizer of ``model_name`` (a hub id, a local dir or a .gguf file)."""
        from genlm.backend.models import load_tokenizer

        return cls(load_tokenizer(model_name), **kwargs)

    def _logprobs(self, token_ids: tuple[int, ...]) -> torch.Tensor:
        digest = hashlib.blake2b(np.asarray(token_ids, dtype="<i8").tobytes(), digest_size=8)
        code = int.from_bytes(digest.digest(), "little")
        shift = (code // self.NUM_TABLES) % self.vocab_size
        start = self.vocab_size - shift  # torch.roll(table, shift) starts here
        return self._tables[code % self.NUM_TABLES, start : start + self.vocab_size]

    def _process_batch(self, keys: list[Hashable]) -> list[torch.Tensor]:
        return [self._logprobs(key) for key in keys]

    def next_token_logprobs_sync(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Blocking `next_token_logprobs` (computed in the calling thread: it is cheap)."""
        return self._logprobs(self.validate_token_ids(token_ids))

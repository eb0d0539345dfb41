"""`AsyncLM`, the interface every backend implements, and `MockAsyncLM`.

A backend provides ``next_token_logprobs`` (auto-batched, awaited by many
particles at once) and ``next_token_logprobs_sync``; this base class adds input
validation (`genlm.backend.llm.request`), the LoRA adapter registry, batched variants,
ancestral sampling and the lifecycle (``close``, ``with`` / ``async with``) on top of them.

Adapters are chosen per request (``lora_name=``): every request becomes a `Query`,
its validated prefix plus the adapter that serves it (``None``: the base model), and
every cache of every backend is keyed by it, so a base-model row is never served for
an adapter or the reverse.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from genlm.backend.batching import AutoBatcher, BatchResults
from genlm.backend.checks import (
    SEED_LIMIT,
    OptionCheck,
    check_options,
    check_seconds,
    int_option,
)
from genlm.backend.llm.request import PrefixIndex, Query, TokenIds, checked_id, tuple_of_ids
from genlm.backend.tokenization import decode_vocab

R = TypeVar("R")


def check_vocab_fits(tokenizer_vocab: int, model_vocab: int) -> None:
    """Refuse a tokenizer that does not belong to the model: it has more tokens than the
    model has output rows, or far fewer (a model pads its output layer beyond its tokenizer
    by a little: at most max(128, 1%) rows here; Qwen2.5 pads 271 of 151,936)."""
    padding = model_vocab - tokenizer_vocab
    if padding < 0 or padding > max(128, model_vocab // 100):
        raise ValueError(
            f"The tokenizer has {tokenizer_vocab} tokens but the model's output layer "
            f"{model_vocab}: they do not belong together (pass the model's own tokenizer)"
        )


class AsyncLM(ABC):
    """Asynchronous language model over a Hugging Face tokenizer.

    Attributes:
        tokenizer: the Hugging Face tokenizer object.
        byte_vocab: ``byte_vocab[i]`` is a `Token` with the exact bytes of token ``i``.
        str_vocab: ``str_vocab[i]`` is token ``i`` as a string.
        default_lora: the adapter that serves ``lora_name=None`` (set by `set_lora`;
            ``None``: the base model).

    Class attributes:
        OPTION_CHECKS: a check per constructor option (`genlm.backend.checks`), run by
            `check_constructor_options` before any work, from the constructor and from
            ``from_name`` (before a model loads).
        max_temperature: the highest sampling temperature the backend accepts.
    """

    OPTION_CHECKS: ClassVar[Mapping[str, OptionCheck]] = {}
    max_temperature: ClassVar[float] = math.inf

    def __init__(self, tokenizer: Any):
        if tokenizer is None or isinstance(tokenizer, str | bytes | os.PathLike):
            raise TypeError(
                f"tokenizer must be a Hugging Face tokenizer object, got "
                f"{type(tokenizer).__name__}: {tokenizer!r} (to load a model or tokenizer by "
                f"name, use {type(self).__name__}.from_name or load_model_by_name)"
            )
        self.tokenizer = tokenizer
        self.byte_vocab, self.str_vocab = decode_vocab(tokenizer)
        # Fixed here: callers append to byte_vocab (an end-of-sequence symbol for a trie),
        # which must not let an id past the model's rows through validation.
        self._vocab_size = len(self.byte_vocab)
        self._prefixes = PrefixIndex(self._vocab_size)
        self.lora_paths: dict[str, str] = {}
        self.default_lora: str | None = None
        self._closed = False

    @property
    def vocab_size(self) -> int:
        """Number of tokens: the length of every next-token log-probability vector (the
        tokenizer's vocabulary at construction; later additions to ``byte_vocab`` do not count)."""
        return self._vocab_size

    @property
    def max_context_length(self) -> int | None:
        """Longest prefix the model accepts (``None``: no known limit)."""
        return None

    def validate_token_ids(self, token_ids: Any) -> TokenIds:
        """Check a token-id prefix before any model work and return it as a tuple of ints.

        Raises ``ValueError`` for an empty prefix, an id outside ``[0, vocab_size)`` or a
        prefix longer than the model's context; ``TypeError`` for a non-integer id or an
        unordered collection (a set or a dict); the message names the offending value.
        """
        if type(token_ids) is list or type(token_ids) is tuple:  # the usual case, checked first
            ids = token_ids
        else:
            ids = tuple_of_ids(token_ids)
        if not ids:
            raise ValueError("token_ids is empty: the model needs at least one token of context")
        limit = self.max_context_length
        if limit is not None and len(ids) > limit:
            raise ValueError(
                f"token_ids has {len(ids)} tokens, more than the model's context length of "
                f"{limit} tokens: shorten the prefix"
            )
        return self._prefixes.validated(ids)

    def check_eos_token_ids(self, eos_token_ids: Any) -> tuple[int, ...]:
        """End-of-sequence ids as a tuple of ints in ``[0, vocab_size)``, read once (a
        generator is consumed here, not once per prompt); ``TypeError``/``ValueError``
        naming a bad id."""
        if isinstance(eos_token_ids, str | bytes) or not hasattr(eos_token_ids, "__iter__"):
            raise TypeError(
                f"eos_token_ids must be a collection of token ids, got "
                f"{type(eos_token_ids).__name__}"
            )
        return tuple(
            checked_id(token_id, self.vocab_size, "eos token id") for token_id in eos_token_ids
        )

    def _query(self, token_ids: Any, lora_name: str | None = None) -> Query:
        """Validate a request before any model work: its prefix and the adapter serving it."""
        self._check_open()
        lora = self.resolve_lora(lora_name)
        return Query(self.validate_token_ids(token_ids), lora)

    def _query_list(self, token_ids_list: Any, lora_name: str | None = None) -> list[Query]:
        """`_query` for each prefix of a list (all are checked before any model work)."""
        if isinstance(token_ids_list, str | bytes | Set | Mapping) or not isinstance(
            token_ids_list, Sequence | torch.Tensor | np.ndarray
        ):
            raise TypeError(
                f"token_ids_list must be a list of token-id prefixes, got "
                f"{type(token_ids_list).__name__}"
            )
        self._check_open()
        lora = self.resolve_lora(lora_name)
        return [Query(self.validate_token_ids(ids), lora) for ids in token_ids_list]

    @abstractmethod
    async def next_token_logprobs(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token after ``token_ids`` (1-D, normalized)."""

    @abstractmethod
    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking `next_token_logprobs`, without auto-batching."""

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Next-token log-probabilities for several prefixes: a ``[B, V]`` tensor (``B`` may be 0)."""
        queries = self._query_list(token_ids_list, lora_name)
        if not queries:
            return torch.empty(0, self.vocab_size)
        return torch.stack(await asyncio.gather(*(self._answer(q) for q in queries)))

    async def _answer(self, query: Query) -> torch.Tensor:
        """`next_token_logprobs` of a query already validated by `_query`/`_query_list`
        (backends override it to skip the second check)."""
        return await self.next_token_logprobs(query.token_ids, lora_name=query.lora)

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking `batch_next_token_logprobs`: ``[B, V]``."""
        queries = self._query_list(token_ids_list, lora_name)
        if not queries:
            return torch.empty(0, self.vocab_size)
        return self._stacked_sync(queries)

    def _stacked_sync(self, queries: list[Query]) -> torch.Tensor:
        """`next_token_logprobs_sync` of validated queries, stacked (batched backends: one
        batch)."""
        return torch.stack(
            [self.next_token_logprobs_sync(q.token_ids, lora_name=q.lora) for q in queries]
        )

    def clear_cache(self) -> None:
        """Forget cached results (no-op for backends without a cache)."""
        self._check_open()

    # -- LoRA adapters ---------------------------------------------------------------------

    def resolve_lora(self, lora_name: str | None) -> str | None:
        """The adapter serving a request for ``lora_name`` (``None``: the default adapter).

        Raises ``ValueError`` for a name that was not registered with `add_new_lora`.
        """
        if lora_name is None:
            return self.default_lora
        if not isinstance(lora_name, str):
            raise TypeError(
                f"lora_name must be a str or None, got {type(lora_name).__name__}: {lora_name!r}"
            )
        if lora_name not in self.lora_paths:
            raise self._unknown_lora(lora_name)
        return lora_name

    def _unknown_lora(self, lora_name: Any) -> ValueError:
        return ValueError(
            f"Unknown LoRA adapter {lora_name!r}: register it first with "
            f"add_new_lora(lora_path, {lora_name!r}) (registered: {sorted(self.lora_paths)})"
        )

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Register the LoRA adapter at ``lora_path`` as ``lora_name`` (not made the default).

        Registering a name again replaces its weights and drops its cached results.
        """
        self._check_open()
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {lora_name!r}")
        self._load_lora(str(lora_path), lora_name)
        self.lora_paths[lora_name] = str(lora_path)

    def remove_lora(self, lora_name: str) -> None:
        """Unregister an adapter (``ValueError`` if unknown); later requests naming it fail."""
        self._check_open()
        if lora_name not in self.lora_paths:
            raise self._unknown_lora(lora_name)
        # Unregistered first: a request still queued for it then fails alone (`_serve_batch`).
        del self.lora_paths[lora_name]
        self._unload_lora(lora_name)
        if self.default_lora == lora_name:
            self.default_lora = None

    def set_lora(self, lora_path: str | None = None, lora_name: str = "lora_1") -> None:
        """Make ``lora_name`` the default adapter (registering ``lora_path`` first if given)."""
        self._check_open()
        if lora_path is not None:
            self.add_new_lora(lora_path, lora_name)
        self.default_lora = self.resolve_lora(lora_name)

    def clear_lora(self) -> None:
        """Make the base model the default again (adapters stay registered)."""
        self._check_open()
        self.default_lora = None

    def _load_lora(self, lora_path: str, lora_name: str) -> None:
        """Load (or replace) an adapter's weights and drop its cached results."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def _unload_lora(self, lora_name: str) -> None:
        """Free an adapter's weights and cached results."""

    # -- sampling ----------------------------------------------------------------------------

    async def sample(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        *,
        lora_name: str | None = None,
    ) -> list[int]:
        """Ancestral sampling from the model.

        Stops at the first token in ``eos_token_ids`` (not included), after ``max_tokens``
        tokens, or at the model's context length: the last token returned is the one sampled
        after a prefix of ``max_context_length`` tokens (a prompt longer than that is refused
        before any work). The same ``seed`` gives the same tokens.
        """
        check_sampling_args(max_tokens, temperature, seed, max_temperature=self.max_temperature)
        query = self._query(prompt_token_ids, lora_name)
        eos = frozenset(self.check_eos_token_ids(eos_token_ids))
        return await self._sample(query, max_tokens, eos, temperature, seed)

    async def _sample(
        self, query: Query, max_tokens: int, eos: frozenset[int], temperature: float, seed: Any
    ) -> list[int]:
        """`sample` with its arguments checked."""
        context = list(query.token_ids)
        limit = self.max_context_length
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(int(seed))
        generated: list[int] = []
        for _ in range(max_tokens):
            if limit is not None and len(context) > limit:
                break
            logprobs = await self.next_token_logprobs(context, lora_name=query.lora)
            token = sample_token(logprobs, temperature, generator)
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
        *,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        """`sample` for several prompts at once (their steps are batched together); prompt
        ``i`` uses the seed ``seed + i``."""
        queries = self._query_list(prompt_token_ids_list, lora_name)
        check_sampling_args(
            max_tokens, temperature, seed, len(queries), max_temperature=self.max_temperature
        )
        eos = frozenset(self.check_eos_token_ids(eos_token_ids))
        return list(
            await asyncio.gather(
                *(
                    self._sample(
                        query, max_tokens, eos, temperature, None if seed is None else seed + i
                    )
                    for i, query in enumerate(queries)
                )
            )
        )

    # -- lifecycle -----------------------------------------------------------------------------

    @classmethod
    def check_constructor_options(cls, options: Mapping[str, Any]) -> None:
        """Check constructor options before any work (``from_name``: before a model loads;
        the constructor: first): every option is a keyword of the constructor
        (``TypeError`` naming it and the ones there are), and each passes its check in
        `OPTION_CHECKS` (an error naming the option, the value and what is allowed)."""
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        parameters = {
            p.name
            for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind in named and p.default is not p.empty
        }
        for name in options:
            if name not in parameters:
                raise TypeError(
                    f"{cls.__name__} takes no option {name!r}; it takes: {sorted(parameters)}"
                )
        check_options(cls.OPTION_CHECKS, options)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"{type(self).__name__} used after cleanup() or close(): its worker thread "
                "and engine are gone; create a new one"
            )

    def close(self) -> None:
        """Stop worker threads and engines and free caches. Idempotent; later calls raise."""
        if self._closed:
            return
        self._closed = True
        self._close()

    def _close(self) -> None:
        """What `close` stops (called once)."""

    def __enter__(self) -> AsyncLM:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    async def __aenter__(self) -> AsyncLM:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or copied: it holds a model, caches and "
            "a worker thread. Send the model's name instead and load it in the other process "
            "(genlm.backend.load_model_by_name)"
        )


def check_sampling_args(
    max_tokens: Any,
    temperature: Any,
    seed: Any = None,
    seeds: int = 1,
    *,
    max_temperature: float = math.inf,
) -> None:
    """Raise for a ``max_tokens`` that is not an int >= 0, a ``temperature`` that is not a
    finite number in ``(0, max_temperature]``, or a ``seed`` that is not an int with
    ``seed + seeds - 1`` in ``[0, 2**63)``. Any finite temperature > 0 works with
    `sample_token`, which scales in float64, from the top; an engine's own sampler may accept
    fewer (`AsyncLM.max_temperature`)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int | np.integer):
        raise TypeError(f"max_tokens must be an int, got {type(max_tokens).__name__}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float | np.number):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and 0 < temperature <= max_temperature):
        allowed = "> 0" if max_temperature == math.inf else f"in (0, {max_temperature}]"
        raise ValueError(f"temperature must be a finite number {allowed}, got {temperature}")
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if not 0 <= seed <= SEED_LIMIT - max(seeds, 1):
        which = "" if seeds <= 1 else f" (prompt i uses seed + i, for {seeds} prompts)"
        raise ValueError(f"seed must be in [0, 2**63){which}, got {seed}")


def sample_token(logprobs: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """One token from ``softmax(logprobs / temperature)``. Scaled in float64 after subtracting
    the largest logprob, so the top token stays at 0 and a tiny temperature (down to the
    smallest positive float) gives the greedy token rather than inf or nan."""
    scores = logprobs.detach().double().cpu()
    probs = torch.softmax((scores - scores.max()) / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


class BatchedAsyncLM(AsyncLM):
    """An `AsyncLM` whose requests all go through one `AutoBatcher`.

    Subclasses create ``self.batcher = AutoBatcher(self._serve_batch, ...)`` and
    implement `_process_batch` over `Query` keys; this class routes the public calls
    through it (the blocking ones run on the batcher's worker thread too, so they never
    race a batch). `_serve_batch` answers a request whose adapter was removed while it
    waited with its own `ValueError`, so the rest of its batch is served.
    """

    batcher: AutoBatcher[Query, torch.Tensor]
    OPTION_CHECKS: ClassVar[Mapping[str, OptionCheck]] = {
        "batch_size": int_option(minimum=1),
        "timeout": check_seconds,
    }

    @abstractmethod
    def _process_batch(self, keys: list[Query]) -> BatchResults[torch.Tensor]:
        """The answers for distinct ``keys``, in order, for one batch."""

    async def next_token_logprobs(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Next-token log-probabilities after ``token_ids``, batched with concurrent calls."""
        return await self._answer(self._query(token_ids, lora_name))

    async def _answer(self, query: Query) -> torch.Tensor:
        return await self.batcher.submit(query)

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking `next_token_logprobs` (a batch of one)."""
        return self._run_batch([self._query(token_ids, lora_name)])[0]

    def _shared_rows(self, keys: list[Query]) -> BatchResults[torch.Tensor]:
        """`_process_batch`'s answers, which may be tensors a cache holds: for a caller
        that copies them (`batch_next_token_logprobs_sync` stacks them) and edits none."""
        return self._process_batch(keys)

    def _stacked_sync(self, queries: list[Query]) -> torch.Tensor:
        """One batch; its rows, as the cache holds them, stacked on the worker thread,
        where the batches' memory is allocated and freed: on a CPU the result then reuses
        memory the evicted batches freed, where the caller's thread page-faulted a fresh
        ``[B, V]`` tensor in most steps (6,112 faults, ~8 ms at 128 x 49k)."""
        return self.batcher.run_sync(self._answers, queries, self._shared_rows, torch.stack)

    def _serve_batch(
        self,
        keys: list[Query],
        process: Callable[[list[Query]], BatchResults[torch.Tensor]] | None = None,
    ) -> BatchResults[torch.Tensor]:
        """``process`` (default: `_process_batch`) on the keys whose adapter is still
        registered; the others get the unknown-adapter `ValueError` as their result (the
        batcher fails only them)."""
        process = process or self._process_batch
        served = {None, *self.lora_paths}
        gone = [getattr(key, "lora", None) not in served for key in keys]
        if not any(gone):
            return process(keys)
        kept = iter(process([key for key, g in zip(keys, gone, strict=True) if not g]))
        answers: list[Any] = [  # an exception is its caller's answer
            self._unknown_lora(key.lora) if g else next(kept)
            for key, g in zip(keys, gone, strict=True)
        ]
        return answers

    def _run_batch(
        self,
        keys: list[Query],
        process: Callable[[list[Query]], BatchResults[torch.Tensor]] | None = None,
    ) -> list[torch.Tensor]:
        """`_serve_batch` with ``process`` (default: `_process_batch`) on the distinct
        ``keys`` (worker thread, blocking), in ``keys`` order."""
        return self.batcher.run_sync(self._answers, keys, process, list)

    def _answers(
        self,
        keys: list[Query],
        process: Callable[[list[Query]], BatchResults[torch.Tensor]] | None,
        combine: Callable[[list[torch.Tensor]], R],
    ) -> R:
        """(Worker thread) `_serve_batch` on the distinct ``keys``, their answers in
        ``keys`` order passed to ``combine``; the first failed key's error raised."""
        distinct = list(dict.fromkeys(keys))
        results = self._serve_batch(distinct, process)
        answers = [results[i] for i in range(len(results))]
        if len(answers) != len(distinct):
            raise ValueError(
                f"{type(self).__name__} gave {len(answers)} answers to {len(distinct)} "
                "distinct requests"
            )
        for result in answers:
            if isinstance(result, BaseException):
                raise result
        if len(distinct) == len(keys):  # no key twice: the answers are in keys order
            return combine(answers)
        by_key = dict(zip(distinct, answers, strict=True))
        return combine([by_key[key] for key in keys])

    def reset_async_queries(self) -> None:
        """Drop queued requests (after an aborted run); their callers get CancelledError."""
        self._check_open()
        self.batcher.reset()

    def _close(self) -> None:
        self.batcher.close(for_good=True)


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

    def __init__(self, tokenizer: Any, batch_size: int = 64, timeout: float | None = 0.02):
        # the batcher checks batch_size and timeout: before the vocabulary is decoded
        self.batcher = AutoBatcher(self._serve_batch, batch_size, timeout, name="genlm-mock")
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
        digest = hashlib.blake2b(np.asarray(query.token_ids, dtype="<i8").tobytes(), digest_size=8)
        if query.lora is not None:
            digest.update(b"\0lora:" + query.lora.encode("utf-8"))
        code = int.from_bytes(digest.digest(), "little")
        shift = (code // self.NUM_TABLES) % self.vocab_size
        start = self.vocab_size - shift  # torch.roll(table, shift) starts here
        return self._tables[code % self.NUM_TABLES, start : start + self.vocab_size].clone()

    def _process_batch(self, keys: list[Query]) -> list[torch.Tensor]:
        return [self._logprobs(key) for key in keys]

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking `next_token_logprobs` (computed in the calling thread: it is cheap)."""
        return self._logprobs(self._query(token_ids, lora_name))

    def _load_lora(self, lora_path: str, lora_name: str) -> None:
        """Nothing to load: an adapter's distributions derive from its name."""

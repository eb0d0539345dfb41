"""`AsyncLM`, the interface every backend implements, and `BatchedAsyncLM`, whose requests
go through one auto-batcher: input validation, the LoRA registry, batched variants,
sampling and the lifecycle over a backend's ``next_token_logprobs``. Every request
becomes a `Query` (its validated prefix and the adapter serving it), the key of every
cache, so a base-model row is never served for an adapter or the reverse.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from genlm.backend._lazy import lazy_exports
from genlm.backend.batching import AutoBatcher, BatchResults
from genlm.backend.checks import check_seconds, int_option
from genlm.backend.llm.handle import (
    HandleOwner,
    PrefixHandle,
    handles_taken,
    new_handle,
    rebound,
    takes_handles,
)
from genlm.backend.llm.lists import TOKEN_ID_METHODS, listed, lists_for_handles
from genlm.backend.llm.options import Option, declared_options
from genlm.backend.llm.request import PrefixIndex, Query, TokenIds, checked_id, tuple_of_ids
from genlm.backend.sampling import check_sampling_args, sample_token, seeded_generator
from genlm.backend.tokenization import decode_vocab


class AsyncLM(ABC):
    """Asynchronous language model over a Hugging Face tokenizer.

    Attributes:
        tokenizer: the Hugging Face tokenizer object.
        byte_vocab: ``byte_vocab[i]`` is a `Token` with the exact bytes of token ``i``.
        str_vocab: ``str_vocab[i]`` is token ``i`` as a string.
        default_lora: the adapter that serves ``lora_name=None`` (set by `set_lora`;
            ``None``: the base model).

    Class attributes:
        max_temperature: the highest sampling temperature the backend accepts.

    A backend's constructor options are its `Option` attributes
    (`genlm.backend.llm.options`), each declared once with its default, check and doc.
    """

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
        self._handle_owner = HandleOwner(self, self._vocab_size)
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
        self._check_length(ids)
        return self._prefixes.validated(ids)

    def _check_length(self, ids: Sequence[Any]) -> None:
        """``ValueError`` for an empty prefix or one longer than the model's context."""
        if not ids:
            raise ValueError("token_ids is empty: the model needs at least one token of context")
        limit = self.max_context_length
        if limit is not None and len(ids) > limit:
            raise ValueError(
                f"token_ids has {len(ids)} tokens, more than the model's context length of "
                f"{limit} tokens: shorten the prefix"
            )

    def handle(self, token_ids: Sequence[int], *, lora_name: str | None = None) -> PrefixHandle:
        """A `PrefixHandle` of ``token_ids`` bound to the adapter ``lora_name`` (None: the
        default adapter, resolved when a request runs): the ids checked once, with a
        request's errors, so that requests with its extensions check only their new ids.
        A handle of this LM is returned as it is, or bound to ``lora_name`` if it was bound
        to none (its storage shared)."""
        self._check_open()
        if lora_name is not None:
            self.resolve_lora(lora_name)
        if type(token_ids) is PrefixHandle:  # a handle bound to none may be bound here
            bound = token_ids.lora_name
            self._handle_lora(token_ids, None if bound is None else lora_name)
            return rebound(token_ids, bound if lora_name is None else lora_name)
        if type(token_ids) is list or type(token_ids) is tuple:
            ids = token_ids
        else:
            ids = tuple_of_ids(token_ids)
        self._check_length(ids)
        return new_handle(self._handle_owner, self._prefixes.checked(ids), lora_name)

    def _handle_lora(self, handle: PrefixHandle, lora_name: str | None) -> str | None:
        """The adapter a request with ``handle`` names (None: the default): the handle's
        own. ``ValueError`` for a handle of another LM, or a ``lora_name`` other than None
        and the handle's."""
        owner = handle._owner
        if owner is not self._handle_owner:
            raise ValueError(
                f"{handle!r} was made by another LM ({owner.name}), not by this "
                f"{type(self).__name__} (object at {id(self):#x}): a handle serves the LM "
                "that made it; make one for this LM with its handle(list(h.ids))"
            )
        if lora_name is not None and lora_name != handle.lora_name:
            raise ValueError(
                f"lora_name={lora_name!r} contradicts the adapter of {handle!r}: pass "
                "lora_name=None (or the handle's own), or make a handle bound to "
                f"{lora_name!r} with handle(h, lora_name={lora_name!r})"
            )
        return handle.lora_name

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
        """Validate a request before any model work: its prefix (a handle of this LM as
        it is) and the adapter serving it."""
        self._check_open()
        if type(token_ids) is PrefixHandle:
            return Query(token_ids, self.resolve_lora(self._handle_lora(token_ids, lora_name)))
        lora = self.resolve_lora(lora_name)
        return Query(self.validate_token_ids(token_ids), lora)

    def _query_list(
        self, token_ids_list: Any, lora_name: str | None = None, name: str = "token_ids_list"
    ) -> list[Query]:
        """`_query` for each prefix of a list (all are checked before any model work);
        ``name``: the argument's, for the errors."""
        if isinstance(token_ids_list, str | bytes | Set | Mapping | PrefixHandle) or not isinstance(
            token_ids_list, Sequence | torch.Tensor | np.ndarray
        ):
            hint = "; for one handle, pass [h]" if isinstance(token_ids_list, PrefixHandle) else ""
            raise TypeError(
                f"{name} must be a list of token-id prefixes, got "
                f"{type(token_ids_list).__name__}{hint}"
            )
        if isinstance(token_ids_list, torch.Tensor | np.ndarray):
            shape = tuple(token_ids_list.shape)
            if len(shape) != 2 and shape != (0,):  # an empty 1-D one is an empty batch
                raise ValueError(
                    f"{name} must be a list of token-id prefixes (as a tensor or "
                    f"array: 2-D, one prefix per row), got a {type(token_ids_list).__name__} "
                    f"of shape {shape}; for one prefix, pass [token_ids]"
                )
        self._check_open()
        lora = self.resolve_lora(lora_name)
        return [
            self._query(ids, lora_name)
            if type(ids) is PrefixHandle
            else Query(self.validate_token_ids(ids), lora)
            for ids in token_ids_list
        ]

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
        (backends override it to skip the second check); a handle's ids as a list."""
        return await self.next_token_logprobs(listed(query.token_ids), lora_name=query.lora)

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
            [self.next_token_logprobs_sync(listed(q.token_ids), lora_name=q.lora) for q in queries]
        )

    def clear_cache(self) -> None:
        """Forget cached results (no-op for backends without a cache)."""
        self._check_open()

    @property
    def device(self) -> torch.device:
        """The device the returned log-probability rows are on: the CPU wherever rows come
        back to the host (the engines', the mock's, MLX's); a backend computing them on a
        device of its own says which."""
        return torch.device("cpu")

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
        # Unregistered first: a request still queued for it then fails alone (`_answer_batch`).
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
        """`sample` with its arguments checked. The context is a handle bound to the
        query's adapter, extended by each token drawn: a step sends only that token."""
        ids = query.token_ids
        if type(ids) is PrefixHandle:
            context = rebound(ids, query.lora)
        else:
            context = new_handle(self._handle_owner, ids, query.lora)
        limit = self.max_context_length
        generator = seeded_generator(seed)
        generated: list[int] = []
        for _ in range(max_tokens):
            logprobs = await self.next_token_logprobs(context)
            token = sample_token(logprobs, temperature, generator)
            if token in eos:
                break
            generated.append(token)
            if limit is not None and len(context) >= limit:
                break  # the next context would be longer than the model's
            context = context.extend((token,))
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
        queries = self._query_list(prompt_token_ids_list, lora_name, "prompt_token_ids_list")
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
        """Check constructor options before any work (``from_name``: before a model loads):
        each is one of the class's `Option` attributes (``TypeError`` naming it and the
        ones there are) and passes its check (an error naming the option, the value and
        what is allowed), as the constructor and an assignment check it."""
        declared = declared_options(cls)
        for name, value in options.items():
            if name not in declared:
                raise TypeError(
                    f"{cls.__name__} takes no option {name!r}; it takes: {sorted(declared)}"
                )
            declared[name].check(name, value)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(self._closed_message())

    def _closed_message(self) -> str:
        """What a call after `close` is told (and a request that still waited at it)."""
        return (
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

    # -- subclasses written for lists of token ids -----------------------------------------------

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Each method of ``cls`` that takes token ids (`TOKEN_ID_METHODS`) and is not
        marked `takes_handles` (one a user wrote for lists) gets each handle as
        ``list(h.ids)``, bound to the handle's adapter (`lists_for_handles`)."""
        super().__init_subclass__(**kwargs)
        for name, batched in TOKEN_ID_METHODS.items():
            method = cls.__dict__.get(name)
            if inspect.isfunction(method) and not handles_taken(method):
                setattr(cls, name, lists_for_handles(method, batched))


def owned_rows(rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of each row with storage of its own (a caller that keeps one row keeps its
    own floats, not its batch's), in one fused op: ``torch._foreach_mul`` by 1, exact for
    every float (NaN and -0.0 included), allocates each output itself (on CUDA from the
    caching allocator, no kernel) and copies them all in one multi-tensor kernel per
    chunk of rows (torch has no out-of-place ``_foreach_copy``). Same-dtype rows on one
    device."""
    return list(torch._foreach_mul(list(rows), 1.0)) if rows else []


class BatchedAsyncLM(AsyncLM):
    """An `AsyncLM` whose requests all go through one `AutoBatcher`.

    Subclasses create their batcher with `_make_batcher` (callers of the same prefix in one
    batch each get a row of their own) and implement `_compute_batch` over distinct `Query`
    keys; this class
    routes the public calls through it (the blocking ones run on the batcher's worker
    thread too, so they never race a batch). `_answer_batch` answers a request whose
    adapter was removed while it waited with its own `ValueError`, so the rest of its batch
    is served.
    """

    batcher: AutoBatcher[Query, torch.Tensor]

    batch_size = Option(20, int_option(minimum=1), at="batcher.batch_size")
    """Most distinct requests per batch (an int >= 1). Assignable: the batches formed
    after it hold at most the new number."""

    timeout: Option[float | None] = Option(0.02, check_seconds, at="batcher.timeout")
    """Longest wait (seconds) for a batch to fill while the event loop stays busy (None:
    until it is full or the loop idles). Assignable: it applies from the next batch that
    starts gathering."""

    @abstractmethod
    def _compute_batch(self, keys: list[Query]) -> BatchResults[torch.Tensor]:
        """The rows of distinct ``keys`` (each served by a registered adapter), in order,
        for one batch, as computed (views of one batch, rows a cache keeps): `_owned`
        makes them the callers' own."""

    def _make_batcher(
        self, batch_size: int, timeout: float | None, name: str
    ) -> AutoBatcher[Query, torch.Tensor]:
        """The batcher of this LM's requests (it checks ``batch_size`` and ``timeout``): it
        calls `_answer_batch`, and gives the second and later callers of a key in one batch
        copies of their row (`owned_rows`)."""
        return AutoBatcher(
            self._answer_batch, batch_size, timeout, name=name, copy_results=owned_rows
        )

    def _owned(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """`_compute_batch`'s rows as the callers' own: copies with storage of their own
        (`owned_rows`, one fused op), so that a row edited in place changes nothing the LM
        keeps nor another caller's row, and a row a caller keeps holds only its own floats."""
        return owned_rows(rows)

    @takes_handles
    async def next_token_logprobs(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Next-token log-probabilities after ``token_ids``, batched with concurrent calls."""
        return await self._answer(self._query(token_ids, lora_name))

    async def _answer(self, query: Query) -> torch.Tensor:
        return await self.batcher.submit(query)

    @takes_handles
    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking `next_token_logprobs` (a batch of one)."""
        return self._rows_sync([self._query(token_ids, lora_name)])[0]

    def _answer_batch(self, keys: list[Query], owned: bool = True) -> list[Any]:
        """(Worker thread; the batcher's function) each distinct key's answer, in order: its
        row from `_compute_batch`, made the callers' own unless not ``owned`` (for a caller
        that copies them and edits none), or for a key whose adapter was removed while it
        waited, the unknown-adapter `ValueError` (the batcher fails only its callers)."""
        served = {None, *self.lora_paths}
        kept = [key for key in keys if key.lora in served]
        results = self._compute_batch(kept) if kept else []
        if len(results) != len(kept):
            raise ValueError(
                f"{type(self).__name__} gave {len(results)} answers to {len(kept)} "
                "distinct requests"
            )
        rows = [results[i] for i in range(len(kept))]
        if owned:
            rows = self._owned(rows)
        if len(kept) == len(keys):
            return rows
        computed = iter(rows)
        return [
            next(computed) if key.lora in served else self._unknown_lora(key.lora) for key in keys
        ]

    def _rows_in_order(self, keys: list[Query], owned: bool) -> list[torch.Tensor]:
        """(Worker thread) `_answer_batch` on the distinct ``keys``, their rows in ``keys``
        order; the first failed key's error raised."""
        distinct = list(dict.fromkeys(keys))
        answers = self._answer_batch(distinct, owned)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        if len(distinct) == len(keys):
            return answers
        by_key = dict(zip(distinct, answers, strict=True))
        return [by_key[key] for key in keys]

    def _rows_sync(self, keys: list[Query]) -> list[torch.Tensor]:
        """The rows of ``keys`` (repeats allowed) in one batch, blocking, the callers' own."""
        return self.batcher.run_sync(self._rows_in_order, keys, True)

    def _stacked_sync(self, queries: list[Query]) -> torch.Tensor:
        """One batch, its rows stacked on the worker thread (`_stacked`)."""
        return self.batcher.run_sync(self._stacked, queries)

    def _stacked(self, queries: list[Query]) -> torch.Tensor:
        """(Worker thread) the rows of ``queries`` as computed, stacked: the stack is their
        one copy, made where the batches' memory is allocated and freed (on a CPU it then
        reuses memory the evicted batches freed; benchmark/bench_host.py)."""
        return torch.stack(self._rows_in_order(queries, False))

    def reset_async_queries(self) -> None:
        """Drop queued requests (after an aborted run); their callers get CancelledError."""
        self._check_open()
        self.batcher.reset()

    def _close(self) -> None:
        self.batcher.close(self._closed_message())


# SPEC's path of the mock LM, which `genlm.backend.llm.mock` builds on this module to define:
# resolved on first use, so importing this module does not import the mock.
__getattr__, __dir__ = lazy_exports(__name__, {"MockAsyncLM": "genlm.backend.llm.mock"})
if TYPE_CHECKING:
    from genlm.backend.llm.mock import MockAsyncLM as MockAsyncLM

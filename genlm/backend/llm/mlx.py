"""`AsyncMlxLM`: the `AsyncLM` interface on an mlx-lm model (Apple silicon, or Linux CPU).

Requests are auto-batched by the shared `AutoBatcher`. A batch runs as mlx-lm's own
batch generator does: each row's cached KV state is merged into one left-padded batch
cache (``KVCache.merge``), the new tokens but the last are right-padded and prefilled
(``prepare``/``finalize`` move the padding to the left), and one more forward pass on
every row's last token gives the next-token logits. The batch cache handles the
attention mask and the RoPE offset of each row. Each row's KV state is then extracted
into a `DynamicTokenTrie` node, so a later request only runs the tokens past its deepest
cached prefix; at most ``cache_size`` KV states are kept, evicting the least recently used.

LoRA adapters are loaded by mlx-lm itself (``mlx_lm.tuner.utils.load_adapters``: an
``adapter_config.json`` and ``adapters.safetensors`` directory, as ``mlx_lm.lora`` writes)
into a copy of the model that holds the very same base weight arrays, so an adapter costs
only its own low-rank matrices. Each adapter has its own prefix tree (all under the same
``cache_size`` budget), so a row is only ever reused for the adapter it was computed with;
a batch mixing adapters runs one batched forward per adapter.

mlx streams belong to the thread that created them, so every MLX graph is built and
evaluated on the batcher's single worker thread (the blocking calls and adapter loading go
through `AutoBatcher.run_sync` too); the model's weights are evaluated up front.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from genlm.backend.batching import AutoBatcher
from genlm.backend.cache import DynamicTokenTrie
from genlm.backend.llm.base import BatchedAsyncLM, Query

MLX_INSTALL_HINT = "pip install 'genlm-backend[mlx]'"


def _import_mlx() -> Any:
    """Import and return ``mlx.core``, with an install hint when mlx or mlx-lm is missing."""
    try:
        import mlx.core as mx
        import mlx_lm  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"AsyncMlxLM needs the mlx and mlx-lm packages: {MLX_INSTALL_HINT}"
        ) from error
    return mx


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside an mlx-lm ``TokenizerWrapper`` (or ``tokenizer`` itself).

    Written against mlx-lm 0.32.2, whose wrapper keeps it in the private ``_tokenizer``
    attribute and has no public accessor.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def _share_weights_copy(model: Any) -> Any:
    """A copy of an mlx-lm model's modules that holds the very same arrays (none is copied).

    Adapter layers can then be swapped into the copy without touching the original.
    """
    mx = _import_mlx()
    shared = {}
    for _, module in model.named_modules():
        for value in (*module.values(), *vars(module).values()):
            if isinstance(value, mx.array):
                shared[id(value)] = value
    return copy.deepcopy(model, shared)


def _prefix_cache_supported(model: Any) -> bool:
    """Whether every layer of the model keeps a plain, full-history ``KVCache``.

    Only those states can be cut out of a batch and extended later by any request
    sharing the prefix; sliding-window, quantized or recurrent caches cannot.
    """
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    return all(type(layer) is KVCache for layer in make_prompt_cache(model))


class AsyncMlxLM(BatchedAsyncLM):
    """Asynchronous, auto-batched mlx-lm model with a prefix cache of KV states.

    Args:
        mlx_lm_model: a model from ``mlx_lm.load``.
        tokenizer: its tokenizer (mlx-lm's ``TokenizerWrapper`` or the Hugging Face one).
        batch_size: most requests per forward pass.
        timeout: longest wait (seconds) for a batch to fill while the event loop is busy.
        prefill_step_size: most tokens per row fed to the model in one prefill pass.
        cache_size: most prefixes whose KV state (and logprobs) are kept, LRU (0: none),
            over every adapter's prefix tree together.
        max_kv_bytes: optional cap on the bytes of cached KV state, LRU.
    """

    def __init__(
        self,
        mlx_lm_model: Any,
        tokenizer: Any,
        batch_size: int = 5,
        timeout: float | None = 0.001,
        prefill_step_size: int = 2048,
        cache_size: int = 400,
        max_kv_bytes: float | None = None,
    ):
        mx = _import_mlx()
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        super().__init__(_hf_tokenizer(tokenizer))
        self.mlx_tokenizer = tokenizer
        self.model = mlx_lm_model
        self.prefill_step_size = prefill_step_size
        self.cache_size = cache_size
        self.max_kv_bytes = max_kv_bytes
        mx.eval(mlx_lm_model.parameters())
        self.prefix_caching = _prefix_cache_supported(mlx_lm_model)
        if not self.prefix_caching:
            warnings.warn(
                f"{type(mlx_lm_model).__module__}: the model's cache layers cannot be reused "
                "across requests; prefix (KV) caching is disabled and every request runs "
                "its whole prefix.",
                stacklevel=2,
            )
        self._adapters: dict[str, Any] = {}  # adapter name -> model holding its LoRA layers
        self._reset_trie()
        self.batcher = AutoBatcher(self._serve_batch, batch_size, timeout, name="genlm-mlx")

    @classmethod
    def from_name(cls, model_name: str, **kwargs: Any) -> AsyncMlxLM:
        """Load ``model_name`` (a local directory or hub id) with ``mlx_lm.load``.

        The weights keep the dtype they are stored in; ``kwargs`` go to the constructor.
        """
        _import_mlx()
        import mlx_lm

        model, tokenizer = mlx_lm.load(model_name)[:2]
        return cls(model, tokenizer, **kwargs)

    @property
    def cache(self) -> DynamicTokenTrie:
        """The base model's prefix tree (each adapter has its own, under the same budget)."""
        return self._roots[None]

    def walk_cache(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> tuple[DynamicTokenTrie, int, list[Any] | None, int]:
        """Follow ``token_ids`` down the prefix tree of adapter ``lora_name``.

        Returns ``(node, next_token_index, past, base)``: the deepest node reached, the
        number of tokens it covers, and the KV state (one mlx-lm ``KVCache`` per layer)
        of the deepest node on that path holding one, covering ``token_ids[:base]``
        (``None`` and 0 when there is none).
        """
        ids, lora = self.query(token_ids, lora_name)
        return self.batcher.run_sync(self._walk_cache, ids, lora)

    def _walk_cache(
        self, ids: tuple[int, ...], lora: str | None
    ) -> tuple[DynamicTokenTrie, int, list[Any] | None, int]:
        node, next_token_index = self._root(lora).walk(ids)
        kv_node = node.nearest_kv()
        if kv_node is None:
            return node, next_token_index, None, 0
        return node, next_token_index, kv_node.past_key_values, kv_node.depth

    def cache_kv(
        self, prompt_tokens: Sequence[int], *, lora_name: str | None = None
    ) -> DynamicTokenTrie:
        """Compute the KV state of ``prompt_tokens`` under adapter ``lora_name`` and pin it
        (never evicted until `clear_cache`, or until the adapter is registered again)."""
        query = self.query(prompt_tokens, lora_name)
        if not self.prefix_caching:
            raise RuntimeError(
                "cache_kv needs prefix caching, which is disabled for this model's cache layers"
            )
        return self.batcher.run_sync(self._cache_kv, query)

    def _cache_kv(self, query: Query) -> DynamicTokenTrie:
        root = self._root(query.lora)
        node, depth = root.walk(query.token_ids)
        if depth == len(query.token_ids) and node.past_key_values is not None:
            node.set_past_key_values(node.past_key_values, pinned=True)
            return node
        (logprobs,), (past,) = self._forward([query], keep_kv=True)
        node = root.extend_cache(0, query.token_ids, None)
        node.set_logprobs(logprobs)
        node.set_past_key_values(past, pinned=True)
        return node

    def clear_cache(self) -> None:
        """Forget every cached KV state and logprobs (pinned ones included), of every adapter."""
        self.batcher.run_sync(self._reset_trie)

    def _reset_trie(self) -> None:
        # On the worker thread, so a batch never sees the trees swapped under it.
        base = DynamicTokenTrie(
            max_kv_entries=self.cache_size,
            max_kv_bytes=self.max_kv_bytes,
            max_logprobs_entries=self.cache_size,
        )
        self._roots: dict[str | None, DynamicTokenTrie] = {None: base}

    def _root(self, lora: str | None) -> DynamicTokenTrie:
        """The prefix tree of one adapter (created on first use, under the shared budget)."""
        root = self._roots.get(lora)
        if root is None:
            root = self._roots[lora] = DynamicTokenTrie(share_budgets_with=self.cache)
        return root

    def _drop_tree(self, lora: str) -> None:
        root = self._roots.pop(lora, None)
        if root is not None:
            root.clear()

    # -- LoRA ----------------------------------------------------------------------------------

    def _load_lora(self, lora_path: str, lora_name: str) -> None:
        """Load an mlx-lm adapter directory (``adapter_config.json``, ``adapters.safetensors``)."""
        self.batcher.run_sync(self._load_adapter, lora_path, lora_name)

    def _unload_lora(self, lora_name: str) -> None:
        self.batcher.run_sync(self._delete_adapter, lora_name)

    def _load_adapter(self, lora_path: str, lora_name: str) -> None:
        from mlx_lm.tuner.utils import load_adapters

        mx = _import_mlx()
        model = load_adapters(_share_weights_copy(self.model), lora_path)
        model.eval()
        mx.eval(model.parameters())
        self._adapters[lora_name] = model
        self._drop_tree(lora_name)

    def _delete_adapter(self, lora_name: str) -> None:
        del self._adapters[lora_name]
        self._drop_tree(lora_name)

    def _model(self, lora: str | None) -> Any:
        """The model serving adapter ``lora`` (``None``: the base model)."""
        if lora is None:
            return self.model
        model = self._adapters.get(lora)
        if model is None:  # removed while its request waited in the queue
            raise self._unknown_lora(lora)
        return model

    # -- batch evaluation (runs on the batcher's worker thread) --------------------------------

    def _process_batch(self, queries: list[Query]) -> list[torch.Tensor | None]:
        """Answer distinct queries from their adapter's cache or batched forward passes
        (every entry is filled)."""
        results: list[torch.Tensor | None] = [None] * len(queries)
        missing = []
        for i, (ids, lora) in enumerate(queries):
            node, depth = self._root(lora).walk(ids)
            if depth == len(ids) and node.logprobs is not None:
                node.touch()
                results[i] = node.logprobs
            else:
                missing.append(i)
        if missing:
            rows = [queries[i] for i in missing]
            keep_kv = self.prefix_caching and self.cache_size > 0
            logprobs, pasts = self._forward(rows, keep_kv)
            for i, query, row_logprobs, past in zip(missing, rows, logprobs, pasts, strict=True):
                results[i] = row_logprobs
                self._store(query, row_logprobs, past)
        return results

    def _store(self, query: Query, logprobs: torch.Tensor, past: list[Any] | None) -> None:
        if self.cache_size == 0:
            return
        node = self._root(query.lora).extend_cache(0, query.token_ids, None)
        node.set_logprobs(logprobs)
        if past is not None and node.past_key_values is None:
            node.set_past_key_values(past)

    def _forward(
        self, rows: list[Query], keep_kv: bool
    ) -> tuple[list[torch.Tensor], list[list[Any] | None]]:
        """Next-token logprobs of each row, reusing cached prefixes of its adapter; with
        ``keep_kv`` also each row's whole KV state (one ``KVCache`` per layer).

        One batched forward per adapter (row by row for cache layers that cannot merge).
        """
        mx = _import_mlx()
        starts = [self._start(query) for query in rows]
        by_adapter: dict[str | None, list[int]] = {}
        for i, query in enumerate(rows):
            by_adapter.setdefault(query.lora, []).append(i)
        if all(hasattr(layer, "merge") for layer in starts[0][0]):
            groups = list(by_adapter.items())
        else:
            groups = [(lora, [i]) for lora, same in by_adapter.items() for i in same]
        logprobs: list[torch.Tensor] = [None] * len(rows)  # type: ignore[list-item]
        pasts: list[list[Any] | None] = [None] * len(rows)
        for lora, group in groups:
            cache = self._batch_cache([starts[i][0] for i in group])
            model = self._model(lora)
            group_logprobs = self._run(mx, model, cache, [starts[i][1] for i in group])
            kept = []
            if keep_kv:
                kept = [[layer.extract(j) for layer in cache] for j in range(len(group))]
            mx.eval(group_logprobs, [[(c.keys, c.values) for c in row] for row in kept])
            array = np.array(group_logprobs)
            for j, i in enumerate(group):
                logprobs[i] = torch.from_numpy(array[j].copy())
                if keep_kv:
                    pasts[i] = kept[j]
        return logprobs, pasts

    def _start(self, query: Query) -> tuple[list[Any], list[int]]:
        """A row's starting cache (its adapter's deepest cached prefix, else empty) and the
        tokens to run."""
        from mlx_lm.models.cache import make_prompt_cache

        ids = query.token_ids
        if self.prefix_caching:
            # Look only above the last token: it always runs, so its logits come out.
            kv_node = self._root(query.lora).walk(ids[:-1])[0].nearest_kv()
            if kv_node is not None:
                kv_node.touch()
                return kv_node.past_key_values, list(ids[kv_node.depth :])
        return make_prompt_cache(self.model), list(ids)

    @staticmethod
    def _batch_cache(row_caches: list[list[Any]]) -> list[Any]:
        """One batch cache per layer, merging the rows' states (left-padded to a common length)."""
        if len(row_caches) == 1 and not hasattr(row_caches[0][0], "merge"):
            return row_caches[0]  # a fresh single-row cache that cannot be merged
        return [type(layers[0]).merge(list(layers)) for layers in zip(*row_caches, strict=True)]

    def _run(self, mx: Any, model: Any, cache: list[Any], new_tokens: list[list[int]]) -> Any:
        """Prefill every row's new tokens but the last through ``model``, then return
        ``[B, V]`` next-token logprobs."""
        heads = [tokens[:-1] for tokens in new_tokens]
        lengths = [len(head) for head in heads]
        width = max(lengths)
        if width > 0:
            padding = [width - length for length in lengths]
            tokens = mx.array([head + [0] * pad for head, pad in zip(heads, padding, strict=True)])
            if max(padding) > 0:
                for layer in cache:
                    layer.prepare(lengths=lengths, right_padding=padding)
            for start in range(0, width, self.prefill_step_size):
                model(tokens[:, start : start + self.prefill_step_size], cache=cache)
                mx.eval([layer.state for layer in cache])
            if max(padding) > 0:
                for layer in cache:
                    layer.finalize()
        last = mx.array([[row[-1]] for row in new_tokens])
        logits = model(last, cache=cache)[:, -1, :].astype(mx.float32)
        vocab_size = self.vocab_size
        if logits.shape[-1] < vocab_size:
            raise RuntimeError(
                f"the model has {logits.shape[-1]} output logits, fewer than the "
                f"{vocab_size} tokens of its tokenizer"
            )
        logits = logits[:, :vocab_size]
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

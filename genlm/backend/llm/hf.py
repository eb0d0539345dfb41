"""`AsyncTransformer`: a Hugging Face transformers causal LM behind the `AsyncLM` interface.

Many particles await ``next_token_logprobs`` on prefixes that share most of their
tokens. Requests are auto-batched (`AutoBatcher`) and each batch does, per group
of rows that need the same number ``t`` of new tokens:

1. walk the prefix tree (`DynamicTokenTrie`) to the deepest node holding KV
   along the request, or below its end (a descendant's KV starts with it);
2. gather the rows' past KV into one buffer
   ``[layers, 2 (K/V), rows, kv_heads, past + t, head_dim]`` (left-padded to the
   longest past; the padding is zeroed and masked);
3. run ONE forward over the ``rows x t`` new tokens with explicit position ids and
   a 4-D mask (none when nothing is padded); a small `Cache` writes the new KV
   straight into the buffer, so there is no per-layer ``torch.cat``;
4. apply the LM head at the last position only (``logits_to_keep=1``), keep the
   tokenizer's ``len(byte_vocab)`` columns and ``log_softmax`` them (float32);
5. store at each request's node its logprobs (a row of the batch's ``[rows, V]``
   block) and its KV: a view of its buffer row covering the whole prefix.

Design choices (measured with benchmark/bench_lm.py, SmolLM2-135M, CPU):

- Full-prefix KV views, not per-node segments. A particle extending its context by
  one token needs one contiguous copy of its row (O(L): the same work as the
  ``torch.cat`` of a hand-written ``DynamicCache`` loop) rather than a concatenation
  of one segment per ancestor (a Python loop over L nodes per row per step, which
  dominates in long runs). Views cost no copy; the budget charges each buffer once,
  whole (padding included), and frees it when the last node viewing it goes.
- Once a row has run on an ancestor's KV, that ancestor's KV is dropped: the new
  node's KV starts with it, and step 1 finds it there for a later sibling. So a
  particle population holds one KV copy per particle (like the hand-written loop),
  not one per step, and the previous step's buffer is released at once.
- Released buffers are recycled (`_BufferPool`): fresh multi-megabyte allocations
  are served by new zero-filled pages, which cost as much as the KV copy itself.
- Rows are grouped by ``t`` so no query row is padded (the usual step has ``t = 1``
  for everyone; a fresh prompt or a recomputed prefix forms its own group), hence
  no fully-masked attention rows and no NaNs from them.
- Memory: before allocating a buffer, least recently used KV is evicted to make
  room for it and free pooled buffers are trimmed, so KV memory stays within
  ``max_kv_bytes`` (plus, briefly, evicted KV still being copied from). Prompts
  pinned with `cache_kv` are outside the budget.

LoRA adapters (peft) are chosen per request. Each adapter has its own prefix tree (all
under the same budgets), and rows of several adapters share one forward: peft's
mixed-adapter batches (``adapter_names=``) add each row's own low-rank update to the
shared base matmuls (``lora_batching="grouped"`` runs one forward per adapter instead;
measured slower, see benchmark/bench_lm.py ``--loras``).

Models whose cache is not a plain stack of same-shaped full-attention layers
(sliding windows, recurrent states, layers on several devices, ...) or whose
attention is neither ``sdpa`` nor ``eager`` still work, without KV reuse: each
request then runs its whole prefix.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from genlm.backend.batching import AutoBatcher, check_int
from genlm.backend.cache import DynamicTokenTrie
from genlm.backend.llm.base import BatchedAsyncLM, Query

# peft's name for "no adapter" in a mixed-adapter batch.
BASE_ADAPTER = "__base__"
LORA_BATCHING = ("mixed", "grouped")

DEFAULT_MAX_KV_BYTES = 1 << 30
DEFAULT_MAX_LOGPROBS_BYTES = 256 << 20
_DTYPE_NAMES = {
    "float": torch.float32,
    "float32": torch.float32,
    "fp32": torch.float32,
    "half": torch.float16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class _KVLayout:
    """Shape of the model's KV state: the same for every layer."""

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class _Row:
    """One request in a batch: run ``ids[start:]`` on top of ``past`` (KV of ``ids[:start]``)."""

    slot: int | None
    ids: tuple[int, ...]
    lora: str | None
    node: DynamicTokenTrie
    start: int
    past: torch.Tensor | None
    source: DynamicTokenTrie | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.ids) - self.start


class _BufferLayer(DynamicLayer):
    """A cache layer over preallocated ``[rows, heads, past + t, dim]`` views: update writes in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, past_length: int):
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.past_length = past_length
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.past_length + key_states.shape[-2]
        self.keys[:, :, self.past_length : end].copy_(key_states)
        self.values[:, :, self.past_length : end].copy_(value_states)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.past_length


class _BufferPool:
    """Recycles KV buffers released by the cache, so steady decoding does not page-fault.

    A fresh multi-megabyte ``torch.empty`` is served by new zero-filled pages, which
    costs as much as the forward's own KV copy; reusing a buffer released a step or
    two earlier costs nothing. New buffers get 25% headroom, so they stay reusable for
    a while as contexts grow, and a free buffer is reused for requests from half its
    size up, only when nothing else (a node, a pending batch, a caller) views it.
    """

    HEADROOM = 1.25

    def __init__(self, max_buffers: int = 4):
        self.max_buffers = max_buffers
        self.free: list[torch.Tensor] = []
        self._own_uses = self._uses(torch.empty(1))

    @staticmethod
    def _uses(flat: torch.Tensor) -> int | None:
        """References to the buffer's memory (None if this torch cannot tell: no reuse)."""
        count = getattr(torch._C, "_storage_Use_Count", None)
        return None if count is None else count(flat.untyped_storage()._cdata)

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = torch.Size(shape).numel()
        fits = [
            i
            for i, flat in enumerate(self.free)
            if numel <= flat.numel() <= 2 * numel and (flat.dtype, flat.device) == (dtype, device)
        ]
        for i in sorted(fits, key=lambda i: self.free[i].numel()):
            flat = self.free[i]
            if self._own_uses is not None and self._uses(flat) == self._own_uses:
                del self.free[i]
                return flat[:numel].view(shape)
        size = int(numel * self.HEADROOM)
        return torch.empty(size, dtype=dtype, device=device)[:numel].view(shape)

    def give(self, kv: torch.Tensor) -> None:
        """Take back the buffer behind ``kv`` (a view of a buffer from `take`) for reuse."""
        storage = kv.untyped_storage()
        flat = torch.empty(0, dtype=kv.dtype, device=kv.device)
        flat.set_(storage, 0, (storage.nbytes() // kv.element_size(),))
        self.free.append(flat)
        del self.free[: -self.max_buffers]

    def trim(self, max_bytes: float) -> None:
        """Drop free buffers (oldest first) until they take at most ``max_bytes``."""
        while self.free and sum(flat.nbytes for flat in self.free) > max_bytes:
            del self.free[0]


def _buffer_cache(buffer: torch.Tensor, past_length: int) -> Cache:
    """A transformers `Cache` whose layers write into ``buffer[layer, 0 / 1]``."""
    return Cache(
        layers=[_BufferLayer(layer[0], layer[1], past_length) for layer in buffer.unbind(0)]
    )


def _normalize_dtype(opts: dict[str, Any]) -> None:
    """Accept ``torch_dtype`` or ``dtype``, as a `torch.dtype` or a name; store it as ``dtype``."""
    if "torch_dtype" in opts:
        if "dtype" in opts:
            raise ValueError("hf_opts sets both 'dtype' and 'torch_dtype'; pass only one")
        opts["dtype"] = opts.pop("torch_dtype")
    dtype = opts.get("dtype")
    if isinstance(dtype, str) and dtype != "auto":
        name = dtype.removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise ValueError(
                f"Unknown dtype {dtype!r}; use a torch.dtype, 'auto' or one of {sorted(_DTYPE_NAMES)}"
            )
        opts["dtype"] = _DTYPE_NAMES[name]


class AsyncTransformer(BatchedAsyncLM):
    """A transformers causal LM with auto-batching and a prefix tree of cached KV and logprobs.

    Returned log-probability vectors are shared with the cache (a row of a batch's
    block): read them, do not modify them in place.

    Args:
        hf_model: an ``AutoModelForCausalLM`` (put in eval mode).
        hf_tokenizer: its tokenizer.
        batch_size: most requests per batch.
        timeout: longest wait (seconds) for a batch to fill while the event loop is busy.
        max_kv_bytes: budget for cached KV states (least recently used evicted first;
            prompts pinned with `cache_kv` are outside it).
        max_logprobs_bytes: budget for cached next-token log-probabilities.
        max_batch_tokens: most new tokens run in one forward (larger groups are split,
            a longer prefix is prefilled in chunks).
        lora_batching: ``"mixed"`` (rows of several LoRA adapters in one forward) or
            ``"grouped"`` (one forward per adapter).
    """

    def __init__(
        self,
        hf_model: Any,
        hf_tokenizer: Any,
        batch_size: int = 20,
        timeout: float | None = 0.02,
        max_kv_bytes: int | None = DEFAULT_MAX_KV_BYTES,
        max_logprobs_bytes: int | None = DEFAULT_MAX_LOGPROBS_BYTES,
        max_batch_tokens: int = 4096,
        lora_batching: str = "mixed",
    ):
        check_int("max_kv_bytes", max_kv_bytes, optional=True)
        check_int("max_logprobs_bytes", max_logprobs_bytes, optional=True)
        check_int("max_batch_tokens", max_batch_tokens, minimum=1)
        if lora_batching not in LORA_BATCHING:
            raise ValueError(f"lora_batching must be one of {LORA_BATCHING}, got {lora_batching!r}")
        super().__init__(hf_tokenizer)
        self.model = hf_model.eval()
        model_vocab = self.model.get_output_embeddings().weight.shape[0]
        if model_vocab < self.vocab_size:
            raise ValueError(
                f"The tokenizer has {self.vocab_size} tokens but the model's output layer only "
                f"{model_vocab}: they do not belong together"
            )
        self.max_kv_bytes = max_kv_bytes
        self.max_logprobs_bytes = max_logprobs_bytes
        self.max_batch_tokens = max_batch_tokens
        self.lora_batching = lora_batching
        self._pool = _BufferPool()
        self._peft: Any = None  # the peft model wrapping self.model, once an adapter is loaded
        self._peft_names: dict[str, str] = {}  # adapter name -> its name inside peft
        self._adapter_ids = itertools.count()
        self._reset_trie()
        self.batcher = AutoBatcher(self._process_batch, batch_size, timeout, name="genlm-hf")
        self._input_device = self.model.get_input_embeddings().weight.device
        self._layout, reason = self._probe_kv_layout()
        if self._layout is None:
            warnings.warn(
                f"KV reuse is off for this model ({reason}): every request runs its whole prefix",
                stacklevel=2,
            )
        self._queries: list[Query] = []

    @classmethod
    def from_name(
        cls,
        model_id: str,
        bitsandbytes_opts: dict[str, Any] | None = None,
        hf_opts: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncTransformer:
        """Load a tokenizer and ``AutoModelForCausalLM`` from a hub id, a local directory or a ``.gguf`` file.

        Args:
            model_id: what to load.
            bitsandbytes_opts: keyword arguments of ``transformers.BitsAndBytesConfig``
                (e.g. ``{"load_in_8bit": True}``); needs the ``bnb`` extra.
            hf_opts: keyword arguments for ``from_pretrained``; defaults ``device_map="auto"``
                and ``dtype="auto"`` (``torch_dtype`` is accepted too, as a dtype or a name
                such as ``"float32"`` or ``"bfloat16"``).
            **kwargs: passed to `AsyncTransformer` (``batch_size``, ``max_kv_bytes``, ...).
        """
        from transformers import AutoModelForCausalLM

        from genlm.backend.models import gguf_from_pretrained_args, load_tokenizer

        opts = dict(hf_opts or {})
        _normalize_dtype(opts)
        opts = {"device_map": "auto", "dtype": "auto", **opts}
        if bitsandbytes_opts is not None:
            try:
                import bitsandbytes  # noqa: F401
            except ImportError as error:
                raise ImportError(
                    "bitsandbytes_opts needs bitsandbytes: pip install 'genlm-backend[bnb]'"
                ) from error
            from transformers import BitsAndBytesConfig

            opts["quantization_config"] = BitsAndBytesConfig(**bitsandbytes_opts)
        path, gguf = gguf_from_pretrained_args(model_id)
        tokenizer = load_tokenizer(model_id)
        model = AutoModelForCausalLM.from_pretrained(path, **gguf, **opts)
        return cls(model, tokenizer, **kwargs)

    # -- public API ---------------------------------------------------------------------------

    @property
    def max_context_length(self) -> int | None:
        """The model's ``max_position_embeddings`` (None if its config has none)."""
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    @property
    def cache(self) -> DynamicTokenTrie:
        """The base model's prefix tree (each adapter has its own, under the same budgets)."""
        return self._roots[None]

    def next_token_logprobs_uncached(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Reference answer: one plain forward of the whole prefix, no cache of any kind."""
        ids, lora = self.query(token_ids, lora_name)
        return self.batcher.run_sync(self._uncached, ids, lora)

    def cache_kv(self, prompt_tokens: Sequence[int], *, lora_name: str | None = None) -> None:
        """Compute and pin the KV of ``prompt_tokens``: it stays until a cache clear."""
        ids, lora = self.query(prompt_tokens, lora_name)
        self.batcher.run_sync(self._cache_kv, ids, lora)

    def walk_cache(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> tuple[DynamicTokenTrie, int, torch.Tensor | None, int]:
        """Where a request for ``token_ids`` would start: ``(node, next_token_index, past, base)``.

        ``node`` holds the KV used (the root if none), ``base`` is its depth (the tokens its
        KV covers), ``past`` is that KV cut to ``token_ids[:next_token_index]`` (shape
        ``[layers, 2, kv_heads, next_token_index, head_dim]``, or None) and
        ``next_token_index`` is the first token still to run (at most ``len - 1``: the last
        token always runs, to get the logits).
        """
        ids, lora = self.query(token_ids, lora_name)
        return self.batcher.run_sync(self._walk_cache, ids, lora)

    def add_query(self, token_ids: Sequence[int], *, lora_name: str | None = None) -> int:
        """Queue a prefix for `batch_evaluate_queries`; returns its position in the queue."""
        self._queries.append(self.query(token_ids, lora_name))
        return len(self._queries) - 1

    def batch_evaluate_queries(self) -> list[torch.Tensor]:
        """Evaluate every queued prefix in one batch (blocking); empties the queue."""
        queries, self._queries = self._queries, []
        return self._run_batch(queries) if queries else []

    def clear_cache(self) -> None:
        """Forget all cached logprobs and KV (pinned prompts included)."""
        self.batcher.run_sync(self._reset_trie)

    def clear_kv_cache(self) -> None:
        """Forget all cached KV (pinned prompts included), keep the logprobs."""
        self.batcher.run_sync(self._clear_kv)

    def reset_async_queries(self) -> None:
        """Drop queued requests after an aborted run (their callers get ``CancelledError``)."""
        super().reset_async_queries()
        self._queries = []

    @property
    def kv_nbytes(self) -> int:
        """Bytes of cached (unpinned) KV."""
        return self.cache.kv_nbytes

    # -- LoRA ----------------------------------------------------------------------------------

    def _load_lora(self, lora_path: str, lora_name: str) -> None:
        try:
            import peft  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "LoRA adapters need peft: pip install 'genlm-backend[lora]'"
            ) from error
        self.batcher.run_sync(self._load_adapter, lora_path, lora_name)

    def _unload_lora(self, lora_name: str) -> None:
        self.batcher.run_sync(self._delete_adapter, lora_name)

    def _load_adapter(self, lora_path: str, lora_name: str) -> None:
        # peft sees its own names: a user's name may hold "." (not a module name), be
        # "__base__", or be part of peft's "lora_" prefix, which peft misreads.
        import peft

        if lora_name in self._peft_names:
            self._delete_adapter(lora_name)
        peft_name = f"genlm{next(self._adapter_ids)}"
        if self._peft is None:
            self._peft = peft.PeftModel.from_pretrained(
                self.model, lora_path, adapter_name=peft_name
            ).eval()
        else:
            self._peft.load_adapter(lora_path, adapter_name=peft_name)
            self._peft.eval()
        self._peft_names[lora_name] = peft_name

    def _delete_adapter(self, lora_name: str) -> None:
        peft_name = self._peft_names.pop(lora_name)
        if not self._peft_names:
            # peft cannot serve with no adapter left: restore the plain model (in place).
            self._peft.unload()
            self._peft = None
        else:
            with warnings.catch_warnings():
                # Which adapter peft calls "active" is moot: every forward names its adapters.
                warnings.filterwarnings("ignore", "Adapter .* was active which is now deleted")
                self._peft.delete_adapter(peft_name)
        root = self._roots.pop(lora_name, None)
        if root is not None:
            root.clear()

    def _forward(self, loras: Sequence[str | None], **kwargs: Any) -> Any:
        """The model's forward for rows served by ``loras`` (one adapter name or None per row)."""
        if self._peft is None:
            return self.model(**kwargs)
        names = [BASE_ADAPTER if lora is None else self._peft_names[lora] for lora in loras]
        return self._peft(**kwargs, adapter_names=names)

    # -- batch evaluation (runs on the batcher's worker thread) --------------------------------

    def _reset_trie(self) -> None:
        base = DynamicTokenTrie(
            max_kv_bytes=self.max_kv_bytes,
            max_logprobs_bytes=self.max_logprobs_bytes,
            on_kv_release=self._pool.give,
        )
        self._roots: dict[str | None, DynamicTokenTrie] = {None: base}
        self._pool.free.clear()

    def _root(self, lora: str | None) -> DynamicTokenTrie:
        """The prefix tree of one adapter (created on first use, under the shared budgets)."""
        root = self._roots.get(lora)
        if root is None:
            root = self._roots[lora] = DynamicTokenTrie(share_budgets_with=self.cache)
        return root

    def _clear_kv(self) -> None:
        for root in self._roots.values():
            root.clear_kv_cache()

    def _process_batch(self, keys: list[Query]) -> list[torch.Tensor]:
        results: list[Any] = [None] * len(keys)
        with torch.inference_mode(), ExitStack() as holds:
            for lora in {key.lora for key in keys}:
                holds.enter_context(self._root(lora).deferred_pruning())
            rows = []
            for slot, (ids, lora) in enumerate(keys):
                node, depth = self._root(lora).walk(ids)
                if depth == len(ids) and node.logprobs is not None:
                    node.touch(ancestors=False)
                    results[slot] = node.logprobs
                else:
                    rows.append(self._plan(slot, ids, lora, node))
            if self._layout is None:
                self._run_without_kv(rows, results)
            else:
                for group in self._groups(rows):
                    self._run_group(group, results)
        return results

    def _plan(
        self, slot: int | None, ids: tuple[int, ...], lora: str | None, node: DynamicTokenTrie
    ) -> _Row:
        """Find the deepest usable KV for ``ids`` and what remains to run (``node``: the
        deepest node on the path of ``ids`` in the tree of adapter ``lora``)."""
        kv_node = node.nearest_kv()
        if kv_node is not node and node.depth > 0:
            kv_node = self._kv_below(node) or kv_node
        start = 0 if kv_node is None else min(kv_node.depth, node.depth, len(ids) - 1)
        if not start or self._layout is None:
            return _Row(slot, ids, lora, node, 0, None)
        kv_node.touch(ancestors=False)
        past = kv_node.past_key_values[:, :, :, :start]
        return _Row(slot, ids, lora, node, start, past, kv_node)

    @staticmethod
    def _kv_below(node: DynamicTokenTrie, limit: int = 256) -> DynamicTokenTrie | None:
        """A descendant holding KV (its KV starts with ``node``'s prefix), searching a few nodes."""
        stack = list(node.children.values())
        while stack and limit > 0:
            limit -= 1
            candidate = stack.pop()
            if candidate.past_key_values is not None:
                return candidate
            stack.extend(candidate.children.values())
        return None

    def _groups(self, rows: list[_Row]) -> list[list[_Row]]:
        """Rows with the same number of new tokens (and adapter, with ``lora_batching=
        "grouped"``), split to respect ``max_batch_tokens``."""
        grouped = self.lora_batching == "grouped"
        by_length: dict[tuple[int, str | None], list[_Row]] = {}
        for row in rows:
            by_length.setdefault((row.new_tokens, row.lora if grouped else None), []).append(row)
        groups = []
        for (new_tokens, _), same in by_length.items():
            per_group = max(1, self.max_batch_tokens // new_tokens)
            groups.extend(same[i : i + per_group] for i in range(0, len(same), per_group))
        return groups

    def _run_group(self, rows: list[_Row], results: list[Any]) -> list[torch.Tensor]:
        """One forward for rows sharing their number of new tokens; stores and returns their KV."""
        layout = self._layout
        new_tokens = rows[0].new_tokens
        past_length = max(row.start for row in rows)
        total = past_length + new_tokens
        shape = (layout.num_layers, 2, len(rows), layout.num_heads, total, layout.head_dim)
        nbytes = int(layout.dtype.itemsize * torch.Size(shape).numel() * _BufferPool.HEADROOM)
        self.cache.make_room(nbytes)
        if self.max_kv_bytes is not None:
            self._pool.trim(self.max_kv_bytes - self.cache.kv_nbytes - nbytes)
        buffer = self._pool.take(shape, layout.dtype, layout.device)
        padded = False
        for i, row in enumerate(rows):
            pad = past_length - row.start
            if pad:
                buffer[:, :, i, :, :pad].zero_()
                padded = True
            if row.past is not None:
                buffer[:, :, i, :, pad:past_length].copy_(row.past)
                row.past = None
        starts = torch.tensor([row.start for row in rows], device=self._input_device)
        input_ids = torch.tensor([row.ids[row.start :] for row in rows], device=self._input_device)
        loras = [row.lora for row in rows]
        # A prefix longer than max_batch_tokens (a single row) is prefilled in chunks.
        for chunk in range(0, new_tokens, self.max_batch_tokens):
            end = min(new_tokens, chunk + self.max_batch_tokens)
            past = past_length + chunk
            mask = None
            if padded or (past and end - chunk > 1):
                mask = self._attention_mask(starts + chunk, past, end - chunk)
            logits = self._forward(
                loras,
                input_ids=input_ids[:, chunk:end],
                attention_mask=mask,
                position_ids=(starts + chunk)[:, None]
                + torch.arange(end - chunk, device=self._input_device),
                past_key_values=_buffer_cache(buffer, past),
                use_cache=True,
                logits_to_keep=1,
            ).logits
        logprobs = self._logprobs(logits[:, -1])
        kvs = []
        for i, row in enumerate(rows):
            kv = buffer[:, :, i, :, past_length - row.start :]
            self._store(row, logprobs[i], kv, results)
            kvs.append(kv)
        return kvs

    def _run_without_kv(self, rows: list[_Row], results: list[Any]) -> None:
        """Fallback for models without reusable KV: plain forwards of whole prefixes."""
        by_length: dict[int, list[_Row]] = {}
        for row in rows:
            by_length.setdefault(len(row.ids), []).append(row)
        for same in by_length.values():
            input_ids = torch.tensor([row.ids for row in same], device=self._input_device)
            loras = [row.lora for row in same]
            logits = self._forward(
                loras, input_ids=input_ids, use_cache=False, logits_to_keep=1
            ).logits
            logprobs = self._logprobs(logits[:, -1])
            for i, row in enumerate(same):
                self._store(row, logprobs[i], None, results)

    def _store(
        self, row: _Row, logprobs: torch.Tensor, kv: torch.Tensor | None, results: list[Any]
    ) -> None:
        node = row.node.extend_cache(row.node.depth, row.ids, None)
        node.set_logprobs(logprobs)
        if kv is not None and not node.pinned:
            node.set_past_key_values(kv)
        source = row.source
        if source is not None and source is not node and not source.pinned:
            if source.depth <= row.node.depth:
                # An ancestor's KV is a prefix of the new node's: keep one copy (see `_kv_below`).
                source.set_past_key_values(None)
        if row.slot is not None:
            results[row.slot] = logprobs

    def _attention_mask(
        self, starts: torch.Tensor, past_length: int, new_tokens: int
    ) -> torch.Tensor:
        """``[rows, 1, new, past + new]`` mask: a row sees its own past (left-padded) causally."""
        keys = torch.arange(past_length + new_tokens, device=self._input_device)
        queries = past_length + torch.arange(new_tokens, device=self._input_device)
        first = (past_length - starts)[:, None, None]
        mask = (keys >= first) & (keys[None, None, :] <= queries[None, :, None])
        mask = mask[:, None]
        if self.model.config._attn_implementation == "sdpa":
            return mask
        additive = torch.zeros(mask.shape, dtype=self._layout.dtype, device=mask.device)
        return additive.masked_fill_(~mask, torch.finfo(self._layout.dtype).min)

    def _logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Normalized float32 log-probabilities over the tokenizer's vocabulary (padding dropped)."""
        return torch.log_softmax(logits[:, : self.vocab_size].float(), dim=-1)

    def _uncached(self, ids: tuple[int, ...], lora: str | None) -> torch.Tensor:
        with torch.inference_mode():
            input_ids = torch.tensor([ids], device=self._input_device)
            logits = self._forward(
                [lora], input_ids=input_ids, use_cache=False, logits_to_keep=1
            ).logits
            return self._logprobs(logits[:, -1])[0]

    def _cache_kv(self, ids: tuple[int, ...], lora: str | None) -> None:
        root = self._root(lora)
        with torch.inference_mode(), root.deferred_pruning():
            node, depth = root.walk(ids)
            kv = node.past_key_values if depth == len(ids) else None
            if kv is None:
                if self._layout is None:
                    raise NotImplementedError(
                        f"cache_kv needs KV reuse, which is off for {type(self.model).__name__}"
                    )
                (kv,) = self._run_group([self._plan(None, ids, lora, node)], [])
            node = root.extend_cache(0, ids, None)
            node.set_past_key_values(kv.clone(), pinned=True)

    def _walk_cache(
        self, ids: tuple[int, ...], lora: str | None
    ) -> tuple[DynamicTokenTrie, int, torch.Tensor | None, int]:
        root = self._root(lora)
        with torch.inference_mode():
            row = self._plan(None, ids, lora, root.walk(ids)[0])
        if row.source is None:
            return root, 0, None, 0
        return row.source, row.start, row.past.clone(), row.source.depth

    def _probe_kv_layout(self) -> tuple[_KVLayout | None, str]:
        """Run one token to learn the KV shape, and whether this design can reuse it."""
        implementation = getattr(self.model.config, "_attn_implementation", None)
        if implementation not in ("sdpa", "eager"):
            return None, f"attention implementation {implementation!r}"
        with torch.inference_mode():
            input_ids = torch.zeros((1, 1), dtype=torch.long, device=self._input_device)
            cache = self.model(
                input_ids=input_ids, use_cache=True, logits_to_keep=1
            ).past_key_values
        if not isinstance(cache, DynamicCache) or not cache.layers:
            return None, f"its cache is a {type(cache).__name__}"
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            return None, "its cache has layers other than full attention"
        keys = {(layer.keys.shape, layer.keys.dtype, layer.keys.device) for layer in cache.layers}
        values = {(layer.values.shape, layer.values.dtype) for layer in cache.layers}
        (shape, dtype, device), (value_shape, value_dtype) = next(iter(keys)), next(iter(values))
        if len(keys) > 1 or len(values) > 1 or (shape, dtype) != (value_shape, value_dtype):
            return None, "its layers' KV shapes differ"
        return _KVLayout(len(cache.layers), shape[1], shape[3], dtype, device), ""

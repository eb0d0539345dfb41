"""`PrefixCachedLM`: the shared half of every backend whose KV lives in a `PrefixKVStore`,
composed with that backend's `RowRunner`.

It composes a batch: the store plans the batcher's distinct queries, the runner computes the
plan's rows, the store commits them (or releases the plan if the forward fails); it keeps
the public cache calls, one meaning for every backend. The runner reads the frozen row
plans and never calls the store or this class. Each row's node is remembered with its
prefix (`remember_node`) for the next step's walk. The design: docs/kv-store.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import torch

from genlm.backend.kv.pool import Chain
from genlm.backend.kv.store import BatchPlan, KVNode, PrefixKVStore, RowPlan
from genlm.backend.llm.base import BatchedAsyncLM, owned_rows
from genlm.backend.llm.handle import PrefixHandle, plain_ids, takes_handles
from genlm.backend.llm.request import PrefixEntry, Query, TokenIds

Past = TypeVar("Past")  # a backend's copy of cached KV (`walk_cache`'s ``past``)
Past_co = TypeVar("Past_co", covariant=True)


class CacheWalk(NamedTuple):
    """Where a request would start (`PrefixCachedLM.walk_cache`); unpacks as the 4-tuple
    ``(node, next_token_index, past, base)`` of the reference design."""

    node: KVNode
    next_token_index: int
    past: Any
    base: int

    def __repr__(self) -> str:
        """One line: the node's summary and what ``past`` is, not its values."""
        return (
            f"CacheWalk(node={self.node!r}, next_token_index={self.next_token_index}, "
            f"past={_describe(self.past)}, base={self.base})"
        )


def _describe(past: Any) -> str:
    """A backend's KV copy in a few words: its type and shape (or length)."""
    if past is None:
        return "None"
    shape = getattr(past, "shape", None)
    if shape is not None:
        return f"<{type(past).__name__} of shape {tuple(shape)}>"
    if hasattr(past, "__len__"):
        return f"<{type(past).__name__} of length {len(past)}>"
    return f"<{type(past).__name__}>"


class RowRunner(Protocol[Past_co]):
    """A backend's forward over a batch's rows, and the model state it needs (adapters,
    buffers); called on the batcher's worker thread, never calling back."""

    def run(self, rows: Sequence[RowPlan]) -> torch.Tensor:
        """Each row's next-token logprobs (float32), in order, as a ``[rows, vocab]`` batch
        of its own (the tree keeps views of its rows). With KV reuse a row's chain is
        allocated and its copies applied: read its first ``row.start`` tokens' KV from the
        chain and write ``ids[start:]``'s into it; without, run the whole prefix."""
        ...

    def read_past(self, chain: Chain, tokens: int) -> Past_co:
        """A copy of the KV of a chain's first ``tokens`` tokens (`walk_cache`'s ``past``)."""
        ...

    def load_adapter(self, lora_path: str, lora_name: str) -> None:
        """Check and load an adapter under ``lora_name``, replacing one of that name only
        once it has loaded (a failure leaves the model as it was)."""
        ...

    def unload_adapter(self, lora_name: str) -> None:
        """Free a loaded adapter."""
        ...

    def free(self) -> None:
        """Let go of the memory it keeps between batches (buffers, captured graphs)."""
        ...


class PrefixCachedLM(BatchedAsyncLM, Generic[Past]):
    """An auto-batched LM with a prefix tree of cached logprobs and paged KV (`store`),
    whose rows its `runner` computes.

    Subclasses build the store and the runner and call `_init_prefix_cache`; ``Past`` is
    the type of the KV copies `walk_cache` returns (`RowRunner.read_past`).
    """

    store: PrefixKVStore
    runner: RowRunner[Past]

    def _init_prefix_cache(
        self,
        store: PrefixKVStore,
        runner: RowRunner[Past],
        batch_size: int,
        timeout: float | None,
        name: str,
    ) -> None:
        self.store = store
        self.runner = runner
        self._row_nbytes = 4 * self.vocab_size  # a row of float32 logprobs
        self.batcher = self._make_batcher(batch_size, timeout, name)
        self._queries: list[Query] = []  # prefixes queued by `add_query`

    @property
    def kv_reuse(self) -> bool:
        """Whether requests reuse cached KV (else each runs its whole prefix)."""
        return self.store.kv_reuse

    # -- LoRA wiring: the model work on the worker, then that adapter's tree dropped ----------

    def _load_lora(self, lora_path: str, lora_name: str) -> None:
        self.batcher.run_sync(self._load_on_worker, lora_path, lora_name)

    def _unload_lora(self, lora_name: str) -> None:
        self.batcher.run_sync(self._unload_on_worker, lora_name)

    def _load_on_worker(self, lora_path: str, lora_name: str) -> None:
        self.runner.load_adapter(lora_path, lora_name)
        self.store.drop_root(lora_name)

    def _unload_on_worker(self, lora_name: str) -> None:
        self.runner.unload_adapter(lora_name)
        self.store.drop_root(lora_name)

    # -- public API ----------------------------------------------------------------------------

    @property
    def cache(self) -> KVNode:
        """The root of the base model's prefix tree (each adapter has its own, in `store`);
        after `close`, an empty root."""
        return self.store.root(None)

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the KV blocks held by unpinned prefixes (pinned prompts are outside it);
        0 after `close`."""
        return self.store.kv_nbytes

    @takes_handles
    def cache_kv(self, prompt_tokens: Sequence[int], *, lora_name: str | None = None) -> None:
        """Compute and pin the KV of ``prompt_tokens``: it stays until a cache clear.

        Raises ``NotImplementedError`` when this model's KV cannot be reused.
        """
        ids, lora = self._query(prompt_tokens, lora_name)
        self.batcher.run_sync(self._cache_kv, ids, lora)

    @takes_handles
    def walk_cache(self, token_ids: Sequence[int], *, lora_name: str | None = None) -> CacheWalk:
        """Where a request for ``token_ids`` would start: ``(node, next_token_index, past, base)``.

        ``node`` holds the KV used (the root if none), ``base`` is its depth (the tokens its
        KV covers), ``past`` is a copy of that KV cut to ``token_ids[:next_token_index]``
        (backend-specific; for HF ``[layers, 2, kv_heads, next_token_index, head_dim]``, for
        MLX one mlx-lm ``KVCache`` per layer, which an mlx-lm model can continue from), or
        None, and ``next_token_index`` is the first token still to run (at most ``len - 1``:
        the last token always runs, to get the logits).
        """
        ids, lora = self._query(token_ids, lora_name)
        return self.batcher.run_sync(self._walk_cache, ids, lora)

    @takes_handles
    def add_query(self, token_ids: Sequence[int], *, lora_name: str | None = None) -> int:
        """Queue a prefix for `batch_evaluate_queries`; returns its position in the queue."""
        self._queries.append(self._query(token_ids, lora_name))
        return len(self._queries) - 1

    def batch_evaluate_queries(self) -> list[torch.Tensor]:
        """Evaluate every queued prefix in one batch (blocking); empties the queue."""
        self._check_open()
        queries, self._queries = self._queries, []
        return self._rows_sync(queries) if queries else []

    def clear_cache(self) -> None:
        """Forget all cached logprobs and KV (pinned prompts included): after editing the
        model's weights, whose cached rows and KV are the old weights'."""
        self._check_open()
        self.batcher.run_sync(self.store.clear)

    def clear_kv_cache(self) -> None:
        """Forget all cached KV (pinned prompts included), keep the logprobs."""
        self._check_open()
        self.batcher.run_sync(self.store.clear_kv)

    def reset_async_queries(self) -> None:
        """Drop queued requests after an aborted run (their callers get ``CancelledError``)."""
        super().reset_async_queries()
        self._queries = []

    def _close(self) -> None:
        """Stop the worker, which waits for a running batch, then free the runner's buffers,
        the trees, their logprobs and the KV pool's memory (`PrefixKVStore.free`; last, as
        the pool gives a device's memory back) and the `add_query` queue."""
        super()._close()
        self.runner.free()
        self.store.free()
        self._queries = []

    # -- batch evaluation (worker thread) ------------------------------------------------------

    def _compute_batch(self, keys: list[Query]) -> list[torch.Tensor]:
        """The rows of ``keys``, as the tree holds them (`_owned` copies them for callers).
        A handle is planned as it is (the store reads its ids from a node on their path
        on, the runner its new ids), or without KV reuse as its ids (each row runs them
        all)."""
        hints = [node_hint(ids, lora) for ids, lora in keys]
        planned = keys if self.kv_reuse else [(plain_ids(ids), lora) for ids, lora in keys]
        plan = self.store.plan(planned, self._row_nbytes, hints)
        return self._run_plan(plan, [ids for ids, _ in keys])

    def _run_plan(self, plan: BatchPlan, prefixes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The plan's rows computed and committed (the plan released if the forward fails):
        every query's logprobs, in order. Each row's node is remembered with its query's
        ids (``prefixes``, by slot), for the next step's walk (`remember_node`)."""
        try:
            rows = self._kept_rows(self.runner.run(plan.rows)) if plan.rows else []
        except BaseException:
            self.store.release(plan)
            raise
        answers = self.store.commit(plan, rows)
        for row in plan.rows:
            remember_node(prefixes[row.slot], row.lora, row.node)
        return answers

    def _kept_rows(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """The rows the tree keeps of a forward's batch: views of a batch that fits the
        logprobs budget whole (its memory is counted once, until its last row goes); a
        larger batch's rows copied apart, so that as many as fit are kept."""
        rows = list(batch.unbind())
        budget = self.store.max_logprobs_bytes
        return rows if budget is None or batch.nbytes <= budget else owned_rows(rows)

    def _cache_kv(self, ids: tuple[int, ...], lora: str | None) -> None:
        if not self.kv_reuse:
            raise NotImplementedError(
                f"cache_kv needs KV reuse, which is off for this {type(self).__name__}'s model"
            )
        hint = node_hint(ids, lora)
        plan = self.store.plan([(ids, lora)], self._row_nbytes, [hint], pin=True)
        self._run_plan(plan, [ids])

    def _walk_cache(self, ids: tuple[int, ...], lora: str | None) -> CacheWalk:
        node = self.store.find(lora, ids, node_hint(ids, lora))[0]
        source, start = self.store.kv_start(node, len(ids))
        if source is None or source.chain is None or not start:
            return CacheWalk(self.store.root(lora), 0, None, 0)
        return CacheWalk(source, start, self.runner.read_past(source.chain, start), source.depth)


def _entry(ids: Sequence[int]) -> PrefixEntry | PrefixHandle | None:
    """Where the nodes of ``ids`` are remembered: a handle itself, or the entry of the
    index of validated prefixes that validated them (None: nowhere)."""
    if type(ids) is PrefixHandle:
        return ids
    return ids.entry if isinstance(ids, TokenIds) else None


def node_hint(ids: Sequence[int], lora: str | None) -> KVNode | None:
    """A node on the path of ``ids`` in the prefix tree of ``lora`` (None: the base
    model's), remembered for them or for their parent prefix, in their handle or their
    entry of the index of validated prefixes (`PrefixKVStore.find` walks on from it), or
    None."""
    entry = _entry(ids)
    if entry is None:
        return None
    return entry.node if lora is None else entry.adapter_nodes.get(lora)


def remember_node(ids: Sequence[int], lora: str | None, node: KVNode) -> None:
    """Remember ``node``, the node of ``ids`` in the prefix tree of ``lora``, in their
    handle or their entry (where they were validated here) for `node_hint`."""
    entry = _entry(ids)
    if entry is None:
        return
    if lora is None:
        entry.node = node
    else:  # a copy: the dict may be the parent's
        entry.adapter_nodes = {**entry.adapter_nodes, lora: node}

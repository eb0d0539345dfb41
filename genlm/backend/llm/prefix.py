"""`PrefixCachedLM`: the shared half of every backend whose KV lives in a `PrefixKVStore`.

It owns the batcher, the request plan (deepest cached KV, each plan's own chain, the
copy-on-write copies applied to the pool), the logprobs and KV bookkeeping after a
forward, and the public cache calls (`walk_cache`, `cache_kv`, `clear_cache`,
`clear_kv_cache`, `reset_async_queries`, `kv_nbytes`, the `add_query` queue), each with
one meaning for every backend. A backend implements only the forward, `_run_plans`: it
reads the (frozen) query plans, writes their new tokens' KV into their chains and
returns their logprobs; it never calls the store or back up into this class.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from genlm.backend.batching import AutoBatcher
from genlm.backend.kv.pool import Chain
from genlm.backend.kv.store import KVNode, PrefixKVStore
from genlm.backend.llm.base import BatchedAsyncLM, stacked_copies
from genlm.backend.llm.request import Query, node_hint, remember_node

Past = TypeVar("Past")  # a backend's copy of cached KV (`walk_cache`'s ``past``)
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class QueryPlan:
    """How a query of a batch runs: ``ids[start:]`` on top of the KV of ``ids[:start]``, held
    in the chain of node ``source``, which evictions leave alone while the batch runs;
    ``chain``, the plan's own chain for ``ids`` whole (with KV reuse, once allocated),
    holds that KV and gets the new tokens'. Each plan is one row of the forward's batch."""

    slot: int  # the position of its query in the batch
    ids: tuple[int, ...]
    lora: str | None
    node: KVNode
    start: int
    source: KVNode | None = None
    chain: Chain = ()

    @property
    def new_tokens(self) -> int:
        return len(self.ids) - self.start

    def with_chain(self, chain: Chain) -> QueryPlan:
        """This plan with its own chain (built directly: `dataclasses.replace` costs ~3 us,
        once per particle per step)."""
        return QueryPlan(self.slot, self.ids, self.lora, self.node, self.start, self.source, chain)


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


class PrefixCachedLM(BatchedAsyncLM, Generic[Past]):
    """An auto-batched LM with a prefix tree of cached logprobs and paged KV (`store`).

    Subclasses call `_init_prefix_cache` and implement `_run_plans`; ``Past`` is the type
    of the KV copies `walk_cache` returns (`_read_past`).
    """

    store: PrefixKVStore
    kv_reuse: bool

    def _init_prefix_cache(
        self,
        store: PrefixKVStore,
        kv_reuse: bool,
        batch_size: int,
        timeout: float | None,
        name: str,
    ) -> None:
        self.store = store
        self.kv_reuse = kv_reuse
        self.batcher = AutoBatcher(
            self._serve_batch, batch_size, timeout, name=name, copy_results=stacked_copies
        )
        self._queries: list[Query] = []  # prefixes queued by `add_query`

    # -- backend hooks (worker thread) ---------------------------------------------------------

    @abstractmethod
    def _run_plans(self, plans: Sequence[QueryPlan]) -> torch.Tensor | list[torch.Tensor]:
        """Each plan's next-token logprobs (float32), in order: a ``[rows, vocab]`` batch of
        its own (the tree keeps views of its rows: no copy) or a list of rows of their
        own. With KV reuse a
        plan's chain is allocated and its copies applied: read its first ``plan.start``
        tokens' KV from the chain and write ``ids[start:]``'s into it; without, run the
        whole prefix."""

    def _read_past(self, chain: Chain, tokens: int) -> Past:
        """A copy of the KV of a chain's first ``tokens`` tokens (`walk_cache`'s ``past``)."""
        return self.store.pool.read(chain, tokens)

    @abstractmethod
    def _load_adapter(self, lora_path: str, lora_name: str) -> None:
        """Check and load an adapter under ``lora_name``, replacing one of that name only
        once it has loaded (a failure leaves the model as it was)."""

    @abstractmethod
    def _unload_adapter(self, lora_name: str) -> None:
        """Free a loaded adapter."""

    # -- LoRA wiring: the model work on the worker, then that adapter's tree dropped ----------

    def _load_lora(self, lora_path: str, lora_name: str) -> None:
        self.batcher.run_sync(self._load_on_worker, lora_path, lora_name)

    def _unload_lora(self, lora_name: str) -> None:
        self.batcher.run_sync(self._unload_on_worker, lora_name)

    def _load_on_worker(self, lora_path: str, lora_name: str) -> None:
        self._load_adapter(lora_path, lora_name)
        self.store.drop_root(lora_name)

    def _unload_on_worker(self, lora_name: str) -> None:
        self._unload_adapter(lora_name)
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

    def cache_kv(self, prompt_tokens: Sequence[int], *, lora_name: str | None = None) -> None:
        """Compute and pin the KV of ``prompt_tokens``: it stays until a cache clear.

        Raises ``NotImplementedError`` when this model's KV cannot be reused.
        """
        ids, lora = self._query(prompt_tokens, lora_name)
        self.batcher.run_sync(self._cache_kv, ids, lora)

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

    def add_query(self, token_ids: Sequence[int], *, lora_name: str | None = None) -> int:
        """Queue a prefix for `batch_evaluate_queries`; returns its position in the queue."""
        self._queries.append(self._query(token_ids, lora_name))
        return len(self._queries) - 1

    def batch_evaluate_queries(self) -> list[torch.Tensor]:
        """Evaluate every queued prefix in one batch (blocking); empties the queue."""
        self._check_open()
        queries, self._queries = self._queries, []
        return self._run_batch(queries) if queries else []

    def clear_cache(self) -> None:
        """Forget all cached logprobs and KV (pinned prompts included)."""
        self._check_open()
        self.batcher.run_sync(self.store.reset)

    def clear_kv_cache(self) -> None:
        """Forget all cached KV (pinned prompts included), keep the logprobs."""
        self._check_open()
        self.batcher.run_sync(self.store.clear_kv)

    def reset_async_queries(self) -> None:
        """Drop queued requests after an aborted run (their callers get ``CancelledError``)."""
        super().reset_async_queries()
        self._queries = []

    def _close(self) -> None:
        """Stop the worker, which waits for a running batch, then free the trees, their
        logprobs, the KV pool's memory (`PrefixKVStore.free`) and the `add_query` queue."""
        super()._close()
        self.store.free()
        self._queries = []

    # -- batch evaluation (worker thread) ------------------------------------------------------

    def _process_batch(self, keys: list[Query]) -> list[torch.Tensor]:
        """The callers' rows: one copy of the batch's rows (one op, one kernel up to 128
        rows on CUDA), a view of it each, so that a row edited in place changes neither
        what the tree holds nor another caller's row."""
        return stacked_copies(self._shared_rows(keys))

    def _shared_rows(self, keys: list[Query]) -> list[torch.Tensor]:
        """The rows of ``keys``, as the tree holds them (not to be edited)."""
        results: dict[int, torch.Tensor] = {}
        planned: list[QueryPlan] = []
        chains: dict[int, Chain] = {}  # by slot: each plan's own chain until a node takes it
        try:
            for slot, (ids, lora) in enumerate(keys):
                node, depth = self.store.find(lora, ids, node_hint(ids, lora))
                if depth == len(ids) and node.logprobs is not None:
                    self.store.touch(node)
                    results[slot] = node.logprobs
                else:
                    planned.append(self._plan(slot, ids, lora, node))
            if planned:
                allocated = self._allocate(planned, chains)
                rows = self._computed_rows(allocated)
                for plan, logprobs in zip(allocated, rows, strict=True):
                    self._store(plan, logprobs, chains)
                    results[plan.slot] = logprobs
        finally:
            self._finish(planned, chains)
        return [results[slot] for slot in range(len(keys))]

    def _plan(self, slot: int, ids: tuple[int, ...], lora: str | None, node: KVNode) -> QueryPlan:
        """Find the deepest usable KV for ``ids`` and hold it (``node``: the deepest node on
        the path of ``ids`` in the tree of adapter ``lora``)."""
        source = self.store.kv_source(node) if self.kv_reuse else None
        if source is None or source.chain is None:
            return QueryPlan(slot, ids, lora, node, 0)
        start = min(source.depth, node.depth, len(ids) - 1)
        self.store.touch(source)
        self.store.protect(source)
        return QueryPlan(slot, ids, lora, node, start, source)

    def _allocate(self, planned: Sequence[QueryPlan], chains: dict[int, Chain]) -> list[QueryPlan]:
        """With KV reuse, the plans with their own chains (room made in the pool first; the
        chains recorded in ``chains``), the copy-on-write copies applied."""
        if not self.kv_reuse:
            return list(planned)
        needs = [(_chain_of(plan.source), plan.start, len(plan.ids)) for plan in planned]
        self.store.reserve(needs)
        made, copies = self.store.extend_all(needs)
        allocated = []
        for plan, chain in zip(planned, made, strict=True):
            chains[plan.slot] = chain
            allocated.append(plan.with_chain(chain))
        self.store.pool.copy(copies)
        return allocated

    def _computed_rows(self, plans: list[QueryPlan]) -> list[torch.Tensor]:
        """The plans' rows from the forward, after room is made in the logprobs budget (so
        the batch reuses the memory of the rows it pushes out). The tree keeps views of a
        batch that fits the budget whole (its memory is counted once, until its last row
        goes); a larger batch's rows are copied apart, so that as many as fit are kept."""
        batch_bytes = len(plans) * 4 * self.vocab_size  # float32 rows
        budget = self.store.max_logprobs_bytes
        self.store.make_room_for_logprobs(
            batch_bytes if budget is None else min(batch_bytes, budget), len(plans)
        )
        computed = self._run_plans(plans)
        if not isinstance(computed, torch.Tensor):
            return computed
        rows = list(computed.unbind())
        return rows if budget is None or computed.nbytes <= budget else _copies(rows)

    def _store(self, plan: QueryPlan, logprobs: torch.Tensor, chains: dict[int, Chain]) -> None:
        """Cache a plan's logprobs (a view of its batch, or a row of its own: see
        `_computed_rows`) and give its chain to its node (unless the node holds a pinned
        chain), out of ``chains``."""
        node = self.store.node_at(plan.node, plan.ids)
        remember_node(plan.ids, plan.lora, node)
        self.store.set_logprobs(node, logprobs)
        if plan.chain and not node.pinned:
            self.store.set_chain(node, chains.pop(plan.slot))

    def _finish(self, planned: Sequence[QueryPlan], chains: dict[int, Chain]) -> None:
        """Let evictions take the plans' sources again, let go of the chains no node took,
        bring KV back within budget, shrink a mostly free pool, prune the trees."""
        for plan in planned:
            if plan.source is not None:
                self.store.unprotect(plan.source)
        for chain in chains.values():
            self.store.release(chain)
        self.store.evict()
        self.store.trim()
        self.store.prune()

    def _cache_kv(self, ids: tuple[int, ...], lora: str | None) -> None:
        if not self.kv_reuse:
            raise NotImplementedError(
                f"cache_kv needs KV reuse, which is off for this {type(self).__name__}'s model"
            )
        node, depth = self.store.find(lora, ids, node_hint(ids, lora))
        if depth == len(ids) and node.chain is not None:
            self.store.pin(node)
            return
        planned = [self._plan(0, ids, lora, node)]
        chains: dict[int, Chain] = {}
        try:
            allocated = self._allocate(planned, chains)
            self._store(allocated[0], self._computed_rows(allocated)[0], chains)
            self.store.pin(self.store.node_at(node, ids))
        finally:
            self._finish(planned, chains)

    def _walk_cache(self, ids: tuple[int, ...], lora: str | None) -> CacheWalk:
        root = self.store.root(lora)
        node = self.store.find(lora, ids, node_hint(ids, lora))[0]
        source = self.store.kv_source(node) if self.kv_reuse else None
        start = 0 if source is None else min(source.depth, node.depth, len(ids) - 1)
        if source is None or source.chain is None or not start:
            return CacheWalk(root, 0, None, 0)
        return CacheWalk(source, start, self._read_past(source.chain, start), source.depth)


def _copies(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of each row, each with storage of its own (one dispatcher call, a kernel per
    row on CUDA): for a batch the logprobs budget cannot hold whole."""
    return list(torch._foreach_clone(rows))


def _chain_of(source: KVNode | None) -> Chain | None:
    return None if source is None else source.chain


def plan_groups(
    plans: Sequence[QueryPlan], key: Callable[[QueryPlan], Hashable]
) -> list[list[int]]:
    """The positions of ``plans`` grouped by ``key``, groups in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for index, plan in enumerate(plans):
        groups.setdefault(key(plan), []).append(index)
    return list(groups.values())


def run_grouped(
    plans: Sequence[QueryPlan],
    key: Callable[[QueryPlan], Hashable],
    run: Callable[[list[QueryPlan]], Sequence[R]],
) -> list[R]:
    """``run`` (one result per plan) over the plans grouped by ``key``, the results in the
    order of ``plans``."""
    results: dict[int, R] = {}
    for indices in plan_groups(plans, key):
        results.update(zip(indices, run([plans[i] for i in indices]), strict=True))
    return [results[index] for index in range(len(plans))]

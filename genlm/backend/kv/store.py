"""`PrefixKVStore`: the policy of a paged prefix-KV store shared by particles.

A prefix tree per adapter (`genlm.backend.kv.tree`) maps a prefix to its cached logprobs and
its chain of blocks (`genlm.backend.kv.blocks.BlockAllocator`); the store decides what stays
(LRU budgets of KV blocks and logprobs bytes; pinned chains outside them). Only `plan`,
`commit`, `release`, `drop_root` and the clears change what it holds; a plan ends once
(a second end raises before freeing anything); a decode step's walk is O(new tokens),
from the node remembered for its prefix. The design: docs/kv-store.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from genlm.backend.checks import check_budget, check_int
from genlm.backend.kv.blocks import BlockAllocator, Extension
from genlm.backend.kv.budget import SharedMemory, memory_nbytes

# BlockCopy is also this module's name (SPEC lists it with the store's).
from genlm.backend.kv.pool import BlockCopy, BlockPool, Chain, NoKVPool
from genlm.backend.kv.tree import KVNode, attached, kv_start, node_at, prune, subtree, walk

__all__ = ["BatchPlan", "BlockCopy", "Chain", "KVNode", "PrefixKVStore", "RowPlan"]


@dataclass(frozen=True, slots=True)
class RowPlan:
    """One row of a batch's forward: its ``new_tokens`` (``len(ids) - start``), the ids
    from ``start`` on, run on top of the KV of ``ids[:start]``, held in the chain of
    ``source`` (which evictions leave alone while the batch runs). With KV reuse
    ``chain``, the row's own for ``ids`` whole, holds that KV and gets the new tokens'.
    ``node``: the node of ``ids`` in the tree of ``lora`` (an adapter's name, None for the
    base model); ``slot``: the query's position in the batch."""

    slot: int
    ids: Sequence[int]
    lora: str | None
    node: KVNode
    start: int
    new_tokens: int
    source: KVNode | None = None
    chain: Chain = ()


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """A batch as `PrefixKVStore.plan` made it: ``cached``, each query's logprobs found in
    the tree (None for a query to compute); ``rows``, the queries to compute, each holding
    its chain until `PrefixKVStore.commit` gives it to its node or `PrefixKVStore.release`
    lets it go; ``pin``: the rows' KV is pinned at commit (`cache_kv`; a query whose node
    holds its KV already is pinned by `plan`, its ``cached`` entry what the node holds).
    ``ended``: how the plan ended (None while it runs, ``"committed"``, ``"released"``),
    set by the store: a plan ends once."""

    cached: tuple[Any, ...]
    rows: tuple[RowPlan, ...]
    pin: bool = False
    ended: str | None = field(default=None, init=False, compare=False)


class PrefixKVStore:
    """Prefix trees (one per adapter) over a pool's blocks, with LRU budgets and pins.

    Args:
        pool: the KV memory (its ``block_size`` and ``block_bytes``); a `NoKVPool` for a
            model whose KV cannot be reused (`kv_reuse` off: only logprobs are kept).
        max_kv_bytes: budget for blocks held by unpinned chains (None: unbounded).
        max_logprobs_bytes: budget for cached logprobs (None: unbounded).
        nbytes: bytes of the memory a logprobs value occupies (default `memory_nbytes`:
            a torch tensor's storage, counted once for the values sharing it).
        max_kv_entries: most unpinned chains kept (None: unbounded).
        max_logprobs_entries: most logprobs values kept (None: unbounded).
        fixed_capacity: the pool's blocks (block 0 included), allocated here and never
            resized (None: the pool follows what is held, see `BlockAllocator`).
    """

    def __init__(
        self,
        pool: BlockPool,
        max_kv_bytes: int | None = None,
        max_logprobs_bytes: int | None = None,
        nbytes: Callable[[Any], int] | None = None,
        max_kv_entries: int | None = None,
        max_logprobs_entries: int | None = None,
        fixed_capacity: int | None = None,
    ):
        check_budget("max_kv_bytes", max_kv_bytes)
        check_budget("max_logprobs_bytes", max_logprobs_bytes)
        check_int("max_kv_entries", max_kv_entries, optional=True)
        check_int("max_logprobs_entries", max_logprobs_entries, optional=True)
        check_int("fixed_capacity", fixed_capacity, minimum=1, optional=True)
        check_int("the pool's block_size", pool.block_size, minimum=1)
        self.pool = pool
        self.kv_reuse = not isinstance(pool, NoKVPool)
        self.block_size = pool.block_size
        self.block_bytes = pool.block_bytes
        self.max_logprobs_bytes = max_logprobs_bytes
        self.max_kv_entries = max_kv_entries
        self.max_logprobs_entries = max_logprobs_entries
        self._nbytes = memory_nbytes if nbytes is None else nbytes
        self._blocks = BlockAllocator(pool, None, fixed_capacity)
        self.max_kv_bytes = max_kv_bytes
        self._roots: dict[str | None, KVNode] = {}
        self._forget()

    # -- state -------------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every tree, chain and logprob; the pool goes back to its first size."""
        self._forget()
        self._blocks.clear()

    def free(self) -> None:
        """Forget every tree, chain and logprob, and let go of all the pool's memory, not
        just shrink it (a closed LM's store); the next batch allocates it afresh."""
        self._forget()
        self._blocks.free()

    def _forget(self) -> None:
        """No tree, no chain, no logprob. The old trees' nodes are emptied, so that one a
        caller still holds (an old root) keeps no tree alive."""
        for root in self._roots.values():
            for node in subtree(root):
                node.children.clear()
                node.logprobs = node.chain = None
                node.pinned = False
        self._roots = {}
        self._kv_lru: OrderedDict[int, KVNode] = OrderedDict()
        self._logprobs_lru: OrderedDict[int, KVNode] = OrderedDict()
        self._memory = SharedMemory(self._nbytes)
        self._emptied: list[KVNode] = []
        self._protected: set[int] = set()  # ids of nodes `_protect` keeps from eviction

    @property
    def max_kv_bytes(self) -> int | None:
        """Budget for blocks held by unpinned chains (None: unbounded). Assignable (checked
        as the constructor checks it): every eviction from then on, the next batch's first,
        keeps KV within it (the other budgets are plain attributes, read the same way)."""
        return self._max_kv_bytes

    @max_kv_bytes.setter
    def max_kv_bytes(self, value: int | None) -> None:
        check_budget("max_kv_bytes", value)
        self._max_kv_bytes = value
        self._blocks.budget_blocks = None if value is None else value // self.block_bytes

    @property
    def capacity(self) -> int:
        """Blocks in the pool (block 0 included): `BlockAllocator.capacity`."""
        return self._blocks.capacity

    @property
    def held_blocks(self) -> int:
        """Blocks held by any chain, pinned or not (block 0 excluded)."""
        return self._blocks.held_blocks

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the blocks held by unpinned chains (the budgeted KV)."""
        return self._blocks.budgeted * self.block_bytes

    @property
    def logprobs_nbytes(self) -> int:
        """Bytes of the memory the cached logprobs occupy (shared memory counted once)."""
        return self._memory.nbytes

    @property
    def roots(self) -> Mapping[str | None, KVNode]:
        """The root of each prefix tree, by adapter (None: the base model; a read-only view:
        `root` makes one)."""
        return MappingProxyType(self._roots)

    def root(self, lora: str | None) -> KVNode:
        """The root of the prefix tree of adapter ``lora`` (None: the base model)."""
        root = self._roots.get(lora)
        if root is None:
            root = self._roots[lora] = KVNode()
        return root

    def drop_root(self, lora: str | None) -> None:
        """Forget the tree of adapter ``lora`` and let go of everything it holds (its nodes
        emptied, so that none is attached any more: `find`)."""
        root = self._roots.pop(lora, None)
        if root is not None:
            for node in subtree(root):
                self._set_logprobs(node, None)
                self._set_chain(node, None)
                node.children.clear()

    # -- a batch: plan, then commit or release --------------------------------------------------

    def plan(
        self,
        queries: Sequence[tuple[Sequence[int], str | None]],
        row_nbytes: int,
        near: Sequence[KVNode | None] | None = None,
        *,
        pin: bool = False,
    ) -> BatchPlan:
        """The order of work of a batch of distinct ``(ids, lora)`` queries, up to its
        forward: each query's cached logprobs (touched), or for the rest a `RowPlan` (its
        node made, its KV source touched and protected); with KV reuse, room made for the
        rows' blocks, their chains made and the copy-on-write copies applied to the pool;
        then room made in the logprobs budget for the rows (of ``row_nbytes`` each), so the
        forward reuses the memory of those it pushes out. ``near``: for each query, a node
        the caller remembers on its path, or None (`find`). With ``pin`` (`cache_kv`) every
        query is computed and its node's chain pinned at `commit`, but one whose node holds
        its KV already: that chain is pinned here.

        The plan ends once, with `commit` (its rows computed) or `release`; if planning
        fails, what it held is let go before the error propagates."""
        cached: list[Any] = []
        rows: list[RowPlan] = []
        try:
            for slot, (ids, lora) in enumerate(queries):
                node, depth = self.find(lora, ids, None if near is None else near[slot])
                if depth == len(ids) and (node.chain if pin else node.logprobs) is not None:
                    if pin:
                        self._pin(node)
                    else:
                        self._touch(node)
                    cached.append(node.logprobs)
                    continue
                cached.append(None)
                source, start = self.kv_start(node, len(ids))
                target = node_at(node, ids)
                if source is not None:
                    self._touch(source)
                    self._protect(source)
                rows.append(RowPlan(slot, ids, lora, target, start, len(ids) - start, source))
            if rows and self.kv_reuse:
                rows = self._with_chains(rows)
            if rows:  # a batch over the budget: the budget's worth (its rows are kept apart)
                nbytes, budget = len(rows) * row_nbytes, self.max_logprobs_bytes
                self._make_room_for_logprobs(
                    nbytes if budget is None else min(nbytes, budget), len(rows)
                )
        except BaseException:
            self._finish(rows, 0)
            raise
        return BatchPlan(tuple(cached), tuple(rows), pin)

    def commit(self, plan: BatchPlan, rows: Sequence[Any]) -> list[Any]:
        """Cache each row's logprobs (``rows``, in the order of ``plan.rows``) at its node
        and give the node the row's chain (a node holding a pinned chain keeps it: the row's
        is let go), pinning it for a ``pin`` plan; then end the plan as `release` does.
        Returns every query's logprobs, in order. A wrong number of rows releases the plan
        (``ValueError``); a plan that has ended raises ``RuntimeError`` (`_end`)."""
        refused = len(rows) != len(plan.rows)
        self._end(plan, "commit", "released" if refused else "committed")
        if refused:
            self._finish(plan.rows, 0)
            raise ValueError(
                f"{len(rows)} rows computed for a plan of {len(plan.rows)} (the plan is released)"
            )
        answers = list(plan.cached)
        given = 0  # rows whose chains went to their nodes (or were let go)
        try:
            for row, logprobs in zip(plan.rows, rows, strict=True):
                node = row.node
                self._set_logprobs(node, logprobs)
                answers[row.slot] = logprobs
                if row.chain and node.pinned:
                    self._blocks.let_go(row.chain)
                elif row.chain:
                    self._set_chain(node, row.chain)
                given += 1
                if plan.pin:
                    self._pin(node)
        finally:
            self._finish(plan.rows, given)
        return answers

    def release(self, plan: BatchPlan) -> None:
        """End a plan whose rows were not computed: let go of their chains (their nodes,
        left without values, are pruned), unprotect the sources, evict, trim and prune. A
        plan that has ended raises ``RuntimeError`` (`_end`)."""
        self._end(plan, "release", "released")
        self._finish(plan.rows, 0)

    def _end(self, plan: BatchPlan, verb: str, ending: str) -> None:
        """Mark ``plan`` as ended (``ending``: how), or raise ``RuntimeError`` if it has
        already ended, before anything is let go: its chains went to their nodes or back
        to the pool, where the next plan may have them by now."""
        if plan.ended is not None:
            raise RuntimeError(
                f"cannot {verb} a plan that was already {plan.ended}: a plan ends once, "
                "with commit or release"
            )
        object.__setattr__(plan, "ended", ending)  # frozen for everyone but the store

    def kv_start(self, node: KVNode, length: int) -> tuple[KVNode | None, int]:
        """`genlm.backend.kv.tree.kv_start` with KV reuse, else ``(None, 0)``."""
        return kv_start(node, length) if self.kv_reuse else (None, 0)

    def _with_chains(self, rows: list[RowPlan]) -> list[RowPlan]:
        """The rows with their own chains: room made for them in the pool first, then the
        copy-on-write copies applied (the chains let go if that fails)."""
        needs = [
            (row.source.chain if row.source else None, row.start, len(row.ids)) for row in rows
        ]
        self._reserve(needs)
        chains, copies = self._blocks.extend_all(needs)
        try:
            self.pool.copy(copies)
        except BaseException:
            for chain in chains:
                self._blocks.let_go(chain)
            raise
        return [
            RowPlan(
                row.slot, row.ids, row.lora, row.node, row.start, row.new_tokens, row.source, chain
            )
            for row, chain in zip(rows, chains, strict=True)
        ]

    def _finish(self, rows: Sequence[RowPlan], given: int) -> None:
        """End a batch: the chains of ``rows[given:]`` let go (their nodes, if left empty,
        pruned), every source unprotected, KV brought back within budget, a mostly free
        pool shrunk, the trees pruned."""
        for row in rows[given:]:
            self._blocks.let_go(row.chain)
            self._emptied.append(row.node)
        for row in rows:
            if row.source is not None:
                self._unprotect(row.source)
        self._evict()
        self._blocks.trim()
        self._prune()

    # -- the trees ---------------------------------------------------------------------------

    def find(
        self, lora: str | None, ids: Sequence[int], near: KVNode | None = None
    ) -> tuple[KVNode, int]:
        """`walk` in the tree of adapter ``lora`` from ``near``, a node the caller remembers on the
        path of ``ids`` in that tree (the node made for them or for a prefix of them on an
        earlier step: a decode step then walks O(new tokens), not O(len(ids))), used while
        it is still in the tree and no deeper than ``ids``; else from the root."""
        if near is None or near.depth > len(ids) or not attached(near):
            near = self.root(lora)
        return walk(near, ids)

    def _protect(self, node: KVNode) -> None:
        """Keep ``node``'s chain through evictions (a running batch reads it) until
        `_unprotect`: O(1), unlike holding each of its blocks. `_touch` it first: eviction
        stops at the least recently used protected node (it keeps its place in the LRU
        order)."""
        self._protected.add(id(node))

    def _unprotect(self, node: KVNode) -> None:
        """Let evictions take ``node``'s chain again."""
        self._protected.discard(id(node))

    def _touch(self, node: KVNode) -> None:
        """Mark ``node``'s values as recently used."""
        if id(node) in self._kv_lru:
            self._kv_lru.move_to_end(id(node))
        if id(node) in self._logprobs_lru:
            self._logprobs_lru.move_to_end(id(node))

    def _prune(self) -> None:
        """Detach the nodes evictions and clears left with no value and no children (between
        batches, when no caller holds a node), so the trees stay bounded."""
        emptied, self._emptied = self._emptied, []
        prune(emptied)

    # -- chains ------------------------------------------------------------------------------

    def _reserve(self, extensions: Sequence[Extension]) -> None:
        """Make room for the `BlockAllocator.extend_all` of a batch about to run: let go of
        least recently used chains for the blocks it will allocate, then grow the pool once
        if the free blocks fall short. A pool sized once that eviction leaves short raises
        ``RuntimeError`` (nothing allocated)."""
        blocks = self._blocks.blocks_for(extensions)
        self._evict(blocks)
        self._blocks.grow_for(blocks)

    def _pin(self, node: KVNode) -> None:
        """Keep ``node``'s chain until a clear, outside the budget."""
        if node.chain is not None and not node.pinned:
            self._set_chain(node, self._blocks.hold(node.chain), pinned=True)

    def _set_chain(self, node: KVNode, chain: Chain | None, pinned: bool = False) -> None:
        """Give ``node`` a chain (held by the caller; the node takes that hold), or drop its chain."""
        if node.chain is not None:
            if node.pinned:
                self._blocks.unpin(node.chain)
            self._blocks.let_go(node.chain)
            self._kv_lru.pop(id(node), None)
        node.chain, node.pinned = chain, pinned and chain is not None
        if chain is None:
            return
        if node.pinned:
            self._blocks.pin(chain)
        else:
            self._kv_lru[id(node)] = node

    def _evict(self, reserve_blocks: int = 0) -> None:
        """Let go of least recently used unpinned chains until ``reserve_blocks`` more fit
        the budget and, in a pool sized once, are free (and at most ``max_kv_entries``
        chains are left)."""
        limit = self._blocks.limit(reserve_blocks)
        lru = self._kv_lru
        while lru and _over(self._blocks.budgeted, limit, len(lru), self.max_kv_entries):
            node = next(iter(lru.values()))
            if id(node) in self._protected:
                break
            self._set_chain(node, None)
            self._emptied.append(node)

    def clear_kv(self) -> None:
        """Let go of every chain (pinned ones too); logprobs stay, and the nodes left with
        no value are detached. The pool shrinks back (`BlockAllocator.shrink`)."""
        for root in self._roots.values():
            for node in subtree(root):
                if node.chain is not None:
                    self._set_chain(node, None)
                    self._emptied.append(node)
        self._prune()
        self._blocks.shrink()

    # -- logprobs ----------------------------------------------------------------------------

    def _set_logprobs(self, node: KVNode, logprobs: Any) -> None:
        """Cache ``node``'s next-token logprobs (None: drop them), evicting LRU ones over budget."""
        if node.logprobs is not None:
            self._memory.uncharge(node.logprobs)
            self._logprobs_lru.pop(id(node), None)
        node.logprobs = logprobs
        if logprobs is None:
            return
        self._memory.charge(logprobs)
        self._logprobs_lru[id(node)] = node
        self._evict_logprobs(self.max_logprobs_bytes, self.max_logprobs_entries)

    def _make_room_for_logprobs(self, nbytes: int, entries: int) -> None:
        """Evict least recently used logprobs so that ``entries`` more values in ``nbytes``
        bytes of memory fit the budgets: a batch about to run then reuses the memory its
        predecessors free (a budget smaller than the batch is emptied)."""
        limit, most = self.max_logprobs_bytes, self.max_logprobs_entries
        self._evict_logprobs(
            None if limit is None else limit - nbytes, None if most is None else most - entries
        )

    def _evict_logprobs(self, limit: int | None, most: int | None) -> None:
        """Let go of least recently used logprobs until their memory is at most ``limit``
        bytes and at most ``most`` are kept (None: no bound)."""
        lru = self._logprobs_lru
        while lru and _over(self._memory.nbytes, limit, len(lru), most):
            oldest = next(iter(lru.values()))
            self._set_logprobs(oldest, None)
            self._emptied.append(oldest)


def _over(used: int, limit: int | None, kept: int, most: int | None) -> bool:
    """Whether an LRU budget is exceeded: ``used`` over ``limit`` or ``kept`` entries over
    ``most`` (None: no bound)."""
    return (limit is not None and used > limit) or (most is not None and kept > most)

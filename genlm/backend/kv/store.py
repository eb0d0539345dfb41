"""`PrefixKVStore`: a paged prefix-KV store shared by particles (framework-agnostic policy).

KV states live in fixed-size blocks of ``block_size`` tokens inside a `BlockPool`
(`genlm.backend.kv.pool`), whose size this module sets; it hands out block ids and
decides what they hold.

- A prefix tree (`KVNode`, a plain record per token prefix, one tree per adapter) maps
  a prefix to its *chain*: the ids of the blocks holding its KV, token ``j`` in block
  ``chain[j // block_size]`` at offset ``j % block_size``.
- Blocks are reference-counted: every chain holding a block (a node's, or a row's while
  a batch runs) counts once, so particles that share a prompt share its blocks. The node
  a row reads its KV from is kept out of eviction while its batch runs (`protect`).
- A decode step costs O(new tokens) per request in Python, whatever its context: `find`
  starts from the node that `node_for` made for the request's prefix on an earlier step;
  the rows of a batch hold the blocks they share by one count in C (`extend_all`), a row
  appended to in place within its last block keeps its source's chain tuple, and a
  chain's blocks are let go in one loop.
- Extending a prefix (`extend`) shares its full blocks; its partly filled last block is
  appended to in place when nobody has written past the prefix in it yet, and copied
  otherwise (copy-on-write: only a partly filled last block is ever copied).
- The budget counts exactly the blocks held by unpinned chains (optionally also how
  many such chains there are); least recently used chains are released first. Pinned
  chains (`pin`) are outside the budget.
- Next-token log-probabilities cached at the nodes have their own LRU budget (bytes,
  optionally also entries). The bytes are those of the memory the values occupy: rows
  that are views of one batch (`memory_key`) count their batch once while any is cached.
- The pool's size (`capacity`) follows what is held: the lowest free block is handed
  out first, so held blocks stay at the low end; before a batch `reserve` evicts for the
  blocks its rows will allocate and grows the pool once, in steps of a quarter (at least
  `INITIAL_BLOCKS`) but never past what the budget allows (plus pinned blocks) or, when
  the rows need more, past what they need; `clear` and `clear_kv` shrink the pool back
  to `INITIAL_BLOCKS`, and `trim` halves it between batches while three quarters of it
  are free. Without a byte budget the pool doubles. `free` (a closed LM) lets go of all
  of it.
- A pool sized once (``fixed_capacity``: on CUDA, where captured graphs hold its
  addresses) is allocated at construction and never resized: `reserve` evicts until the
  batch's blocks are free, and raises when even that leaves too few.

A batch goes through three verbs that hold its order of work: `plan` (each query's
node, its cached logprobs or a `RowPlan` to compute: the deepest usable KV source touched
and protected, with KV reuse the blocks reserved, the rows' chains made and their
copy-on-write copies applied to the pool, room made in the logprobs budget), then either
`commit` (each row's logprobs cached at its node, its chain given to the node) or
`release` (the rows' chains let go); both end by unprotecting the sources and evicting,
trimming and pruning. A backend's forward, between the two, reads each row's chain and
writes its new tokens' KV into the blocks its chain holds past ``start``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from genlm.backend.checks import check_budget, check_int

# BlockCopy is also this module's name (SPEC lists it with the store's).
from genlm.backend.kv.pool import BlockCopy, BlockPool, Chain, NoKVPool

__all__ = [
    "INITIAL_BLOCKS",
    "ZERO_BLOCK",
    "BatchPlan",
    "BlockCopy",
    "Chain",
    "KVNode",
    "PrefixKVStore",
    "RowPlan",
]

# Block 0 is never handed out: backends keep it zeroed and point padding at it.
ZERO_BLOCK = 0
# Blocks in the pool after a clear, and the smallest growth step under a budget.
INITIAL_BLOCKS = 64


@dataclass(eq=False, repr=False, slots=True)
class KVNode:
    """One token prefix: its children, cached next-token logprobs and KV chain (plain data;
    slotted: a tree holds a node per token of every cached prefix)."""

    parent: KVNode | None = None
    token: int | None = None
    depth: int = 0
    children: dict[int, KVNode] = field(default_factory=dict)
    logprobs: Any = None
    chain: Chain | None = None
    pinned: bool = False

    def __repr__(self) -> str:
        """One line about this node alone: a tree thousands of tokens deep (parent and
        children link every node) prints in constant time and space."""
        blocks = 0 if self.chain is None else len(self.chain)
        return (
            f"KVNode(depth={self.depth}, token={self.token}, children={len(self.children)}, "
            f"blocks={blocks}, pinned={self.pinned}, logprobs={self.logprobs is not None})"
        )


@dataclass(frozen=True, slots=True)
class RowPlan:
    """One row of a batch's forward: its ``new_tokens`` (``len(ids) - start``), the ids
    from ``start`` on, run on top of the KV of ``ids[:start]``, held in the chain of
    ``source`` (which evictions leave alone while the batch runs). With KV reuse
    ``chain``, the row's own for ``ids`` whole, holds that KV and gets the new tokens'.
    ``node``: the node of ``ids`` in the tree of ``lora`` (an adapter's name, None for the
    base model); ``slot``: the query's position in the batch."""

    slot: int
    ids: tuple[int, ...]
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
    lets it go; ``pin``: the rows' KV is pinned at commit (`cache_kv`)."""

    cached: tuple[Any, ...]
    rows: tuple[RowPlan, ...]
    pin: bool = False


class PrefixKVStore:
    """Blocks, prefix trees (one per adapter key), reference counts, LRU budgets and pins.

    Args:
        pool: the KV memory (its ``block_size`` and ``block_bytes``); the store resizes it
            (`BlockPool.resize`) only when every block past the new size is free.
        max_kv_bytes: budget for blocks held by unpinned chains (None: unbounded).
        max_logprobs_bytes: budget for cached logprobs (None: unbounded).
        nbytes: bytes of the memory a logprobs value occupies (default `memory_nbytes`:
            a torch tensor's storage, counted once for the values sharing it).
        max_kv_entries: most unpinned chains kept (None: unbounded).
        max_logprobs_entries: most logprobs values kept (None: unbounded).
        fixed_capacity: the pool's blocks (block 0 included), allocated here and never
            resized (None: the pool follows what is held, see `capacity`).
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
        self.max_kv_bytes = max_kv_bytes
        self.max_logprobs_bytes = max_logprobs_bytes
        self.max_kv_entries = max_kv_entries
        self.max_logprobs_entries = max_logprobs_entries
        self.fixed_capacity = fixed_capacity
        self._nbytes = memory_nbytes if nbytes is None else nbytes
        self._forget(1)
        self._resize(fixed_capacity or INITIAL_BLOCKS)

    # -- state -------------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every tree, chain and logprob; the pool goes back to `INITIAL_BLOCKS`
        (a pool sized once keeps its blocks)."""
        self._forget(self.capacity)
        self._resize(self.fixed_capacity or INITIAL_BLOCKS)

    def free(self) -> None:
        """Forget every tree, chain and logprob, and let go of all the pool's memory
        (`BlockPool.free`), not just shrink it (a closed LM's store). The trees' nodes are
        emptied too, so that one a caller still holds (an old root) keeps no tree alive.
        Block 0 alone is left (`capacity` 1, no free block), so the store stays consistent:
        the next `reserve` or `extend` grows the pool again (to ``fixed_capacity``, if
        set), allocating it afresh."""
        for root in self.roots.values():
            for node in _subtree(root):
                node.children.clear()
                node.logprobs = node.chain = None
                node.pinned = False
        self._forget(1)
        self.pool.free()

    def _forget(self, capacity: int) -> None:
        """Empty state over ``capacity`` blocks: no tree, no chain, no logprob; block 0
        alone held."""
        self.roots: dict[Hashable, KVNode] = {}
        free = capacity - 1
        self._refs: list[int] = [1] + [0] * free  # block 0 (ZERO_BLOCK) is held forever
        self._pins: list[int] = [1] + [0] * free
        self._fill: list[int] = [0] * capacity
        # a heap (sorted, so already one): the lowest free block is handed out first
        self._free: list[int] = list(range(1, capacity))
        self._counted = 0  # blocks held by some chain and by no pinned one
        self._pinned = 0  # blocks held by some pinned chain
        self._kv_lru: OrderedDict[int, KVNode] = OrderedDict()
        self._logprobs_lru: OrderedDict[int, KVNode] = OrderedDict()
        self._memories: dict[Hashable, int] = {}  # cached values per memory (`memory_key`)
        self.logprobs_nbytes = 0
        self._emptied: list[KVNode] = []
        self._recent = RecentNodes()
        self._protected: set[int] = set()  # ids of nodes `protect` keeps from eviction

    @property
    def capacity(self) -> int:
        """Blocks in the pool (block 0 included).

        With a budget, growing never takes it past ``1 + budget blocks + pinned blocks``,
        or, when more are held or reserved, past ``1 + held blocks + the blocks asked for``
        (the rows of a running batch may hold blocks beyond the budget). A pool sized once
        has ``fixed_capacity`` blocks (1 after `free`, until it is needed again).
        """
        return len(self._refs)

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the blocks held by unpinned chains (the budgeted KV)."""
        return self._counted * self.block_bytes

    @property
    def held_blocks(self) -> int:
        """Blocks held by any chain, pinned or not (block 0 excluded)."""
        return self._counted + self._pinned

    def root(self, key: Hashable) -> KVNode:
        """The root of the prefix tree for ``key`` (an adapter name, None for the base model)."""
        root = self.roots.get(key)
        if root is None:
            root = self.roots[key] = KVNode()
        return root

    def drop_root(self, key: Hashable) -> None:
        """Forget the tree of ``key`` and release everything it holds."""
        root = self.roots.pop(key, None)
        if root is not None:
            self._recent = RecentNodes()
            for node in _subtree(root):
                self.set_logprobs(node, None)
                self.set_chain(node, None)

    # -- a batch: plan, then commit or release --------------------------------------------------

    def plan(
        self,
        queries: Sequence[tuple[tuple[int, ...], str | None]],
        row_nbytes: int,
        *,
        pin: bool = False,
    ) -> BatchPlan:
        """The order of work of a batch of distinct ``(ids, lora)`` queries, up to its
        forward: each query's cached logprobs (touched), or for the rest a `RowPlan` (its
        node made, its KV source touched and protected); with KV reuse, room made for the
        rows' blocks, their chains made and the copy-on-write copies applied to the pool;
        then room made in the logprobs budget for the rows (of ``row_nbytes`` each), so the
        forward reuses the memory of those it pushes out. With ``pin`` (`cache_kv`) every
        query is computed and its node's chain pinned at `commit`.

        The plan ends with `commit` (its rows computed) or `release`; if planning fails,
        what it held is let go before the error propagates."""
        cached: list[Any] = []
        rows: list[RowPlan] = []
        try:
            for slot, (ids, lora) in enumerate(queries):
                node, depth = self.find(
                    lora, ids, getattr(ids, "encoding", None), getattr(ids, "parent_hash", None)
                )
                if not pin and depth == len(ids) and node.logprobs is not None:
                    self.touch(node)
                    cached.append(node.logprobs)
                    continue
                cached.append(None)
                source, start = self._kv_start(node, len(ids))
                if source is not None:
                    self.touch(source)
                    self.protect(source)
                target = self.node_for(lora, node, ids, getattr(ids, "encoding", None))
                rows.append(RowPlan(slot, ids, lora, target, start, len(ids) - start, source))
            if rows and self.kv_reuse:
                rows = self._with_chains(rows)
            if rows:
                self._make_room_for_rows(len(rows), row_nbytes)
        except BaseException:
            self._finish(rows, 0)
            raise
        return BatchPlan(tuple(cached), tuple(rows), pin)

    def commit(self, plan: BatchPlan, rows: Sequence[Any]) -> list[Any]:
        """Cache each row's logprobs (``rows``, in the order of ``plan.rows``) at its node
        and give the node the row's chain (a node holding a pinned chain keeps it: the row's
        is let go), pinning it for a ``pin`` plan; then end the plan as `release` does.
        Returns every query's logprobs, in order."""
        if len(rows) != len(plan.rows):
            self._finish(plan.rows, 0)
            raise ValueError(f"{len(rows)} rows computed for a plan of {len(plan.rows)}")
        answers = list(plan.cached)
        given = 0  # rows whose chains went to their nodes (or were let go)
        try:
            for row, logprobs in zip(plan.rows, rows, strict=True):
                node = row.node
                self.set_logprobs(node, logprobs)
                answers[row.slot] = logprobs
                if row.chain and node.pinned:
                    self.let_go(row.chain)
                elif row.chain:
                    self.set_chain(node, row.chain)
                given += 1
                if plan.pin:
                    self.pin(node)
        finally:
            self._finish(plan.rows, given)
        return answers

    def release(self, plan: BatchPlan) -> None:
        """End a plan whose rows were not computed: let go of their chains (their nodes,
        left without values, are pruned), unprotect the sources, evict, trim and prune."""
        self._finish(plan.rows, 0)

    def kv_start(self, key: Hashable, ids: Sequence[int]) -> tuple[KVNode | None, int]:
        """Where a request for ``ids`` in the tree of ``key`` starts (`walk_cache`): the node
        whose chain holds the KV it reuses and the first token still to run, at most
        ``len(ids) - 1`` (``(None, 0)``: no KV to reuse)."""
        return self._kv_start(self.find(key, ids)[0], len(ids))

    def _kv_start(self, node: KVNode, length: int) -> tuple[KVNode | None, int]:
        """`kv_start` of a prefix of ``length`` ids from ``node``, the deepest node on its path."""
        source = self.kv_source(node) if self.kv_reuse else None
        if source is None or source.chain is None:
            return None, 0
        return source, min(source.depth, node.depth, length - 1)

    def _with_chains(self, rows: list[RowPlan]) -> list[RowPlan]:
        """The rows with their own chains: room made for them in the pool first, then the
        copy-on-write copies applied (the chains let go if that fails)."""
        needs = [(_chain_of(row.source), row.start, len(row.ids)) for row in rows]
        self.reserve(needs)
        chains, copies = self.extend_all(needs)
        try:
            self.pool.copy(copies)
        except BaseException:
            for chain in chains:
                self.let_go(chain)
            raise
        return [
            RowPlan(
                row.slot, row.ids, row.lora, row.node, row.start, row.new_tokens, row.source, chain
            )
            for row, chain in zip(rows, chains, strict=True)
        ]

    def _make_room_for_rows(self, rows: int, row_nbytes: int) -> None:
        """`make_room_for_logprobs` for a batch of ``rows`` rows (a batch larger than the
        budget: the budget's worth, as its rows are then kept apart)."""
        nbytes = rows * row_nbytes
        budget = self.max_logprobs_bytes
        self.make_room_for_logprobs(nbytes if budget is None else min(nbytes, budget), rows)

    def _finish(self, rows: Sequence[RowPlan], given: int) -> None:
        """End a batch: the chains of ``rows[given:]`` let go (their nodes, if left empty,
        pruned), every source unprotected, KV brought back within budget, a mostly free
        pool shrunk, the trees pruned."""
        for row in rows[given:]:
            self.let_go(row.chain)
            self._emptied.append(row.node)
        for row in rows:
            if row.source is not None:
                self.unprotect(row.source)
        self.evict()
        self.trim()
        self.prune()

    # -- tree --------------------------------------------------------------------------------

    @staticmethod
    def walk(node: KVNode, ids: Sequence[int]) -> tuple[KVNode, int]:
        """Follow ``ids`` from ``node`` (a root, or a node on the path of ``ids``) as far as
        the tree goes: ``(deepest node, tokens of ids it covers)``."""
        for i in range(node.depth, len(ids)):
            child = node.children.get(ids[i])
            if child is None:
                return node, i
            node = child
        return node, len(ids)

    def find(
        self,
        key: Hashable,
        ids: Sequence[int],
        encoding: bytes | None = None,
        parent_hash: int | None = None,
    ) -> tuple[KVNode, int]:
        """`walk` in the tree of ``key``, from the node of ``ids[:-1]`` (whose hash is
        ``parent_hash``) or of ``ids`` when `node_for` made it recently (a decode step
        extends the previous step's prefixes): O(new tokens) rather than O(len(ids)).
        ``encoding``: the prefix-free code of ``ids`` that tells recent nodes apart
        (`TokenIds.encoding`); without it the walk starts at the root."""
        node = None
        if encoding is not None:
            if parent_hash is not None:
                node = self._recent.get(key, parent_hash, len(ids) - 1, encoding)
            if node is None:
                node = self._recent.get(key, hash(ids), len(ids), encoding)
        return self.walk(self.root(key) if node is None else node, ids)

    def node_for(
        self, key: Hashable, node: KVNode, ids: Sequence[int], encoding: bytes | None = None
    ) -> KVNode:
        """`node_at` in the tree of ``key``; with ``encoding`` (see `find`), remembered for
        `find`."""
        node = self.node_at(node, ids)
        if encoding is not None:
            self._recent.add(key, hash(ids), encoding, node)
        return node

    @staticmethod
    def node_at(node: KVNode, ids: Sequence[int]) -> KVNode:
        """The node for ``ids`` below ``node`` (at depth ``node.depth``), created as needed."""
        for token in ids[node.depth :]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = KVNode(node, token, node.depth + 1)
            node = child
        return node

    def kv_source(self, node: KVNode, search: int = 256) -> KVNode | None:
        """The node whose chain holds the longest KV usable for ``node``'s prefix: the
        nearest ancestor-or-self with a chain, or a descendant's (its chain starts with
        ``node``'s prefix; a few nodes are searched). None for a root."""
        if node.parent is None:
            return None
        ancestor: KVNode | None = node
        while ancestor is not None and ancestor.chain is None:
            ancestor = ancestor.parent
        if ancestor is node:
            return node
        stack = list(node.children.values())
        while stack and search > 0:
            search -= 1
            candidate = stack.pop()
            if candidate.chain is not None:
                return candidate
            stack.extend(candidate.children.values())
        return ancestor

    def protect(self, node: KVNode) -> None:
        """Keep ``node``'s chain through evictions (a running batch reads it) until
        `unprotect`: O(1), unlike holding each of its blocks. `touch` it first: eviction
        stops at the least recently used protected node (it keeps its place in the LRU
        order)."""
        self._protected.add(id(node))

    def unprotect(self, node: KVNode) -> None:
        """Let evictions take ``node``'s chain again."""
        self._protected.discard(id(node))

    def touch(self, node: KVNode) -> None:
        """Mark ``node``'s values as recently used."""
        if id(node) in self._kv_lru:
            self._kv_lru.move_to_end(id(node))
        if id(node) in self._logprobs_lru:
            self._logprobs_lru.move_to_end(id(node))

    # -- chains ------------------------------------------------------------------------------

    def reserve(self, extensions: Sequence[tuple[Chain | None, int, int]]) -> None:
        """Make room for the `extend` calls ``(chain, length, total)`` of a batch about to
        run: release least recently used chains for the blocks they will allocate, then
        grow the pool once if the free blocks fall short (see `capacity`). A pool sized
        once that eviction leaves short raises ``RuntimeError`` (nothing allocated)."""
        size = self.block_size
        claimed: set[int] = set()  # partly filled blocks an earlier extension appends to in place
        blocks = 0
        for chain, length, total in extensions:
            full, partial = divmod(length, size) if chain else (0, 0)
            blocks += -(-total // size) - full
            if partial and chain:
                last = chain[full]
                if self._fill[last] == partial and last not in claimed:
                    claimed.add(last)
                    blocks -= 1
        self.evict(blocks)
        self._grow_for(blocks)

    def extend(self, chain: Chain | None, length: int, total: int) -> tuple[Chain, list[BlockCopy]]:
        """A new chain for ``total`` tokens whose first ``length`` are those of ``chain``
        (a held chain).

        Full blocks of the shared part are shared; a partly filled last block is appended
        to in place if nothing was written past ``length`` in it, else copied (returned as
        a `BlockCopy` for the backend to apply before writing). The chain is held by the
        caller until it is given to a node (`set_chain`) or let go (`let_go`).
        """
        chains, copies = self.extend_all([(chain, length, total)])
        return chains[0], copies

    def extend_all(
        self, extensions: Sequence[tuple[Chain | None, int, int]]
    ) -> tuple[list[Chain], list[BlockCopy]]:
        """`extend` each ``(chain, length, total)`` of a batch, in order: the new chains
        and all their copies. The full blocks they share are held by one count over the
        batch (a decode step's rows all share the prompt's blocks): each is held already,
        by the chain extended, so holding it again changes its count alone, never what is
        free or budgeted. A chain appended to in place within its last block is returned
        as it is (the same blocks: no new tuple). If an extension fails, the chains made
        before it are released."""
        size, fill = self.block_size, self._fill
        chains: list[Chain] = []
        copies: list[BlockCopy] = []
        shared: list[Chain] = []  # the full blocks each new chain shares, held at the end
        tail: list[int] = []  # the blocks after the shared full ones, of the chain being made
        try:
            for chain, length, total in extensions:
                full, partial = divmod(length, size)
                if chain is None:
                    chain, full, partial = (), 0, 0
                tail = []
                if partial:
                    last = chain[full]
                    if fill[last] == partial:  # appended to in place
                        self._hold(last, 1, 0)
                    else:
                        new = self._allocate()
                        copies.append(BlockCopy(last, new, partial))
                        last = new
                    fill[last] = min(size, total - full * size)
                    tail.append(last)
                while (full + len(tail)) * size < total:
                    new = self._allocate()
                    fill[new] = min(size, total - (full + len(tail)) * size)
                    tail.append(new)
                head = chain[:full]
                # a decode step's row, appended to within its last block: the same blocks
                same = len(chain) == full + 1 and tail == [chain[full]]
                chains.append(chain if same else head + tuple(tail))
                tail = []
                if full:
                    shared.append(head)
        finally:
            refs = self._refs
            for block, count in Counter(itertools.chain.from_iterable(shared)).items():
                refs[block] += count
            if len(chains) < len(extensions):
                self._hold_blocks(tail, -1)
                for made in chains:
                    self.let_go(made)
        return chains, copies

    def hold(self, chain: Chain) -> Chain:
        """Hold ``chain``'s blocks; `let_go` of them."""
        self._hold_blocks(chain, 1)
        return chain

    def let_go(self, chain: Chain | None) -> None:
        """Let go of a chain from `extend` that no node took, or of one from `hold`."""
        self._hold_blocks(chain or (), -1)

    def pin(self, node: KVNode) -> None:
        """Keep ``node``'s chain until a clear, outside the budget."""
        if node.chain is not None and not node.pinned:
            self.set_chain(node, self.hold(node.chain), pinned=True)

    def set_chain(self, node: KVNode, chain: Chain | None, pinned: bool = False) -> None:
        """Give ``node`` a chain (held by the caller; the node takes that hold), or drop its chain."""
        if node.chain is not None:
            if node.pinned:
                for block in node.chain:
                    self._hold(block, -1, -1)
            else:
                self._hold_blocks(node.chain, -1)
            self._kv_lru.pop(id(node), None)
        node.chain, node.pinned = chain, pinned and chain is not None
        if chain is None:
            return
        if node.pinned:
            for block in chain:
                self._hold(block, 0, 1)
        else:
            self._kv_lru[id(node)] = node

    def evict(self, reserve_blocks: int = 0) -> None:
        """Release least recently used unpinned chains until ``reserve_blocks`` more fit
        the budget and, in a pool sized once, are free (and at most ``max_kv_entries``
        chains are left)."""
        limit = None
        if self.max_kv_bytes is not None:
            limit = self.max_kv_bytes // self.block_bytes - reserve_blocks
        if self.fixed_capacity is not None:
            room = self.fixed_capacity - 1 - self._pinned - reserve_blocks
            limit = room if limit is None or room < limit else limit
        lru = self._kv_lru
        while lru and _over(self._counted, limit, len(lru), self.max_kv_entries):
            node = next(iter(lru.values()))
            if id(node) in self._protected:
                break
            self.set_chain(node, None)
            self._emptied.append(node)

    def clear_kv(self) -> None:
        """Release every chain (pinned ones too); logprobs stay. The pool shrinks back to
        `INITIAL_BLOCKS` (or to the highest block a caller still holds), unless sized once."""
        for root in self.roots.values():
            for node in _subtree(root):
                self.set_chain(node, None)
        if self.fixed_capacity is None:
            self._resize(max(INITIAL_BLOCKS, self._top()))

    def trim(self) -> None:
        """Halve the pool (not below `INITIAL_BLOCKS`) when its upper three quarters are
        free; call between batches. Repeated calls follow a lasting drop in use without
        shrinking a pool that the next batch will grow again. A pool sized once stays."""
        if self.fixed_capacity is not None:
            return
        capacity = self.capacity
        if capacity > INITIAL_BLOCKS and 4 * (self.held_blocks + 1) <= capacity:
            if 4 * self._top() <= capacity:
                self._resize(max(INITIAL_BLOCKS, capacity // 2))

    # -- logprobs ----------------------------------------------------------------------------

    def set_logprobs(self, node: KVNode, logprobs: Any) -> None:
        """Cache ``node``'s next-token logprobs (None: drop them), evicting LRU ones over budget."""
        if node.logprobs is not None:
            self._uncharge(node.logprobs)
            self._logprobs_lru.pop(id(node), None)
        node.logprobs = logprobs
        if logprobs is None:
            return
        self._charge(logprobs)
        self._logprobs_lru[id(node)] = node
        self._evict_logprobs(self.max_logprobs_bytes, self.max_logprobs_entries)

    def make_room_for_logprobs(self, nbytes: int, entries: int) -> None:
        """Evict least recently used logprobs so that ``entries`` more values in ``nbytes``
        bytes of memory fit the budgets: a batch about to run then reuses the memory its
        predecessors free (a budget smaller than the batch is emptied)."""
        limit, most = self.max_logprobs_bytes, self.max_logprobs_entries
        self._evict_logprobs(
            None if limit is None else limit - nbytes, None if most is None else most - entries
        )

    def _evict_logprobs(self, limit: int | None, entries: int | None) -> None:
        lru = self._logprobs_lru
        while lru and _over(self.logprobs_nbytes, limit, len(lru), entries):
            oldest = next(iter(lru.values()))
            self.set_logprobs(oldest, None)
            self._emptied.append(oldest)

    def _charge(self, value: Any) -> None:
        """Count a value's memory, once for all the cached values that share it."""
        key = memory_key(value)
        held = self._memories.get(key, 0)
        if not held:
            self.logprobs_nbytes += self._nbytes(value)
        self._memories[key] = held + 1

    def _uncharge(self, value: Any) -> None:
        key = memory_key(value)
        held = self._memories.pop(key) - 1
        if held:
            self._memories[key] = held
        else:
            self.logprobs_nbytes -= self._nbytes(value)

    def prune(self) -> None:
        """Detach the nodes evictions left with no value and no children (call between
        batches, when no caller holds a node), so the trees stay bounded."""
        emptied, self._emptied = self._emptied, []
        for node in emptied:
            while (
                node.parent is not None
                and node.token is not None
                and not node.children
                and node.logprobs is None
                and node.chain is None
                and node.parent.children.get(node.token) is node
            ):
                del node.parent.children[node.token]
                node = node.parent

    # -- blocks ------------------------------------------------------------------------------

    def _hold(self, block: int, refs: int, pins: int) -> None:
        before = self._refs[block] > 0 and self._pins[block] == 0
        pinned_before = self._pins[block] > 0
        self._refs[block] += refs
        self._pins[block] += pins
        after = self._refs[block] > 0 and self._pins[block] == 0
        self._counted += after - before
        self._pinned += (self._pins[block] > 0) - pinned_before
        if not self._refs[block]:
            self._fill[block] = 0
            heapq.heappush(self._free, block)

    def _hold_blocks(self, blocks: Sequence[int], refs: int) -> None:
        """`_hold` (no pins) of every block of ``blocks`` in one loop without a call per
        block: a chain's blocks are all held or let go at once."""
        counts, pins = self._refs, self._pins
        for block in blocks:
            before = counts[block]
            counts[block] = after = before + refs
            if (before > 0) is not (after > 0):
                if not pins[block]:
                    self._counted += 1 if after else -1
                if not after:
                    self._fill[block] = 0
                    heapq.heappush(self._free, block)

    def _allocate(self) -> int:
        self.evict(1)
        self._grow_for(1)
        block = heapq.heappop(self._free)
        self._hold(block, 1, 0)
        return block

    def _grow_for(self, blocks: int) -> None:
        """Grow the pool so that ``blocks`` blocks are free: doubling without a budget; with
        one, by a quarter (at least `INITIAL_BLOCKS`), capped at the budget's blocks plus
        the pinned ones, unless what is held and asked for needs more (then exactly that).
        A pool sized once is only allocated again (after `free`); ``RuntimeError`` if it
        has too few free blocks."""
        short = blocks - len(self._free)
        if short <= 0:
            return
        capacity = self.capacity
        if self.fixed_capacity is not None:
            if capacity < self.fixed_capacity:
                self._resize(self.fixed_capacity)
            if blocks > len(self._free):
                raise RuntimeError(
                    f"the KV pool, sized once at {self.fixed_capacity - 1} blocks, cannot "
                    f"hold this batch: its rows need {blocks} new blocks and {len(self._free)} "
                    f"are free after evicting what the batch does not read ({self._pinned} "
                    f"blocks pinned, {self._counted} held by prefixes in use); give the LM a "
                    "larger KV budget (max_kv_bytes) or run fewer or shorter rows at once"
                )
            return
        needed = capacity + short
        if self.max_kv_bytes is None:
            self._resize(max(needed, 2 * capacity))
            return
        bound = 1 + self.max_kv_bytes // self.block_bytes + self._pinned
        step = max(INITIAL_BLOCKS, capacity // 4)
        self._resize(max(needed, min(capacity + step, bound)))

    def _top(self) -> int:
        """One past the highest held block (1 when only block 0 is held)."""
        top = self.capacity
        while top > 1 and not self._refs[top - 1]:
            top -= 1
        return top

    def _resize(self, capacity: int) -> None:
        """Resize the pool to ``capacity`` blocks (every block from ``capacity`` on is free)."""
        old = self.capacity
        if capacity == old:
            return
        self.pool.resize(capacity)
        if capacity < old:
            del self._refs[capacity:], self._pins[capacity:], self._fill[capacity:]
            self._free = [block for block in self._free if block < capacity]
        else:
            self._refs += [0] * (capacity - old)
            self._pins += [0] * (capacity - old)
            self._fill += [0] * (capacity - old)
            self._free.extend(range(old, capacity))
        heapq.heapify(self._free)


class RecentNodes:
    """The nodes `PrefixKVStore.node_for` made lately, by tree key and prefix hash: two
    generations of about ``budget`` tokens each (a hit in the older one moves to the
    newer). A node is returned only for the prefix it was added with, told by the
    prefix's encoding (`TokenIds.encoding`: a prefix-free code of its ids, kept with the
    node; prefixes whose hashes collide only miss), and only while attached (a node that
    `PrefixKVStore.prune` detached is no longer its parent's child); the store starts a
    new one when it drops a tree. An entry holds an int, bytes and the node: no prefix (a
    tuple of references the collector would walk) and no object of its own."""

    def __init__(self, budget: int = 1 << 20):
        self.budget = budget
        self._current: dict[Hashable, _RecentTree] = {}
        self._previous: dict[Hashable, _RecentTree] = {}
        self._tokens = 0

    def get(self, key: Hashable, prefix_hash: int, depth: int, encoding: bytes) -> KVNode | None:
        """The node of the first ``depth`` ids of a prefix encoded by ``encoding``, if it was
        added with hash ``prefix_hash``."""
        tree = self._current.get(key, _NO_TREE)
        node = tree.nodes.get(prefix_hash)
        if node is None:
            tree = self._previous.get(key, _NO_TREE)
            node = tree.nodes.get(prefix_hash)
            if node is None:
                return None
            self.add(key, prefix_hash, tree.encodings[prefix_hash], node)
        if node.depth != depth or not encoding.startswith(tree.encodings[prefix_hash]):
            return None
        parent, token = node.parent, node.token
        attached = parent is not None and token is not None and parent.children.get(token) is node
        return node if attached else None

    def add(self, key: Hashable, prefix_hash: int, encoding: bytes, node: KVNode) -> None:
        """Remember ``node``, the node of the prefix with this hash and encoding."""
        self._tokens += node.depth
        if self._tokens > self.budget:
            self._previous, self._current, self._tokens = self._current, {}, node.depth
        tree = self._current.get(key)
        if tree is None:
            tree = self._current[key] = _RecentTree()
        tree.nodes[prefix_hash] = node
        tree.encodings[prefix_hash] = encoding


class _RecentTree:
    """The recent nodes of one tree in one generation of `RecentNodes`, by prefix hash,
    and their prefixes' encodings."""

    __slots__ = ("encodings", "nodes")

    def __init__(self) -> None:
        self.nodes: dict[int, KVNode] = {}
        self.encodings: dict[int, bytes] = {}


# What `RecentNodes.get` looks in for a tree key it has no nodes of (only read).
_NO_TREE = _RecentTree()


def memory_key(value: Any) -> Hashable:
    """What names the memory a cached value occupies: a torch tensor's storage (the rows
    of one batch, views of it, share it), else the value itself."""
    storage = getattr(value, "untyped_storage", None)
    return id(value) if storage is None else ("storage", storage().data_ptr())


def memory_nbytes(value: Any) -> int:
    """Bytes of the memory a cached value occupies (`memory_key`): a torch tensor's whole
    storage, else ``value.nbytes``."""
    storage = getattr(value, "untyped_storage", None)
    return int(value.nbytes) if storage is None else storage().nbytes()


def _over(used: int, limit: int | None, kept: int, entries: int | None) -> bool:
    """Whether an LRU budget is exceeded: ``used`` over ``limit`` or ``kept`` entries over
    ``entries`` (None: no bound)."""
    return (limit is not None and used > limit) or (entries is not None and kept > entries)


def _chain_of(source: KVNode | None) -> Chain | None:
    return None if source is None else source.chain


def _subtree(root: KVNode) -> list[KVNode]:
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes

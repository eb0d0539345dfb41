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
  starts from a node the caller remembers for the request's prefix from an earlier step;
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
  the rows need more, past what they need; `reset` and `clear_kv` shrink the pool back
  to `INITIAL_BLOCKS`, and `trim` halves it between batches while three quarters of it
  are free. Without a byte budget the pool doubles. `free` (a closed LM) lets go of all
  of it.
- A pool sized once (``fixed_capacity``: on CUDA, where captured graphs hold its
  addresses) is allocated at construction and never resized: `reserve` evicts until the
  batch's blocks are free, and raises when even that leaves too few.

The caller applies the copies `extend` asks for (`BlockPool.copy`); a backend's forward
then reads a row's chain and writes its new tokens' KV into the blocks `extend` returned.
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
from genlm.backend.kv.pool import BlockCopy, BlockPool, Chain

__all__ = ["INITIAL_BLOCKS", "ZERO_BLOCK", "BlockCopy", "Chain", "KVNode", "PrefixKVStore"]

# Block 0 is never handed out: backends keep it zeroed and point padding at it.
ZERO_BLOCK = 0
# Blocks in the pool after a reset, and the smallest growth step under a budget.
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
        self.block_size = pool.block_size
        self.block_bytes = pool.block_bytes
        self.max_kv_bytes = max_kv_bytes
        self.max_logprobs_bytes = max_logprobs_bytes
        self.max_kv_entries = max_kv_entries
        self.max_logprobs_entries = max_logprobs_entries
        self.fixed_capacity = fixed_capacity
        self._nbytes = memory_nbytes if nbytes is None else nbytes
        self.roots: dict[Hashable, KVNode] = {}
        self._forget(1)
        self._resize(fixed_capacity or INITIAL_BLOCKS)

    # -- state -------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every tree, chain and logprob (the trees' nodes emptied: see `_forget`);
        the pool goes back to `INITIAL_BLOCKS` (a pool sized once keeps its blocks)."""
        self._forget(self.capacity)
        self._resize(self.fixed_capacity or INITIAL_BLOCKS)

    def free(self) -> None:
        """Forget every tree, chain and logprob, and let go of all the pool's memory
        (`BlockPool.free`), not just shrink it (a closed LM's store). Block 0 alone is left
        (`capacity` 1, no free block), so the store stays consistent: the next `reserve` or
        `extend` grows the pool again (to ``fixed_capacity``, if set), allocating it afresh."""
        self._forget(1)
        self.pool.free()

    def _forget(self, capacity: int) -> None:
        """Empty state over ``capacity`` blocks: no tree, no chain, no logprob; block 0
        alone held. The old trees' nodes are emptied, so that one a caller still holds (an
        old root, a node remembered for `find`) keeps no tree alive and is no longer
        attached."""
        for root in self.roots.values():
            for node in _subtree(root):
                node.children.clear()
                node.logprobs = node.chain = None
                node.pinned = False
        self.roots = {}
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
        """Forget the tree of ``key`` and release everything it holds (its nodes emptied,
        so that none is attached any more: `find`)."""
        root = self.roots.pop(key, None)
        if root is not None:
            for node in _subtree(root):
                self.set_logprobs(node, None)
                self.set_chain(node, None)
                node.children.clear()

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
        self, key: Hashable, ids: Sequence[int], near: KVNode | None = None
    ) -> tuple[KVNode, int]:
        """`walk` in the tree of ``key`` from ``near``, a node the caller remembers on the
        path of ``ids`` in that tree (the node it made for them or for a prefix of them on
        an earlier step: a decode step then walks O(new tokens), not O(len(ids))), used
        while it is still in the tree and no deeper than ``ids``; else from the root."""
        if near is None or near.depth > len(ids) or not _attached(near):
            near = self.root(key)
        return self.walk(near, ids)

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
        caller until it is given to a node (`set_chain`) or released (`release`).
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
                    self.release(made)
        return chains, copies

    def hold(self, chain: Chain) -> Chain:
        """Hold ``chain``'s blocks; `release` them."""
        self._hold_blocks(chain, 1)
        return chain

    def release(self, chain: Chain | None) -> None:
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


def _attached(node: KVNode) -> bool:
    """Whether ``node`` is still its parent's child (`prune` detaches a node and dropping a
    tree empties its nodes; an attached node's ancestors are attached, as a node is only
    detached once it has no children)."""
    parent, token = node.parent, node.token
    return parent is not None and token is not None and parent.children.get(token) is node


def _subtree(root: KVNode) -> list[KVNode]:
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes

"""`BlockAllocator`: who holds each block of a `BlockPool`, and the pool's size.

A chain (`genlm.backend.kv.pool.Chain`) is the ids of the blocks holding a prefix's KV.
Every chain holding a block (a node's, or a row's while a batch runs) counts once, so
particles that share a prompt share its blocks; a pinned chain counts again in the
block's pins. Extending a chain (`extend_all`) shares its full blocks and appends to its
partly filled last block in place when nobody has written past the prefix in it yet, else
copies it (copy-on-write). A decode step costs O(new tokens) per row: shared blocks are
held by one count in C, a chain appended to within its last block keeps its tuple.

The pool's size (`capacity`) follows what is held: the lowest free block is handed out
first, `grow_for` grows the pool once per batch, `trim` halves it while three quarters of
it are free. A pool sized once (``fixed_capacity``: under CUDA graphs, which hold its
addresses) is allocated at construction and never resized.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence

from genlm.backend.kv.pool import BlockCopy, BlockPool, Chain

# Block 0 is never handed out: backends keep it zeroed and point padding at it.
ZERO_BLOCK = 0
# Blocks in the pool after a clear, and the smallest growth step under a budget.
INITIAL_BLOCKS = 64

# What `extend_all` makes: ``(chain, length, total)``, a chain of ``total`` tokens whose
# first ``length`` are those of ``chain`` (None: no KV to start from).
Extension = tuple[Chain | None, int, int]


class BlockAllocator:
    """The blocks of ``pool``: their holders, their fill, the free ones, the pool's size.

    Args:
        pool: the memory (its ``block_size``); resized only when every block past the new
            size is free.
        budget_blocks: most blocks unpinned chains may hold between batches (None:
            unbounded); the pool grows past it (and the pinned blocks) only for a batch
            that needs more.
        fixed_capacity: the pool's blocks (block 0 included), allocated here and never
            resized (None: the pool follows what is held).
    """

    def __init__(self, pool: BlockPool, budget_blocks: int | None, fixed_capacity: int | None):
        self.pool = pool
        self.block_size = pool.block_size
        self.budget_blocks = budget_blocks
        self.fixed_capacity = fixed_capacity
        self._forget(1)
        self._resize(fixed_capacity or INITIAL_BLOCKS)

    def _forget(self, capacity: int) -> None:
        """No block held over ``capacity`` blocks but block 0."""
        free = capacity - 1
        self._refs: list[int] = [1] + [0] * free  # block 0 (ZERO_BLOCK) is held forever
        self._pins: list[int] = [1] + [0] * free
        self._fill: list[int] = [0] * capacity
        # a heap (sorted, so already one): the lowest free block is handed out first
        self._free: list[int] = list(range(1, capacity))
        self.budgeted = 0  # blocks held by some chain and by no pinned one
        self.pinned = 0  # blocks held by some pinned chain

    @property
    def capacity(self) -> int:
        """Blocks in the pool (block 0 included): with a budget, at most ``1 + budget
        blocks + pinned blocks``, or ``1 + held blocks + the blocks a batch asked for``."""
        return len(self._refs)

    @property
    def held_blocks(self) -> int:
        """Blocks held by any chain, pinned or not (block 0 excluded)."""
        return self.budgeted + self.pinned

    def limit(self, reserve_blocks: int) -> int | None:
        """The most blocks unpinned chains may hold so that ``reserve_blocks`` more fit the
        budget and, in a pool sized once, are free (None: no bound)."""
        limit = None if self.budget_blocks is None else self.budget_blocks - reserve_blocks
        if self.fixed_capacity is not None:
            room = self.fixed_capacity - 1 - self.pinned - reserve_blocks
            limit = room if limit is None or room < limit else limit
        return limit

    # -- the pool's size ------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every hold (the chains are forgotten too); the pool goes back to
        `INITIAL_BLOCKS` (a pool sized once keeps its blocks)."""
        self._forget(self.capacity)
        self._resize(self.fixed_capacity or INITIAL_BLOCKS)

    def free(self) -> None:
        """Forget every hold and let go of all the pool's memory (`BlockPool.free`). Block 0
        alone is left (`capacity` 1, no free block): the next `grow_for` or `extend_all`
        allocates the pool afresh (to ``fixed_capacity``, if set)."""
        self._forget(1)
        self.pool.free()

    def shrink(self) -> None:
        """Back to `INITIAL_BLOCKS` (or to the highest block still held), unless sized once."""
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

    def blocks_for(self, extensions: Sequence[Extension]) -> int:
        """The blocks `extend_all` of ``extensions`` will allocate."""
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
        return blocks

    def grow_for(self, blocks: int) -> None:
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
                    f"are free after evicting what the batch does not read ({self.pinned} "
                    f"blocks pinned, {self.budgeted} held by prefixes in use); give the LM a "
                    "larger KV budget (max_kv_bytes) or run fewer or shorter rows at once"
                )
            return
        needed = capacity + short
        if self.budget_blocks is None:
            self._resize(max(needed, 2 * capacity))
            return
        bound = 1 + self.budget_blocks + self.pinned
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

    # -- chains ---------------------------------------------------------------------------------

    def extend_all(self, extensions: Sequence[Extension]) -> tuple[list[Chain], list[BlockCopy]]:
        """A new chain for each `Extension` of a batch, in order, held by the caller until
        a node takes it or it is let go (`let_go`), and the copies to apply before writing.
        The full blocks shared are held by one count over the batch: each is held already,
        by the chain extended, so holding it again changes its count alone, never what is
        free or budgeted. If an extension fails, the chains made before it are let go."""
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
        """Hold ``chain``'s blocks once more; `let_go` of them."""
        self._hold_blocks(chain, 1)
        return chain

    def let_go(self, chain: Chain | None) -> None:
        """Let go of a chain from `extend_all` or `hold` (None: nothing)."""
        self._hold_blocks(chain or (), -1)

    def pin(self, chain: Chain) -> None:
        """Count a held chain's blocks as pinned (outside the budget) until `unpin`."""
        for block in chain:
            self._hold(block, 0, 1)

    def unpin(self, chain: Chain) -> None:
        """Count a pinned chain's blocks as held by it alone again (still held)."""
        for block in chain:
            self._hold(block, 0, -1)

    def _hold(self, block: int, refs: int, pins: int) -> None:
        before = self._refs[block] > 0 and self._pins[block] == 0
        pinned_before = self._pins[block] > 0
        self._refs[block] += refs
        self._pins[block] += pins
        after = self._refs[block] > 0 and self._pins[block] == 0
        self.budgeted += after - before
        self.pinned += (self._pins[block] > 0) - pinned_before
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
                    self.budgeted += 1 if after else -1
                if not after:
                    self._fill[block] = 0
                    heapq.heappush(self._free, block)

    def _allocate(self) -> int:
        self.grow_for(1)
        block = heapq.heappop(self._free)
        self._hold(block, 1, 0)
        return block

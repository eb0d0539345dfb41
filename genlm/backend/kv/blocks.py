"""`BlockAllocator`: who holds each block of a `BlockPool`, and the pool's size.

A chain (`genlm.backend.kv.pool.Chain`) is the ids of the blocks holding a prefix's KV.
Chains share prefixes, so particles that share a prompt share its blocks: each block
knows the block before it in every chain that holds it (its predecessor, set when it is
allocated), and is held by the chains that end at it and by the blocks that follow it
(each holding its predecessor once), like a persistent linked list. Holding or letting go
of a chain is then one count, of its last block (letting go frees the blocks no chain
reaches any more, from the end back: each block is freed once); a pinned chain counts
again in each of its blocks' pins. Extending a chain (`extend_all`) shares its full
blocks and appends to its partly filled last block in place when nobody has written past
the prefix in it yet, else copies it (copy-on-write). A row's work is O(new tokens) in
Python, whatever its context: a chain appended to within its last block keeps its tuple,
another is its source's full blocks and its own in one tuple (one copy in C).

The pool's size (`capacity`) follows what is held: the lowest free block is handed out
first, `grow_for` grows the pool once per batch, `trim` halves it while three quarters of
it are free. A pool sized once (``fixed_capacity``: under CUDA graphs, which hold its
addresses) is allocated at construction and never resized.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from genlm.backend.kv.pool import BlockCopy, BlockPool, Chain

# Block 0 is never handed out: backends keep it zeroed and point padding at it.
ZERO_BLOCK = 0
# The predecessor of a chain's first block.
NO_BLOCK = -1
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
        # a block's holders: the chains ending at it and the blocks after it
        self._refs: list[int] = [1] + [0] * free  # block 0 (ZERO_BLOCK) is held forever
        self._pins: list[int] = [1] + [0] * free
        self._fill: list[int] = [0] * capacity
        self._before: list[int] = [NO_BLOCK] * capacity  # each block's predecessor
        # a heap (sorted, so already one): the lowest free block is handed out first
        self._free: list[int] = list(range(1, capacity))
        self.held_blocks = 0  # blocks held by some chain (block 0 excluded)
        self.pinned = 0  # blocks held by some pinned chain

    @property
    def budgeted(self) -> int:
        """Blocks held by some chain and by no pinned one."""
        return self.held_blocks - self.pinned

    @property
    def capacity(self) -> int:
        """Blocks in the pool (block 0 included): with a budget, at most ``1 + budget
        blocks + pinned blocks``, or ``1 + held blocks + the blocks a batch asked for``."""
        return len(self._refs)

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
            del self._before[capacity:]
            self._free = [block for block in self._free if block < capacity]
        else:
            self._refs += [0] * (capacity - old)
            self._pins += [0] * (capacity - old)
            self._fill += [0] * (capacity - old)
            self._before += [NO_BLOCK] * (capacity - old)
            self._free.extend(range(old, capacity))
        heapq.heapify(self._free)

    # -- chains ---------------------------------------------------------------------------------

    def extend_all(self, extensions: Sequence[Extension]) -> tuple[list[Chain], list[BlockCopy]]:
        """A new chain for each `Extension` of a batch, in order, held by the caller until
        a node takes it or it is let go (`let_go`), and the copies to apply before writing.
        Each new block follows the chain's last block it shares (its predecessor, which it
        holds); the chain holds its last block. If an extension fails, the chains made
        before it are let go, and the blocks it allocated."""
        size, fill, refs = self.block_size, self._fill, self._refs
        chains: list[Chain] = []
        copies: list[BlockCopy] = []
        allocated = NO_BLOCK  # the last block allocated for the chain being made
        try:
            for chain, length, total in extensions:
                full, partial = divmod(length, size)
                if chain is None:
                    chain, full, partial = (), 0, 0
                allocated = NO_BLOCK
                last = chain[full - 1] if full else NO_BLOCK  # the last block kept as it is
                tail: list[int] = []
                if partial:
                    if fill[chain[full]] == partial:  # appended to in place
                        last = chain[full]
                    else:
                        last = allocated = self._allocate(last)
                        copies.append(BlockCopy(chain[full], last, partial))
                    fill[last] = min(size, total - full * size)
                    tail.append(last)
                while (full + len(tail)) * size < total:
                    last = allocated = self._allocate(last)
                    fill[last] = min(size, total - (full + len(tail)) * size)
                    tail.append(last)
                refs[last] += 1  # the new chain's hold
                allocated = NO_BLOCK
                # a decode step's row, appended to within its last block: the same blocks
                same = len(chain) == full + 1 and tail == [chain[full]]
                chains.append(chain if same else chain[:full] + tuple(tail))
        finally:
            if len(chains) < len(extensions):
                if allocated != NO_BLOCK:  # the failed extension's new blocks
                    refs[allocated] += 1
                    self._let_go_block(allocated)
                for made in chains:
                    self.let_go(made)
        return chains, copies

    def hold(self, chain: Chain) -> Chain:
        """Hold ``chain`` once more; `let_go` of it."""
        if chain:
            self._refs[chain[-1]] += 1
        return chain

    def let_go(self, chain: Chain | None) -> None:
        """Let go of a chain from `extend_all` or `hold` (None: nothing): the blocks no
        chain holds any more are freed."""
        if chain:
            self._let_go_block(chain[-1])

    def _let_go_block(self, block: int) -> None:
        """One hold less on ``block``; a block left without holders is freed, and lets go
        of its predecessor in turn."""
        refs = self._refs
        while block != NO_BLOCK:
            refs[block] -= 1
            if refs[block]:
                return
            self.held_blocks -= 1
            self._fill[block] = 0
            heapq.heappush(self._free, block)
            block = self._before[block]

    def pin(self, chain: Chain) -> None:
        """Count a held chain's blocks as pinned (outside the budget) until `unpin`."""
        self._pin_blocks(chain, 1)

    def unpin(self, chain: Chain) -> None:
        """Count a pinned chain's blocks as held by it alone again (still held)."""
        self._pin_blocks(chain, -1)

    def _pin_blocks(self, chain: Chain, pins: int) -> None:
        counts = self._pins
        for block in chain:
            before = counts[block] > 0
            counts[block] += pins
            self.pinned += (counts[block] > 0) - before

    def _allocate(self, before: int) -> int:
        """A free block following ``before`` (`NO_BLOCK`: none), which it holds; held by
        nothing else yet."""
        self.grow_for(1)
        block = heapq.heappop(self._free)
        self.held_blocks += 1
        self._before[block] = before
        if before != NO_BLOCK:
            self._refs[before] += 1
        return block

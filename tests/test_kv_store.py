"""PrefixKVStore on a fake pool whose "KV" of a token is the token id itself.

Every check is against an independent account: a node's chain must read back exactly
its own prefix, and the bytes the store charges must equal the distinct blocks of the
unpinned chains counted by brute force. The store is driven as its LMs drive it, through
`plan`, `commit` and `release` (and the clears), and read through its views.
"""

import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm.backend.kv.blocks import INITIAL_BLOCKS, ZERO_BLOCK, BlockAllocator
from genlm.backend.kv.store import PrefixKVStore
from genlm.backend.kv.tree import subtree, walk

BLOCK = 4
BLOCK_BYTES = 10


class FakePool:
    """A pure-Python `BlockPool`: slots hold the token written there (None: never written)."""

    block_size = BLOCK
    block_bytes = BLOCK_BYTES

    def __init__(self):
        self.slots: list[int | None] = []
        self.sizes: list[int] = []
        self.copied_tokens = 0

    def resize(self, blocks: int) -> None:
        self.sizes.append(blocks)
        self.slots = (self.slots + [None] * blocks * BLOCK)[: blocks * BLOCK]

    def free(self) -> None:
        self.sizes.append(0)
        self.slots = []

    def copy(self, copies) -> None:
        for copy in copies:
            for j in range(copy.tokens):
                self.slots[copy.target * BLOCK + j] = self.slots[copy.source * BLOCK + j]
            self.copied_tokens += copy.tokens

    def write(self, chain, start, ids) -> None:
        for j in range(start, len(ids)):
            self.slots[chain[j // BLOCK] * BLOCK + j % BLOCK] = ids[j]

    def read(self, chain, tokens):
        return [self.slots[chain[j // BLOCK] * BLOCK + j % BLOCK] for j in range(tokens)]


def make_store(max_kv_bytes=None, max_logprobs_bytes=None, fixed_capacity=None, **options):
    pool = FakePool()
    store = PrefixKVStore(
        pool,
        max_kv_bytes=max_kv_bytes,
        max_logprobs_bytes=max_logprobs_bytes,
        nbytes=len,
        fixed_capacity=fixed_capacity,
        **options,
    )
    return store, pool


# The nodes a caller remembers, by store, then by (tree key, prefix), as the index of
# validated prefixes does (`genlm.backend.llm.prefix.node_hint`); never told of evictions,
# prunes or dropped trees, which `find` must notice itself.
REMEMBERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run(store, pool, ids, key=None, **options):
    """What a backend does for one request (`run_batch`): ``(node, start)``."""
    [(node, start)], _ = run_batch(store, pool, [ids], key, **options)
    return node, start


def run_batch(store, pool, requests, key=None, *, pin=False, values=None):
    """What `PrefixCachedLM` does for a batch: plan it from the nodes remembered for the
    requests' prefixes or their parents (`find` from them must agree with a walk from the
    root), write each row's new tokens into its chain (the forward's part), then commit
    the rows' logprobs (``values``, one per request; "v" by default). Returns each
    request's ``(node, start)`` (``start`` None: answered from the tree) and the blocks
    held while the rows ran."""
    remembered = REMEMBERED.setdefault(store, {})
    queries = [(tuple(ids), key) for ids in requests]
    near = [remembered.get((key, ids)) or remembered.get((key, ids[:-1])) for ids, _ in queries]
    for (ids, _), node in zip(queries, near, strict=True):
        assert store.find(key, ids, node) == walk(store.root(key), ids)
    plan = store.plan(queries, 1, near, pin=pin)
    in_flight = store.held_blocks
    for row in plan.rows:
        pool.write(row.chain, row.start, row.ids)
    values = ["v"] * len(queries) if values is None else values
    store.commit(plan, [values[row.slot] for row in plan.rows])
    done = [(walk(store.root(key), ids)[0], None) for ids, _ in queries]
    for row in plan.rows:
        remembered[key, row.ids] = row.node
        done[row.slot] = (row.node, row.start)
    return done, in_flight


def prefix_of(node):
    tokens = []
    while node.parent is not None:
        tokens.append(node.token)
        node = node.parent
    return tokens[::-1]


def chains(store):
    for root in store.roots.values():
        for node in subtree(root):
            if node.chain is not None:
                yield node


def check_invariants(store, pool):
    """Every chain reads back exactly its own prefix (a block handed out twice would be
    overwritten), and the store's counts are those of the chains, recounted: the blocks
    held by any chain, and those held by unpinned chains alone (the budgeted ones)."""
    pinned, unpinned = set(), set()
    for node in chains(store):
        assert pool.read(node.chain, node.depth) == prefix_of(node)
        assert ZERO_BLOCK not in node.chain and max(node.chain) < store.capacity
        (pinned if node.pinned else unpinned).update(node.chain)
    assert store.held_blocks == len(pinned | unpinned)
    assert store.kv_nbytes == len(unpinned - pinned) * BLOCK_BYTES
    assert store.capacity == len(pool.slots) // BLOCK


def check_drained(store, pool):
    """Every block is held by the chains alone: once `clear_kv` lets go of them all, none
    is held (a hold counted twice would keep its block) and the trees keep no node
    without logprobs."""
    check_invariants(store, pool)
    store.clear_kv()
    assert store.held_blocks == 0 and store.kv_nbytes == 0
    for root in store.roots.values():
        assert all(node.logprobs is not None or node.children for node in subtree(root)[1:])


def check_evictable(store, pool):
    """No ended plan still keeps a chain from eviction: a batch of another tree that needs
    the whole KV budget evicts every unpinned chain but its own (eviction stops at a
    chain a running plan reads)."""
    budget_blocks = store.max_kv_bytes // BLOCK_BYTES
    flush, _ = run(store, pool, [7] * budget_blocks * BLOCK, key="flush")
    assert [node for node in chains(store) if not node.pinned] == [flush]


def test_particles_share_the_prompt_and_fork_copies_only_a_partial_block():
    store, pool = make_store()
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    run(store, pool, prompt)
    assert store.held_blocks == 3
    children = [run(store, pool, prompt + [t])[0] for t in (1, 2, 3)]
    # the first child appends to the prompt's partial block; the others copy its 2 tokens
    assert pool.copied_tokens == 2 * 2
    assert store.held_blocks == 3 + 2
    assert len({child.chain[:2] for child in children}) == 1  # full blocks shared
    check_invariants(store, pool)
    # extending a child again runs one token and copies nothing
    node, start = run(store, pool, prompt + [2, 7])
    assert start == len(prompt) + 1 and pool.copied_tokens == 4
    check_drained(store, pool)


def test_budget_counts_exactly_the_blocks_and_evicts_least_recently_used():
    store, pool = make_store(max_kv_bytes=4 * BLOCK_BYTES)
    first, _ = run(store, pool, [1] * 8)  # 2 blocks
    second, _ = run(store, pool, [2] * 8)  # 2 blocks
    assert run(store, pool, [1] * 8) == (first, None)  # answered from the tree: used again
    run(store, pool, [3] * 4)  # 1 more block: the least recently used (second) goes
    assert second.chain is None and first.chain is not None
    assert store.kv_nbytes == 3 * BLOCK_BYTES
    check_drained(store, pool)


def test_pinned_chains_survive_eviction_outside_the_budget():
    store, pool = make_store(max_kv_bytes=0, max_logprobs_bytes=0)
    node, _ = run(store, pool, [5, 6, 7, 8, 9])
    assert node.chain is None  # a zero budget keeps nothing unpinned
    assert 5 not in store.root(None).children  # and the emptied node was pruned
    node, start = run(store, pool, [5, 6, 7, 8, 9], pin=True)
    assert start == 0 and node.pinned and node.chain is not None and store.kv_nbytes == 0
    child, start = run(store, pool, [5, 6, 7, 8, 9, 10])
    # the child appended to the pinned partial block: it holds only pinned blocks, free
    assert start == 5 and child.chain == node.chain and store.kv_nbytes == 0
    check_invariants(store, pool)
    store.clear_kv()
    assert node.chain is None and store.held_blocks == 0
    assert 5 not in store.root(None).children  # the emptied nodes were detached


def test_entry_budgets_keep_the_most_recent_chains_and_logprobs():
    store, pool = make_store(max_kv_entries=2, max_logprobs_entries=1)
    nodes = [run(store, pool, [t] * 3)[0] for t in (1, 2, 3)]
    assert [node.chain is not None for node in nodes] == [False, True, True]
    assert [node.logprobs for node in nodes] == [None, None, "v"]
    # its logprobs gone, nodes[1] runs its last token on its own KV: its chain used again
    assert run(store, pool, [2] * 3) == (nodes[1], 2)
    last, _ = run(store, pool, [4] * 3)  # the least recently used chain (nodes[2]) goes
    assert [node.chain is not None for node in nodes] == [False, True, False]
    assert store.kv_nbytes == 2 * BLOCK_BYTES
    assert [node.logprobs for node in nodes] == [None, None, None] and last.logprobs == "v"
    check_drained(store, pool)


def test_a_pin_plan_pins_a_chain_where_it_is_and_it_outlives_the_budget():
    store, pool = make_store(max_kv_bytes=2 * BLOCK_BYTES)
    node, _ = run(store, pool, [1, 2, 3, 4, 5])
    assert run(store, pool, [1, 2, 3, 4, 5], pin=True) == (node, None)  # nothing runs
    assert node.pinned and store.kv_nbytes == 0
    for t in range(10):
        run(store, pool, [20 + t] * 6)
    assert node.chain is not None
    check_drained(store, pool)


def test_adapter_roots_are_separate_and_dropping_one_releases_its_blocks():
    store, pool = make_store()
    run(store, pool, [1, 2, 3], key=None)
    lora_node, start = run(store, pool, [1, 2, 3, 4], key="a")
    assert start == 0  # nothing shared across adapters
    assert store.held_blocks == 2
    store.drop_root("a")
    assert store.held_blocks == 1 and "a" not in store.roots
    check_drained(store, pool)


def test_logprobs_budget_evicts_least_recently_used_and_prunes_empty_nodes():
    store, pool = make_store(max_kv_bytes=0, max_logprobs_bytes=6)  # no KV keeps a node
    root = store.root(None)
    run_batch(store, pool, [[1, 2], [3]], values=["xyz", "uvw"])
    a, b = walk(root, [1, 2])[0], walk(root, [3])[0]
    assert run(store, pool, [1, 2]) == (a, None)  # answered from the tree: used again
    run(store, pool, [4], values=["q"])  # room made for its row: b, least recently used, goes
    assert b.logprobs is None and a.logprobs == "xyz" and store.logprobs_nbytes == 4
    assert 3 not in root.children and 1 in root.children


def test_a_descendant_chain_serves_its_prefix():
    store, pool = make_store()
    run(store, pool, list(range(10)))
    node, start = run(store, pool, list(range(6)) + [99])
    assert start == 6  # read from the longer prefix's chain
    check_drained(store, pool)


def test_without_a_budget_the_pool_doubles_and_clears_shrink_it():
    store, pool = make_store(max_logprobs_bytes=0)  # every request runs
    assert pool.sizes == [INITIAL_BLOCKS]
    run(store, pool, list(range(INITIAL_BLOCKS * BLOCK)))
    assert pool.sizes == [INITIAL_BLOCKS, 2 * INITIAL_BLOCKS]
    run(store, pool, list(range(INITIAL_BLOCKS * BLOCK)), pin=True)
    store.clear_kv()
    assert pool.sizes[-1] == INITIAL_BLOCKS and store.held_blocks == 0
    run(store, pool, list(range(INITIAL_BLOCKS * BLOCK)))
    assert pool.sizes[-1] == 2 * INITIAL_BLOCKS
    store.clear()
    assert pool.sizes[-1] == INITIAL_BLOCKS and store.held_blocks == 0


def test_free_empties_every_tree_and_the_pool_and_the_store_serves_again():
    store, pool = make_store()
    prompt, _ = run(store, pool, list(range(10)))
    run(store, pool, list(range(10)), pin=True)
    run(store, pool, list(range(7)) + [50, 51])
    run(store, pool, [1, 2, 3], key="a")
    nodes = [  # every node of the trees (roots included): each prefix's, walked to
        walk(store.roots[key], ids[:k])[0]
        for key, ids in ((None, list(range(10))), (None, [*range(7), 50, 51]), ("a", [1, 2, 3]))
        for k in range(len(ids) + 1)
    ]
    assert prompt.pinned and store.held_blocks and store.logprobs_nbytes
    store.free()
    assert pool.slots == [] and pool.sizes[-1] == 0  # all the memory, not INITIAL_BLOCKS
    assert store.capacity == 1 and store.held_blocks == 0 and store.kv_nbytes == 0
    assert store.roots == {} and store.logprobs_nbytes == 0
    # a node a caller kept (a root, say) holds nothing, nor links to the rest of its tree
    for node in nodes:
        assert (node.children, node.chain, node.logprobs, node.pinned) == ({}, None, None, False)
    node, start = run(store, pool, list(range(10)))
    assert start == 0 and store.capacity == pool.sizes[-1] == len(pool.slots) // BLOCK > 1
    check_drained(store, pool)


def particle_steps(store, pool, particles, steps, prompt):
    """``particles`` contexts forking from ``prompt``, one token per step, one batch per step;
    the most blocks held while a batch ran."""
    contexts = [list(prompt) + [p] for p in range(particles)]
    peak = 0
    for step in range(steps):
        _, in_flight = run_batch(store, pool, contexts)
        peak = max(peak, in_flight)
        contexts = [ctx + [(step + p) % 7] for p, ctx in enumerate(contexts)]
        check_invariants(store, pool)
    return peak


def test_under_a_budget_the_pool_stays_within_budget_plus_what_the_rows_hold():
    budget_blocks = 70
    store, pool = make_store(max_kv_bytes=budget_blocks * BLOCK_BYTES)
    # 8 particles x 60 tokens: about 120 blocks live, over the budget while a batch runs
    peak = particle_steps(store, pool, 8, 50, list(range(10)))
    assert peak > budget_blocks  # the rows legitimately hold more than the budget
    assert max(pool.sizes) <= max(1 + budget_blocks, 1 + peak)
    # the first step stops at the budget; past it the pool grows only to what rows need
    assert pool.sizes[:2] == [INITIAL_BLOCKS, 1 + budget_blocks]
    assert pool.sizes == sorted(pool.sizes)
    check_drained(store, pool)
    # a budget above the need: the pool grows only as far as the need
    store, pool = make_store(max_kv_bytes=10_000 * BLOCK_BYTES)
    peak = particle_steps(store, pool, 4, 40, list(range(10)))
    assert max(pool.sizes) <= max(INITIAL_BLOCKS, peak + 1) + max(INITIAL_BLOCKS, peak // 4)


def test_pinned_blocks_raise_the_bound_and_clear_kv_gives_the_memory_back():
    budget_blocks = 20
    store, pool = make_store(max_kv_bytes=budget_blocks * BLOCK_BYTES)
    prompt = list(range(100, 100 + 90 * BLOCK))  # 90 pinned blocks, outside the budget
    node, _ = run(store, pool, prompt, pin=True)
    peak = particle_steps(store, pool, 6, 12, prompt)
    assert node.chain is not None and store.kv_nbytes <= budget_blocks * BLOCK_BYTES
    assert max(pool.sizes) <= max(1 + budget_blocks + 90, 1 + peak)
    store.clear_kv()
    assert store.capacity == pool.sizes[-1] == INITIAL_BLOCKS
    node, _ = run(store, pool, list(range(5)))  # the shrunk pool still serves requests
    check_drained(store, pool)


def test_a_plan_makes_room_for_exactly_the_blocks_its_rows_allocate():
    store, pool = make_store(max_kv_bytes=0)  # no slack: the pool grows to exactly the need
    prompt = [1, 2, 3, 4, 5, 6]  # a full block and a partial one, pinned
    run(store, pool, prompt, pin=True)
    forks = [prompt + [t] * 90 for t in (7, 8, 9)]  # 24 blocks each
    _, in_flight = run_batch(store, pool, forks)
    # the first fork appends to the partial block in place (22 new), the others copy it (23)
    assert in_flight == 2 + 22 + 23 + 23
    # one resize, to the exact need; once the rows let go (budget 0) trim shrinks it back
    assert pool.sizes == [INITIAL_BLOCKS, 1 + in_flight, INITIAL_BLOCKS]
    check_drained(store, pool)


def test_trim_halves_a_mostly_free_pool_keeping_the_held_blocks():
    store, pool = make_store()
    keep, _ = run(store, pool, list(range(3 * BLOCK)))  # the lowest blocks
    big, _ = run(store, pool, [7] * (8 * INITIAL_BLOCKS - 4) * BLOCK, key="big")  # the rest
    assert store.capacity == 8 * INITIAL_BLOCKS
    assert run(store, pool, list(range(3 * BLOCK))) == (keep, None)  # a batch trims: in use
    assert store.capacity == 8 * INITIAL_BLOCKS
    store.drop_root("big")
    sizes = []
    for _ in range(4):  # each batch trims once, the next batch halves again
        run(store, pool, list(range(3 * BLOCK)))
        sizes.append(store.capacity)
    assert sizes == [4 * INITIAL_BLOCKS, 2 * INITIAL_BLOCKS, INITIAL_BLOCKS, INITIAL_BLOCKS]
    check_invariants(store, pool)  # the kept chain reads back exactly after the shrinks
    run(store, pool, list(range(3 * BLOCK)) + [1, 2])
    check_drained(store, pool)


def test_a_pool_sized_once_is_allocated_at_construction_and_only_evicts():
    store, pool = make_store(fixed_capacity=21)  # 20 blocks to hand out
    assert pool.sizes == [21] and store.capacity == 21
    old = [run(store, pool, [50 + i] * 3 * BLOCK)[0] for i in range(5)]  # 3 blocks each
    assert store.held_blocks == 15
    # 2 rows of 4 blocks: 5 free, so the least recently used prefix is evicted
    run_batch(store, pool, [[60] * 4 * BLOCK, [61] * 4 * BLOCK])
    assert [node.chain is not None for node in old] == [False, True, True, True, True]
    check_invariants(store, pool)
    with pytest.raises(
        RuntimeError,
        match=r"the KV pool, sized once at 20 blocks, cannot hold this batch: its rows need "
        r"21 new blocks and 20 are free",
    ):
        run_batch(store, pool, [[62] * 21 * BLOCK])  # everything is evicted, still short
    assert store.held_blocks == 0
    check_invariants(store, pool)
    for token, clear in ((63, store.clear_kv), (64, store.clear)):
        run(store, pool, [token] * 5 * BLOCK)
        clear()
    assert pool.sizes == [21] and store.capacity == 21
    store.free()
    run(store, pool, [65] * 2 * BLOCK)  # allocated again, at the same size
    assert pool.sizes == [21, 0, 21]
    check_drained(store, pool)


def test_extensions_without_room_in_a_pool_sized_once_let_go_of_what_they_took():
    blocks = BlockAllocator(FakePool(), None, 5)  # 4 blocks to hand out
    (chain,), _ = blocks.extend_all([(None, 0, 2 * BLOCK)])
    with pytest.raises(RuntimeError, match="cannot hold"):  # 2 free blocks of the 3 asked
        blocks.extend_all([(None, 0, BLOCK), (chain, 2 * BLOCK, 4 * BLOCK)])
    with pytest.raises(RuntimeError, match="cannot hold"):
        blocks.extend_all([(chain, 2 * BLOCK, 5 * BLOCK)])
    assert blocks.held_blocks == 2  # only ``chain``'s: every block the extensions took let go
    blocks.let_go(chain)
    assert blocks.held_blocks == 0
    assert blocks.extend_all([(None, 0, 4 * BLOCK)])[0] == [(1, 2, 3, 4)]  # all free again


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 7),  # which existing prefix to extend (index into history)
            st.lists(st.integers(0, 3), min_size=1, max_size=6),  # tokens appended
            st.sampled_from([None, "a"]),
            st.booleans(),  # pin the result
        ),
        min_size=1,
        max_size=25,
    ),
    budget_blocks=st.one_of(st.none(), st.integers(0, 12)),
)
def test_random_forks_evictions_and_pins_keep_every_chain_exact(steps, budget_blocks):
    budget = None if budget_blocks is None else budget_blocks * BLOCK_BYTES
    store, pool = make_store(max_kv_bytes=budget)
    history = [[0, 1, 2]]
    bound = INITIAL_BLOCKS
    for pick, tokens, key, pin in steps:
        ids = history[pick % len(history)] + tokens
        history.append(ids)
        _, in_flight = run_batch(store, pool, [ids], key=key, pin=pin)
        check_invariants(store, pool)
        if budget is not None:
            assert store.kv_nbytes <= budget
            pinned = store.held_blocks - store.kv_nbytes // BLOCK_BYTES
            bound = max(bound, 1 + budget_blocks + pinned, 1 + in_flight)
            assert store.capacity <= bound
    check_drained(store, pool)


def test_find_never_starts_from_a_node_no_longer_in_the_tree():
    store, pool = make_store(max_kv_bytes=2 * BLOCK_BYTES, max_logprobs_bytes=0)
    ids = (1, 2, 3, 4, 5)
    old, _ = run(store, pool, ids[:-1])
    assert store.find(None, ids, old) == (old, 4)
    run(store, pool, [9] * 8)  # evicts the chain of ``old``; prune then detaches it
    assert old.parent is not None and old not in old.parent.children.values()
    assert store.find(None, ids, old) == (store.root(None), 0)
    for key, forget in (("a", lambda: store.drop_root("a")), (None, store.clear)):
        node, _ = run(store, pool, ids[:-1], key=key)
        middle = node.parent
        assert store.find(key, ids, middle) == (node, 4)
        forget()  # a new tree: no node of the old one is used
        for near in (node, middle):
            assert store.find(key, ids, near) == (store.root(key), 0)


def test_find_never_starts_below_the_prefix():
    """A node deeper than the prefix (the caller's node of a longer one) is not used."""
    store, pool = make_store()
    ids = (1, 2, 3, 4)
    node, _ = run(store, pool, ids)
    assert store.find(None, ids[:2], node) == walk(store.root(None), ids[:2])
    assert store.find(None, ids[:2], node)[1] == 2
    assert store.find(None, ids, node) == (node, 4)


def test_rows_sharing_a_batch_count_its_memory_once_until_the_last_goes():
    import torch

    pool = FakePool()
    store = PrefixKVStore(pool, max_logprobs_entries=5)  # counts a tensor's storage
    batch = torch.zeros(4, 10)  # 160 bytes
    run_batch(store, pool, [[t] for t in range(4)], values=list(batch.unbind()))
    run(store, pool, [9], values=[torch.zeros(10)])
    assert store.logprobs_nbytes == 160 + 40
    for t in range(3):  # each new row pushes out the oldest, a row of the batch: it stays
        run(store, pool, [20 + t], values=[torch.zeros(10)])
        assert store.logprobs_nbytes == 160 + 40 + 40 * (t + 1)
    run(store, pool, [23], values=[torch.zeros(10)])  # the batch's last row goes, and it
    assert store.logprobs_nbytes == 5 * 40


def test_making_room_for_a_batch_evicts_the_least_recently_used_first():
    store, pool = make_store(max_logprobs_bytes=10)
    root = store.root(None)
    run_batch(store, pool, [[t] for t in range(4)], values=["ab", "cd", "ef", "gh"])
    nodes = [walk(root, [t])[0] for t in range(4)]
    assert run(store, pool, [0]) == (nodes[0], None)  # answered from the tree: used again
    plan = store.plan([((5,), None), ((6,), None)], 3)  # 6 bytes: 8 held, 4 must go
    assert [node.logprobs for node in nodes] == ["ab", None, None, "gh"]  # the oldest first
    assert store.logprobs_nbytes == 4
    store.release(plan)
    plan = store.plan([((5,), None), ((6,), None)], 20)  # over the budget: all of it
    assert store.logprobs_nbytes == 0
    store.release(plan)


def test_a_batch_of_extensions_that_fails_halfway_holds_nothing_more():
    """`extend_all` holds the rows' shared blocks once at the end: when the pool cannot
    grow for a row, the rows made before it are let go and every block is held as the
    chain extended alone holds it (letting that go frees them all)."""
    pool = FakePool()
    blocks = BlockAllocator(pool, None, None)
    length = 9 * BLOCK + 2
    (chain,), _ = blocks.extend_all([(None, 0, length)])
    capacity, held = blocks.capacity, blocks.held_blocks

    def refuse(size):
        raise MemoryError(f"no room for {size} blocks")

    pool.resize = refuse
    # each row past the first copies the partial block: the pool runs out of free blocks
    rows = [(chain, length, length + 1)] * (capacity - held + 1)
    with pytest.raises(MemoryError, match="no room"):
        blocks.extend_all(rows)
    assert blocks.capacity == capacity and blocks.held_blocks == held
    blocks.let_go(chain)
    assert blocks.held_blocks == 0  # and every block is free: the whole pool, no resize
    assert blocks.extend_all([(None, 0, (capacity - 1) * BLOCK)])[0] == [tuple(range(1, capacity))]


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 7),  # which existing prefix to extend (index into history)
            st.lists(st.integers(0, 3), min_size=1, max_size=9),  # tokens appended
            st.booleans(),  # pin the result
        ),
        min_size=1,
        max_size=25,
    ),
    capacity=st.integers(2, 10),
    budget_blocks=st.one_of(st.none(), st.integers(0, 12)),
)
def test_a_pool_sized_once_serves_or_refuses_and_keeps_every_chain_exact(
    steps, capacity, budget_blocks
):
    budget = None if budget_blocks is None else budget_blocks * BLOCK_BYTES
    store, pool = make_store(max_kv_bytes=budget, fixed_capacity=capacity)
    history = [[0, 1]]
    for pick, tokens, pin in steps:
        ids = history[pick % len(history)] + tokens
        try:
            run_batch(store, pool, [ids], pin=pin)
        except RuntimeError as error:
            assert "cannot hold this batch" in str(error)
            check_invariants(store, pool)
            pinned = store.held_blocks - store.kv_nbytes // BLOCK_BYTES
            if pinned < capacity - 1:  # eviction makes room for a block that reads nothing
                run(store, pool, [7] * BLOCK, key="other")
        else:
            history.append(ids)
        check_invariants(store, pool)
        assert pool.sizes == [capacity]
        if budget is not None:
            assert store.kv_nbytes <= budget
    check_drained(store, pool)


# -- a batch: plan, then commit or release ------------------------------------------------------


def planned(store, pool, requests, key=None, **options):
    """`PrefixKVStore.plan` of ``requests``, each row's new tokens then written (the
    forward's part)."""
    plan = store.plan([(tuple(ids), key) for ids in requests], 1, **options)
    for row in plan.rows:
        pool.write(row.chain, row.start, row.ids)
    return plan


def test_commit_caches_the_rows_and_gives_each_chain_to_its_node():
    store, pool = make_store(max_kv_bytes=16 * BLOCK_BYTES)
    prompt = list(range(100, 110))
    plan = planned(store, pool, [prompt])
    (row,) = plan.rows
    assert plan.cached == (None,) and (row.start, row.new_tokens, row.source) == (0, 10, None)
    assert store.held_blocks == 3  # the row's own chain, while the batch runs
    assert store.commit(plan, ["p"]) == ["p"] and plan.ended == "committed"
    node = walk(store.root(None), prompt)[0]
    assert (node.logprobs, node.chain, store.held_blocks) == ("p", row.chain, 3)
    # forks start from the prompt's KV; the prompt itself is answered from the tree
    plan = planned(store, pool, [prompt + [1], prompt, prompt + [2, 3]])
    assert plan.cached == (None, "p", None) and [row.slot for row in plan.rows] == [0, 2]
    assert [(row.start, row.new_tokens) for row in plan.rows] == [(10, 1), (10, 2)]
    assert all(row.source is node for row in plan.rows)
    assert store.commit(plan, ["a", "b"]) == ["a", "p", "b"]
    check_invariants(store, pool)
    check_evictable(store, pool)


def test_a_plan_keeps_its_sources_through_its_own_evictions_until_it_ends():
    store, pool = make_store(max_kv_bytes=2 * BLOCK_BYTES)
    prompt = list(range(100, 108))  # 2 full blocks: the whole budget
    node, _ = run(store, pool, prompt)
    # room made for the row's block: the prompt, least recently used, is read, so it stays
    plan = planned(store, pool, [prompt + [1]])
    (row,) = plan.rows
    assert row.source is node and row.chain[:2] == node.chain
    assert pool.read(row.chain, 9) == prompt + [1]
    store.commit(plan, ["a"])  # then the budget holds again: both chains go
    assert node.chain is None and row.node.chain is None and store.kv_nbytes == 0
    check_drained(store, pool)


def test_release_lets_every_row_chain_go_and_prunes_the_nodes_made_for_them():
    store, pool = make_store(max_kv_bytes=16 * BLOCK_BYTES)
    prompt = list(range(100, 110))
    store.commit(planned(store, pool, [prompt]), ["p"])
    node = walk(store.root(None), prompt)[0]
    plan = planned(store, pool, [prompt + [1], prompt + [2, 3], [7, 8]])
    assert store.held_blocks > 3
    store.release(plan)  # the forward failed
    assert store.held_blocks == 3 and plan.ended == "released"
    assert walk(store.root(None), prompt + [1]) == (node, 10)
    assert walk(store.root(None), [7, 8]) == (store.root(None), 0)
    check_invariants(store, pool)
    check_evictable(store, pool)


def test_a_plan_whose_copies_fail_holds_nothing():
    store, pool = make_store(max_kv_bytes=16 * BLOCK_BYTES)
    prompt = list(range(100, 110))  # its last block partly filled: a second fork copies it
    store.commit(planned(store, pool, [prompt]), ["p"])
    copy = pool.copy

    def refuse(copies):
        raise RuntimeError("copy failed on purpose")

    pool.copy = refuse
    with pytest.raises(RuntimeError, match="on purpose"):
        store.plan([((*prompt, 1), None), ((*prompt, 2), None)], 1)
    assert store.held_blocks == 3
    assert walk(store.root(None), prompt + [1])[1] == 10
    check_invariants(store, pool)
    pool.copy = copy
    check_evictable(store, pool)


def test_commit_refuses_a_wrong_number_of_rows_and_lets_their_chains_go():
    store, pool = make_store()
    plan = planned(store, pool, [[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match=r"1 rows computed for a plan of 2 \(the plan is released"):
        store.commit(plan, ["x"])
    assert store.held_blocks == 0 and walk(store.root(None), [1, 2, 3])[1] == 0
    with pytest.raises(RuntimeError, match="cannot release a plan that was already released"):
        store.release(plan)
    check_drained(store, pool)


ENDINGS = {"commit": "committed", "release": "released"}


@pytest.mark.parametrize("first", ENDINGS)
@pytest.mark.parametrize("second", ENDINGS)
def test_a_plan_ends_once_and_a_second_end_changes_nothing(first, second):
    """Commit twice, release after commit, release twice, commit after release: the second
    end raises before it lets go of anything (the chains it would let go of are nodes' by
    now, or free, where the next plan takes them)."""
    store, pool = make_store()
    prompt = list(range(100, 110))
    run(store, pool, prompt)
    plan = planned(store, pool, [prompt + [1], [7, 8, 9]])
    ends = {"commit": lambda values: store.commit(plan, values), "release": store.release}
    ends[first](["a", "b"]) if first == "commit" else ends[first](plan)
    trees = [(prefix_of(node), node.chain, node.logprobs) for node in subtree(store.root(None))]
    held = store.held_blocks
    with pytest.raises(
        RuntimeError,
        match=rf"cannot {second} a plan that was already {ENDINGS[first]}: a plan ends once",
    ):
        ends[second](["x", "y"]) if second == "commit" else ends[second](plan)
    assert plan.ended == ENDINGS[first] and store.held_blocks == held
    assert [(prefix_of(node), node.chain, node.logprobs) for node in subtree(store.root(None))] == (
        trees
    )
    run_batch(store, pool, [[50] * 3 * BLOCK, prompt + [2], [7, 8, 9, 10]])  # new blocks only
    check_drained(store, pool)


def test_a_pin_plan_computes_a_cached_prefix_and_pins_its_chain():
    store, pool = make_store(max_kv_bytes=0)  # unpinned KV is evicted after each batch
    prompt = list(range(100, 110))
    store.commit(planned(store, pool, [prompt]), ["p"])
    node = walk(store.root(None), prompt)[0]
    assert node.logprobs == "p" and node.chain is None
    plan = planned(store, pool, [prompt], pin=True)
    assert plan.cached == (None,) and len(plan.rows) == 1
    store.commit(plan, ["q"])
    assert node.pinned and node.logprobs == "q" and store.kv_nbytes == 0
    assert pool.read(node.chain, 10) == prompt
    # a pin plan of a prefix whose node holds its KV already pins nothing new, runs nothing
    plan = planned(store, pool, [prompt], pin=True)
    assert (plan.cached, plan.rows) == (("q",), ())
    assert store.commit(plan, []) == ["q"]
    check_drained(store, pool)


def test_clear_kv_detaches_the_nodes_it_empties_and_keeps_those_with_logprobs():
    """Rounds of requests, each followed by a KV clear: the trees hold the paths to the
    logprobs kept (the two latest) and nothing more, round after round."""
    store, pool = make_store(max_logprobs_entries=2)
    prompt = list(range(100, 109))
    for round_ in range(3):
        requests = [prompt + [round_, t] for t in range(4)]
        run_batch(store, pool, [prompt + [round_]])
        run_batch(store, pool, requests)
        store.clear_kv()
        kept = {tuple(ids[:k]) for ids in requests[-2:] for k in range(len(ids) + 1)}
        nodes = subtree(store.root(None))
        assert sorted(tuple(prefix_of(node)) for node in nodes) == sorted(kept)
        assert [prefix_of(node) for node in nodes if node.logprobs is not None] in (
            requests[-2:],
            requests[-2:][::-1],
        )
        assert store.held_blocks == 0

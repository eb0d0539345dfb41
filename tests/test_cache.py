"""OutputCache, TokenTrie and DynamicTokenTrie: LRU order, budgets, pinning, pruning."""

import numpy as np
import pytest
import torch

from genlm.backend.cache import DynamicTokenTrie, OutputCache, TokenTrie, storages


def kv(nbytes):
    """A float32 tensor of ``nbytes`` bytes (its own storage)."""
    return torch.zeros(nbytes // 4)


# -- OutputCache ---------------------------------------------------------------------------


def test_output_cache_evicts_least_recently_used():
    cache = OutputCache(maxsize=2)
    cache[[1, 2]] = torch.tensor([1.0])
    cache[(3,)] = torch.tensor([2.0])
    assert cache[(1, 2)].item() == 1.0  # lists and tuples are the same key; this read refreshes it
    cache[(4,)] = torch.tensor([3.0])
    assert (1, 2) in cache and (4,) in cache and (3,) not in cache
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0


def test_output_cache_zero_size_and_bad_size():
    cache = OutputCache(maxsize=0)
    cache[(1,)] = torch.tensor([1.0])
    assert len(cache) == 0
    with pytest.raises(ValueError, match="maxsize"):
        OutputCache(maxsize=-1)


def test_output_cache_move_to_cpu_returns_on_the_original_device():
    cache = OutputCache(maxsize=4, move_to_cpu=True)
    value = torch.arange(3.0)
    cache[(1,)] = value
    assert torch.equal(cache[(1,)], value) and cache[(1,)].device == value.device


# -- TokenTrie -----------------------------------------------------------------------------


def test_token_trie_extend_walk_and_clear():
    root = TokenTrie()
    node = root.extend_cache(0, [5, 6, 7], ["a", "b", "c"], past_key_values="kv")
    assert (node.depth, node.token, node.logprobs, node.past_key_values) == (3, 7, "c", "kv")
    assert root.walk([5, 6, 9]) == (root.get_token(5).get_token(6), 2)
    assert root.walk([5, 6, 7]) == (node, 3)
    assert root.has_token(5) and not root.has_token(6)
    assert [n.token for n in node.path_to_root()] == [7, 6, 5, None]
    deeper = node.extend_cache(3, [5, 6, 7, 8], None)
    assert deeper.parent is node and deeper.logprobs is None
    assert deeper.nearest_kv() is node and node.nearest_kv() is node
    assert root.get_token(5).nearest_kv() is None
    root.clear_kv_cache()
    assert all(n.past_key_values is None for n in root)
    assert node.logprobs == "c"
    assert len(list(root)) == 5


# -- storages ------------------------------------------------------------------------------


def test_views_of_one_tensor_are_one_block():
    buffer = torch.zeros(4, 100)
    rows = [buffer[i] for i in range(4)]
    assert {storages(row)[0] for row in rows} == {storages(buffer)[0]}

    def tensor_nbytes(value):
        return sum(nbytes for _, nbytes in storages(value))

    assert tensor_nbytes(rows[0]) == buffer.nbytes  # a view is charged for its whole buffer
    assert tensor_nbytes((torch.zeros(10), torch.zeros(5))) == 60
    assert tensor_nbytes(np.zeros(8)) == 64
    assert tensor_nbytes(None) == 0


# -- DynamicTokenTrie ----------------------------------------------------------------------


def chain(root, token_ids):
    return root.extend_cache(0, token_ids, None)


def test_kv_evicted_in_lru_order_within_the_byte_budget():
    root = DynamicTokenTrie(max_kv_bytes=3000)
    nodes = [chain(root, [i, 100]) for i in range(3)]
    for node in nodes:
        node.set_past_key_values(kv(1000))
    assert root.kv_nbytes == 3000
    nodes[0].touch()  # now 1 is the least recently used
    fresh = chain(root, [3, 100])
    fresh.set_past_key_values(kv(1000))
    assert [n.past_key_values is None for n in nodes] == [False, True, False]
    assert root.kv_nbytes == 3000
    # the emptied leaf was detached, its parent too (both empty)
    assert root.walk([1, 100]) == (root, 0)


def test_entry_budget_and_logprobs_budget():
    root = DynamicTokenTrie(max_kv_entries=2, max_logprobs_entries=1)
    a, b, c = (chain(root, [t]) for t in (1, 2, 3))
    for node in (a, b, c):
        node.set_past_key_values(kv(8))
    assert [n.past_key_values is not None for n in (a, b, c)] == [False, True, True]
    b.set_logprobs(torch.zeros(2))
    c.set_logprobs(torch.zeros(2))
    assert b.logprobs is None and c.logprobs is not None
    assert root.logprobs_nbytes == 8


def test_touch_marks_ancestors_first_by_default():
    root = DynamicTokenTrie(max_kv_entries=2)
    parent = chain(root, [1])
    child = chain(root, [1, 2])
    other = chain(root, [3])
    child.set_past_key_values(kv(8))
    parent.set_past_key_values(kv(8))
    child.touch()  # parent then child: parent is now older than child
    other.set_past_key_values(kv(8))
    assert parent.past_key_values is None and child.past_key_values is not None
    child.touch(ancestors=False)


def test_shared_block_is_charged_once_and_released_with_its_last_view():
    released = []
    root = DynamicTokenTrie(max_kv_bytes=10_000, on_kv_release=released.append)
    buffer = torch.zeros(2, 500)  # 4000 bytes
    first, second = chain(root, [1]), chain(root, [2])
    first.set_past_key_values(buffer[0])
    second.set_past_key_values(buffer[1])
    assert root.kv_nbytes == 4000
    first.set_past_key_values(None)
    assert root.kv_nbytes == 4000 and released == []
    second.set_past_key_values(None)
    assert root.kv_nbytes == 0 and len(released) == 1
    assert released[0].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_make_room_evicts_ahead_of_an_allocation():
    root = DynamicTokenTrie(max_kv_bytes=3000)
    nodes = [chain(root, [i]) for i in range(3)]
    for node in nodes:
        node.set_past_key_values(kv(1000))
    root.make_room(1500)
    assert [n.past_key_values is None for n in nodes] == [True, True, False]
    assert root.kv_nbytes == 1000


def test_pinned_kv_is_outside_the_budget_until_cleared():
    root = DynamicTokenTrie(max_kv_bytes=1000)
    pinned = chain(root, [1, 2])
    pinned.set_past_key_values(kv(4000), pinned=True)
    for t in range(3, 8):
        chain(root, [t]).set_past_key_values(kv(1000))
    assert pinned.pinned and pinned.past_key_values is not None
    assert root.kv_nbytes == 1000
    root.clear_kv_cache()
    assert pinned.past_key_values is None and not pinned.pinned
    assert root.kv_nbytes == 0
    assert not root.children  # nodes left empty were pruned


def test_deferred_pruning_keeps_nodes_attached_until_the_block_ends():
    root = DynamicTokenTrie(max_kv_bytes=1000)
    old = chain(root, [1, 2])
    old.set_past_key_values(kv(1000))
    with root.deferred_pruning():
        chain(root, [3]).set_past_key_values(kv(1000))  # evicts `old`
        assert old.past_key_values is None
        assert root.walk([1, 2]) == (old, 2)  # still attached
    assert root.walk([1, 2]) == (root, 0)


def test_tree_stays_bounded_in_a_long_run():
    root = DynamicTokenTrie(max_kv_entries=4, max_logprobs_entries=4)
    for step in range(200):
        node = chain(root, [step % 7, step])
        node.set_logprobs(torch.zeros(1))
        node.set_past_key_values(kv(4))
    assert len(list(root)) <= 1 + 2 * 8
    assert root.kv_nbytes == 16

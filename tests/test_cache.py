"""OutputCache (LRU order, sizes, devices) and TokenTrie (the KV tree's node type)."""

from types import SimpleNamespace

import pytest
import torch

from genlm.backend.cache import OutputCache, TokenTrie
from genlm.backend.kv.store import KVNode, PrefixKVStore
from genlm.backend.kv.tree import node_at

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


def test_token_trie_names_the_kv_tree_node_type():
    assert TokenTrie is KVNode
    pool = SimpleNamespace(block_size=4, block_bytes=64, resize=lambda blocks: None)
    store = PrefixKVStore(pool)
    root = store.root(None)
    node = node_at(root, (5, 6, 7))
    assert isinstance(root, TokenTrie) and isinstance(node, TokenTrie)
    assert (node.depth, node.token, node.parent.token) == (3, 7, 6)
    assert set(root.children) == {5}

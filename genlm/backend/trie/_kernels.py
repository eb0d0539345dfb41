"""Numba kernels behind the tries: construction and the bottom-up weight passes.

Nodes are numbered in depth-first preorder, so every child has a larger id than
its parent and a single reverse sweep over the flat ``parent`` array visits each
node after all of its descendants. Compiled code is cached on disk
(``cache=True``), so the compile cost is paid once per machine.
"""

from __future__ import annotations

import numpy as np
from numba import njit

NO_SYMBOL = -1  # symbol code of the root and of leaves


@njit(cache=True)
def build_preorder(flat, starts, lengths, order):  # pragma: no cover - compiled
    """Trie of code sequences already sorted lexicographically.

    ``flat[starts[k]:starts[k] + lengths[k]]`` is the k-th sorted sequence and
    ``order[k]`` its vocabulary position. Returns ``(parent, symbol, position,
    leaf_of, size)`` where ``position`` is the vocabulary position of a leaf (-1 for
    prefix nodes), ``leaf_of[pos]`` the leaf of a position and ``size`` the
    number of nodes in each subtree (the subtree of ``i`` is ``i .. i + size[i] - 1``).
    """
    n = lengths.shape[0]
    capacity = 1 + n
    max_len = 0
    for k in range(n):
        capacity += lengths[k]
        if lengths[k] > max_len:
            max_len = lengths[k]
    parent = np.empty(capacity, np.int32)
    symbol = np.empty(capacity, np.int32)
    position = np.empty(capacity, np.int64)
    leaf_of = np.empty(n, np.int64)
    path = np.zeros(max_len + 1, np.int64)
    parent[0] = -1
    symbol[0] = NO_SYMBOL
    position[0] = -1
    next_id = 1
    for k in range(n):
        start = starts[k]
        length = lengths[k]
        common = 0
        if k > 0:
            prev = starts[k - 1]
            limit = min(length, lengths[k - 1])
            while common < limit and flat[start + common] == flat[prev + common]:
                common += 1
        for depth in range(common + 1, length + 1):
            parent[next_id] = path[depth - 1]
            symbol[next_id] = flat[start + depth - 1]
            position[next_id] = -1
            path[depth] = next_id
            next_id += 1
        parent[next_id] = path[length]
        symbol[next_id] = NO_SYMBOL
        position[next_id] = order[k]
        leaf_of[order[k]] = next_id
        next_id += 1
    size = np.ones(next_id, np.int64)
    for i in range(next_id - 1, 0, -1):
        size[parent[i]] += size[i]
    return parent[:next_id], symbol[:next_id], position[:next_id], leaf_of, size


@njit(cache=True)
def sum_into(parent, source, ws, out):  # pragma: no cover - compiled
    """``out[node]`` = sum of ``ws`` over the leaves below ``node`` (NaN propagates)."""
    # Forward pass: leaves read their weight (``source`` = vocabulary position, -1 for
    # prefix nodes), so writes are sequential; then one reverse sweep adds each node
    # into its parent, children (larger ids) always before parents.
    for i in range(parent.shape[0]):
        s = source[i]
        value = ws[s]
        out[i] = value if s >= 0 else 0.0
    for i in range(parent.shape[0] - 1, 0, -1):
        out[parent[i]] += out[i]


@njit(cache=True)
def max_into(parent, source, ws, out):  # pragma: no cover - compiled
    """``out[node]`` = max of ``ws`` over the leaves below it (NaN propagates, -inf if none)."""
    for i in range(parent.shape[0]):
        s = source[i]
        value = ws[s]
        out[i] = value if s >= 0 else -np.inf
    for i in range(parent.shape[0] - 1, 0, -1):
        value = out[i]
        p = parent[i]
        current = out[p]
        # keep ``current`` if it is NaN or at least ``value``: NaN propagates upwards
        out[p] = current if (current != current or value <= current) else value

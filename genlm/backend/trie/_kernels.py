"""Numba kernels behind the tries: sorting, construction and the bottom-up weight passes.

Nodes are numbered in depth-first preorder, so every child has a larger id than
its parent and a single reverse sweep over the flat ``parent`` array visits each
node after all of its descendants. Compiled code is cached on disk
(``cache=True``), so the compile cost is paid once per machine. The weight passes
release the GIL (``nogil=True``): while the async trie's worker thread sweeps, the
event loop keeps scheduling the particles.
"""

from __future__ import annotations

import numpy as np
from numba import njit

NO_SYMBOL = -1  # symbol code of the root and of leaves
_RUN = 16  # runs sorted by insertion before merging


@njit(cache=True, inline="always")
def _precedes(flat, prefix_key, starts, lengths, a, b):  # pragma: no cover - compiled
    """Whether sequence ``a`` sorts strictly before sequence ``b`` (lexicographic order)."""
    if prefix_key[a] != prefix_key[b]:
        return prefix_key[a] < prefix_key[b]
    start_a, start_b = starts[a], starts[b]
    length_a, length_b = lengths[a], lengths[b]
    for j in range(min(length_a, length_b)):
        x, y = flat[start_a + j], flat[start_b + j]
        if x != y:
            return x < y
    return length_a < length_b


@njit(cache=True)
def byte_prefix_keys(flat, starts, lengths):  # pragma: no cover - compiled
    """Each byte sequence's first 8 bytes as a big-endian integer (zero-padded).

    Keys sort like the sequences wherever they differ, so most comparisons of
    `sort_sequences` are one integer comparison.
    """
    keys = np.zeros(lengths.shape[0], np.uint64)
    for k in range(lengths.shape[0]):
        key = np.uint64(0)
        for j in range(8):
            key <<= np.uint64(8)
            if j < lengths[k]:
                key |= np.uint64(flat[starts[k] + j])
        keys[k] = key
    return keys


@njit(cache=True)
def sort_sequences(flat, prefix_key, starts, lengths):  # pragma: no cover - compiled
    """Stable lexicographic order of the sequences ``flat[starts[k]:starts[k] + lengths[k]]``.

    ``prefix_key`` must order sequences consistently with their symbols (or be all
    zeros). Bottom-up merge sort over insertion-sorted runs.
    """
    n = lengths.shape[0]
    order = np.arange(n)
    for lo in range(0, n, _RUN):
        for i in range(lo + 1, min(lo + _RUN, n)):
            k = order[i]
            j = i - 1
            while j >= lo and _precedes(flat, prefix_key, starts, lengths, k, order[j]):
                order[j + 1] = order[j]
                j -= 1
            order[j + 1] = k
    source, target = order, np.empty(n, np.int64)
    width = _RUN
    while width < n:
        for lo in range(0, n, 2 * width):
            mid, hi = min(lo + width, n), min(lo + 2 * width, n)
            i, j = lo, mid
            for out in range(lo, hi):
                if j < hi and (
                    i >= mid or _precedes(flat, prefix_key, starts, lengths, source[j], source[i])
                ):
                    target[out] = source[j]
                    j += 1
                else:
                    target[out] = source[i]
                    i += 1
        source, target = target, source
        width *= 2
    return source


@njit(cache=True)
def build_preorder(flat, starts, lengths, order):  # pragma: no cover - compiled
    """Trie of the sequences ``flat[starts[p]:starts[p] + lengths[p]]`` taken in sorted ``order``.

    Returns ``(parent, symbol, position, depth, leaf_of, size, repeated)`` where
    ``position`` is the vocabulary position of a leaf (-1 for prefix nodes), ``depth``
    the number of edges from the root, ``leaf_of[pos]`` the leaf of a position,
    ``size`` the number of nodes in each subtree (the subtree of ``i`` is
    ``i .. i + size[i] - 1``) and ``repeated[k]`` whether the k-th sorted sequence
    equals the one before it.
    """
    n = lengths.shape[0]
    capacity = 1 + n
    max_len = 0
    for k in range(n):
        capacity += lengths[k]
        max_len = max(max_len, lengths[k])
    parent = np.empty(capacity, np.int32)
    symbol = np.empty(capacity, np.int32)
    position = np.empty(capacity, np.int32)
    node_depth = np.empty(capacity, np.int32)
    leaf_of = np.empty(n, np.int64)
    repeated = np.zeros(n, np.bool_)
    path = np.zeros(max_len + 1, np.int64)
    parent[0] = -1
    symbol[0] = NO_SYMBOL
    position[0] = -1
    node_depth[0] = 0
    next_id = 1
    prev_start, prev_length = 0, 0
    for k in range(n):
        pos = order[k]
        start, length = starts[pos], lengths[pos]
        common = 0
        if k > 0:
            limit = min(length, prev_length)
            while common < limit and flat[start + common] == flat[prev_start + common]:
                common += 1
            repeated[k] = common == length and length == prev_length
        for depth in range(common + 1, length + 1):
            parent[next_id] = path[depth - 1]
            symbol[next_id] = flat[start + depth - 1]
            position[next_id] = -1
            node_depth[next_id] = depth
            path[depth] = next_id
            next_id += 1
        parent[next_id] = path[length]
        symbol[next_id] = NO_SYMBOL
        position[next_id] = pos
        node_depth[next_id] = length + 1
        leaf_of[pos] = next_id
        next_id += 1
        prev_start, prev_length = start, length
    size = np.ones(next_id, np.int64)
    for i in range(next_id - 1, 0, -1):
        size[parent[i]] += size[i]
    return (
        parent[:next_id],
        symbol[:next_id],
        position[:next_id],
        node_depth[:next_id],
        leaf_of,
        size,
        repeated,
    )


@njit(cache=True, nogil=True)
def sum_into(parent, leaf_nodes, leaf_positions, ws, out, acc):  # pragma: no cover - compiled
    """``out[node]`` = sum of ``ws`` over the leaves below ``node`` (NaN propagates).

    ``acc`` is a float64 work array of ``out``'s length (``out`` itself when float64),
    so sums are accumulated in float64 whatever the output type. Leaves are
    scattered in first, in node order (``leaf_nodes`` ascending, ``leaf_positions``
    their vocabulary positions) so writes stream through memory; the reverse sweep
    then finishes each node (all its descendants have larger ids) before adding it
    into its parent.
    """
    acc[:] = 0.0
    for j in range(leaf_nodes.shape[0]):
        acc[leaf_nodes[j]] = ws[leaf_positions[j]]
    for i in range(parent.shape[0] - 1, 0, -1):
        value = acc[i]
        out[i] = value
        acc[parent[i]] += value
    out[0] = acc[0]


@njit(cache=True, nogil=True)
def batch_sum_into(depth, is_leaf, leaf_rank, ws, out, leaf_ws, stack):  # pragma: no cover
    """`sum_into` for the K <= 8 rows of ``ws`` (``[K, V]``) at once, into ``out`` (``[K, nodes]``).

    A reverse preorder sweep meets a node's children right before the node, so
    one running sum per depth (``stack``, float64 ``[max depth + 2, 8]``) replaces
    a per-node accumulator: ``stack[d + 1]`` holds the finished sum of the children
    of the node at depth ``d`` being visited, and the sweep touches little memory
    besides ``out``. The K rows are lanes of one sweep, whose eight independent
    dependency chains overlap. The lanes are written out one by one: the same code
    with loops over the lanes compiled (numba 0.68) to a sweep 2.5x slower.

    ``leaf_rank[pos]`` is the rank of position ``pos``'s leaf in node order;
    ``leaf_ws`` (float64 ``[max(V, 1), 8]``) receives the weights in that order, so
    the sweep reads them as one sequential stream.
    """
    lanes = ws.shape[0]
    for position in range(leaf_rank.shape[0]):
        rank = leaf_rank[position]
        for k in range(lanes):
            leaf_ws[rank, k] = ws[k, position]
    stack[:] = 0.0
    rank = leaf_rank.shape[0] - 1
    for i in range(depth.shape[0] - 1, -1, -1):
        d = depth[i]
        leaf = is_leaf[i]
        r = max(rank, 0)
        rank -= leaf
        # Both loads and a select, not a branch: leaves and prefix nodes interleave
        # too irregularly for branch prediction. A leaf has no children, so its
        # ``stack[d + 1]`` is already zero.
        v0 = leaf_ws[r, 0] if leaf else stack[d + 1, 0]
        v1 = leaf_ws[r, 1] if leaf else stack[d + 1, 1]
        v2 = leaf_ws[r, 2] if leaf else stack[d + 1, 2]
        v3 = leaf_ws[r, 3] if leaf else stack[d + 1, 3]
        v4 = leaf_ws[r, 4] if leaf else stack[d + 1, 4]
        v5 = leaf_ws[r, 5] if leaf else stack[d + 1, 5]
        v6 = leaf_ws[r, 6] if leaf else stack[d + 1, 6]
        v7 = leaf_ws[r, 7] if leaf else stack[d + 1, 7]
        for k in range(8):
            stack[d + 1, k] = 0.0
        stack[d, 0] += v0
        stack[d, 1] += v1
        stack[d, 2] += v2
        stack[d, 3] += v3
        stack[d, 4] += v4
        stack[d, 5] += v5
        stack[d, 6] += v6
        stack[d, 7] += v7
        out[0, i] = v0
        if lanes > 1:
            out[1, i] = v1
        if lanes > 2:
            out[2, i] = v2
        if lanes > 3:
            out[3, i] = v3
        if lanes > 4:
            out[4, i] = v4
        if lanes > 5:
            out[5, i] = v5
        if lanes > 6:
            out[6, i] = v6
        if lanes > 7:
            out[7, i] = v7


@njit(cache=True, nogil=True)
def max_into(parent, leaf_nodes, leaf_positions, ws, out):  # pragma: no cover - compiled
    """``out[node]`` = max of ``ws`` over the leaves below it (NaN propagates, -inf if none).

    Without NaNs the sweep is a branch-free ``max`` (a compare-and-branch mispredicts
    often enough to cost 3x); with any NaN a slower sweep propagates it upwards.
    """
    out[:] = -np.inf
    has_nan = False
    for j in range(leaf_nodes.shape[0]):
        value = ws[leaf_positions[j]]
        has_nan |= value != value
        out[leaf_nodes[j]] = value
    if not has_nan:
        for i in range(parent.shape[0] - 1, 0, -1):
            p = parent[i]
            out[p] = max(out[p], out[i])
        return
    for i in range(parent.shape[0] - 1, 0, -1):
        value = out[i]
        p = parent[i]
        current = out[p]
        # keep ``current`` if it is NaN or at least ``value``: NaN propagates upwards
        out[p] = current if (current != current or value <= current) else value

"""`TokenCharacterTrie`: turns a distribution over tokens into weights of byte prefixes.

Every distinct prefix of the vocabulary's symbol sequences is a node, and each
vocabulary position gets its own leaf under the node of its full sequence (so
two tokens with equal bytes get two leaves). `weight_sum(ws)` gives, for every
node, the total weight of the tokens below it; `weight_max(ws)` the largest.

Symbols: a `Token` or plain ``bytes`` entry is the sequence of its byte values
(ints 0-255); any other iterable (a ``str``, a tuple) is the sequence of its
elements; anything else (e.g. an end-of-sequence object) is a single symbol, so
it hangs off the root on its own edge.

Speed: construction concatenates the entries' bytes, sorts them and shares
prefixes in compiled passes (no per-entry Python objects for Token/bytes
vocabularies); nodes are numbered in depth-first preorder (children after
parents, siblings in sorted order, related nodes adjacent in memory) so both
weight functions are one scatter of the leaves plus one reverse sweep over a flat
parent array; batched sums sweep eight distributions together over the nodes'
depths (see `_kernels.batch_sum_into`). The per-node Python views clients read
(`children`, `word2leaf`, `node2prefix`, `jump`, ...) are built on first access.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Hashable, Iterable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from genlm.backend.tokenization.token import Token
from genlm.backend.trie._results import ResultBlocks
from genlm.backend.trie._weights import (
    as_numpy,
    as_weights,
    checked_out,
    checked_weights,
    is_tensor,
    write_into,
)

if TYPE_CHECKING:
    import graphviz

    from genlm.backend.trie._weights import Out

_BYTE_CODES = 256  # codes below this are byte values; others index `_symbols`


SUM_LANES = 8  # distributions summed together by one sweep (the width of `batch_sum_into`)


class TokenCharacterTrie:
    """Prefix tree over a vocabulary's symbol sequences, with per-position leaves.

    Args:
        decode: the vocabulary, ``decode[i]`` being entry ``i``: `Token` objects
            (preferred), plain ``bytes`` (deprecated) or other hashable items.

    Raises:
        ValueError: two entries have the same `word2leaf` key.
        TypeError: an entry is not hashable.
    """

    def __init__(self, decode: Sequence[Any]):
        from genlm.backend.trie import _kernels

        self.decode = list(decode)
        flat, lengths, self._symbols, keys = _encode(self.decode)
        starts = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        if flat.dtype == np.uint8:
            prefix_key = _kernels.byte_prefix_keys(flat, starts, lengths)
        else:
            prefix_key = np.zeros(len(lengths), np.uint64)
        order = _kernels.sort_sequences(flat, prefix_key, starts, lengths)
        parent, symbol, position, depth, leaf_of, size, repeated = _kernels.build_preorder(
            flat, starts, lengths, order
        )
        if keys is not None:  # mixed vocabulary: keys were built along the way
            _check_unique(keys, range(len(keys)))
            self.__dict__["_keys"] = keys
        elif repeated.any():  # Tokens and bytes: only entries with equal bytes can clash
            same = np.flatnonzero(repeated)
            candidates = np.unique(order[np.concatenate([same - 1, same])]).tolist()
            _check_unique([_key(self.decode[p]) for p in candidates], candidates)
        self._scratch_arrays: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
        self._results = ResultBlocks()
        self.root = 0
        self.parent = parent
        self.leaf_of = leaf_of
        self._leaf_nodes = np.sort(leaf_of).astype(np.int32)
        self._leaf_positions = position[self._leaf_nodes]
        self._depth = depth
        self._max_depth = int(depth.max())
        self._is_leaf = position >= 0
        self._leaf_rank = np.empty(len(self.decode), np.int32)
        self._leaf_rank[self._leaf_positions] = np.arange(len(self.decode), dtype=np.int32)
        self._symbol = symbol
        self._position = position
        self._subtree_size = size
        self.num_nodes = int(parent.shape[0])
        self.idx_to_leaf = np.stack([np.arange(len(self.decode), dtype=np.int64), leaf_of], axis=1)
        self.ordering = np.arange(self.num_nodes - 1, -1, -1, dtype=np.int32)

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={len(self.decode)}, num_nodes={self.num_nodes})"

    # ----------------------------------------------------------------- structure views

    def symbol_of(self, node: int) -> Any:
        """The symbol on the edge into ``node`` (None for the root and for leaves)."""
        code = int(self._symbol[node])
        if code < 0:
            return None
        return code if code < _BYTE_CODES else self._symbols[code - _BYTE_CODES]

    def _edge_keys(self) -> list[Any]:
        codes = self._symbol.tolist()
        positions = self._position.tolist()
        symbols = self._symbols
        return [
            (None, pos)
            if pos >= 0
            else (code if code < _BYTE_CODES else symbols[code - _BYTE_CODES])
            for code, pos in zip(codes, positions, strict=True)
        ]

    @cached_property
    def children(self) -> list[dict[Any, int]]:
        """Per node, ``{edge symbol: child}``; a leaf's edge key is ``(None, position)``."""
        children: list[dict[Any, int]] = [{} for _ in range(self.num_nodes)]
        for node, (parent, key) in enumerate(
            zip(self.parent.tolist(), self._edge_keys(), strict=True)
        ):
            if node:
                children[parent][key] = node
        return children

    @cached_property
    def _keys(self) -> list[Hashable]:
        return [_key(item) for item in self.decode]

    @cached_property
    def word2leaf(self) -> dict[Hashable, int]:
        """Entry key -> leaf: ``(bytes, token_id)`` for a Token, the bytes for plain bytes,
        the item itself otherwise."""
        return dict(zip(self._keys, self.leaf_of.tolist(), strict=True))

    @cached_property
    def leaf2word(self) -> dict[int, Hashable]:
        """Leaf -> entry key (see `word2leaf`)."""
        return dict(zip(self.leaf_of.tolist(), self._keys, strict=True))

    @cached_property
    def node2prefix(self) -> dict[int, list[Any]]:
        """Node -> the list of symbols spelling its prefix (a leaf: its entry's full sequence)."""
        prefixes: list[list[Any]] = [[]]
        for node, (parent, key) in enumerate(
            zip(self.parent.tolist(), self._edge_keys(), strict=True)
        ):
            if node:
                base = prefixes[parent]
                prefixes.append(base + [key] if self._position[node] < 0 else list(base))
        return dict(enumerate(prefixes))

    @cached_property
    def jump(self) -> list[np.ndarray]:
        """Per node, the int32 array of its children's ids (ascending)."""
        child_ids = np.arange(1, self.num_nodes, dtype=np.int32)
        by_parent = np.argsort(self.parent[1:], kind="stable")
        counts = np.bincount(self.parent[1:], minlength=self.num_nodes)
        return np.split(child_ids[by_parent], np.cumsum(counts)[:-1])

    # ----------------------------------------------------------------- weights

    def _vector(self, ws: Any) -> np.ndarray:
        """``ws`` as a float32/float64 numpy vector of length ``len(decode)`` (no copy if
        it already is one, e.g. a CPU float32 tensor)."""
        return as_numpy(checked_weights(ws, len(self.decode)))

    def _rows(self, ws: Any) -> list[np.ndarray] | np.ndarray:
        """A list of vectors or a 2-D array/tensor as validated rows (see `_vector`)."""
        if isinstance(ws, (list, tuple)):
            return [self._vector(w) for w in ws]
        return as_numpy(checked_weights(ws, len(self.decode), batched=True))

    def _sum(self, ws: np.ndarray, out: np.ndarray, acc: np.ndarray) -> None:
        from genlm.backend.trie._kernels import sum_into

        sum_into(self.parent, self._leaf_nodes, self._leaf_positions, ws, out, acc)

    def _max(self, ws: np.ndarray, out: np.ndarray) -> None:
        from genlm.backend.trie._kernels import max_into

        max_into(self.parent, self._leaf_nodes, self._leaf_positions, ws, out)

    def weight_sum(self, ws: Any, out: Out | None = None) -> Out:
        """Per node, the sum of ``ws[i]`` over the positions ``i`` below it.

        ``ws``: numpy array or torch tensor (any device) of length ``len(decode)``.
        Returns a float64 array of length `num_nodes`; NaN weights propagate to
        every ancestor. ``out``: where to write the result instead, a float32 numpy array
        or torch tensor (any device) of shape ``[num_nodes]``; it is returned.
        """
        result = np.empty(self.num_nodes)
        self._sum(self._vector(ws), result, result)
        return result if out is None else write_into(result, checked_out(out, result.shape))

    def weight_max(self, ws: Any, out: Out | None = None) -> Out:
        """Per node, the max of ``ws[i]`` over the positions below it.

        A NaN weight makes every ancestor NaN (as `np.maximum` does); a node with no
        positions below it (only the root of an empty vocabulary) gets ``-inf``.
        ``out``: as in `weight_sum`.
        """
        result = np.empty(self.num_nodes)
        self._max(self._vector(ws), result)
        return result if out is None else write_into(result, checked_out(out, result.shape))

    def batch_weight_sum(self, ws: Any, out: Out | None = None) -> Out:
        """`weight_sum` of B distributions (list of vectors or ``[B, V]``) -> ``[B, num_nodes]``.

        float32 results (accumulated in float64): half the memory traffic of float64,
        which is what a batch's time goes to. The array returned is the caller's: blocks
        are reused only once every view of an earlier result is gone (`ResultBlocks`).
        ``out``: a float32 ``[B, num_nodes]`` numpy array or torch tensor (any device) to
        write into instead; it is returned.
        """
        from genlm.backend.trie._kernels import batch_sum_into

        rows = self._rows(ws)
        out = self._output(len(rows), out)
        host = self._results.take(len(rows), self.num_nodes) if is_tensor(out) else out
        assert isinstance(host, np.ndarray)
        for start in range(0, len(rows), SUM_LANES):
            chunk = rows[start : start + SUM_LANES]
            if len(chunk) == 1:  # the one-row kernel is faster than one lane of eight
                self._sum(chunk[0], host[start], self._scratch((self.num_nodes,)))
                continue
            chunk = np.stack(chunk) if isinstance(chunk, list) else chunk
            leaf_ws = self._scratch((max(len(self.decode), 1), SUM_LANES))
            stack = self._scratch((self._max_depth + 2, SUM_LANES))
            batch_sum_into(
                self._depth, self._is_leaf, self._leaf_rank, chunk, host[start:], leaf_ws, stack
            )
        return write_into(host, out)

    def batch_weight_max(self, ws: Any, out: Out | None = None) -> Out:
        """`weight_max` of B distributions -> float32 ``[B, num_nodes]`` (``out``: as in
        `batch_weight_sum`)."""
        rows = self._rows(ws)
        out = self._output(len(rows), out)
        host = self._results.take(len(rows), self.num_nodes) if is_tensor(out) else out
        assert isinstance(host, np.ndarray)
        for row, row_out in zip(rows, host, strict=True):
            self._max(row, row_out)
        return write_into(host, out)

    def _output(self, num_rows: int, out: Out | None) -> Out:
        """``out`` checked to be float32 ``[num_rows, num_nodes]``, or a leased block."""
        if out is None:
            return self._results.take(num_rows, self.num_nodes)
        return checked_out(out, (num_rows, self.num_nodes))

    def _scratch(self, shape: tuple[int, ...]) -> np.ndarray:
        """A float64 work array of ``shape``, kept per thread between calls: a fresh
        multi-megabyte array costs new zero-filled pages on every call."""
        key = (threading.get_ident(), shape)
        scratch = self._scratch_arrays.get(key)
        if scratch is None:
            scratch = self._scratch_arrays[key] = np.zeros(shape)
        return scratch

    def mass_sum(self, p_llm: Any) -> Out:
        """Deprecated name of `weight_sum`."""
        warnings.warn("mass_sum is deprecated; use weight_sum", DeprecationWarning, stacklevel=2)
        return self.weight_sum(p_llm)

    def batch_mass_sum(self, p_llms: Any) -> Out:
        """Deprecated name of `batch_weight_sum`."""
        warnings.warn(
            "batch_mass_sum is deprecated; use batch_weight_sum", DeprecationWarning, stacklevel=2
        )
        return self.batch_weight_sum(p_llms)

    # ----------------------------------------------------------------- drawing

    def visualize(self, ws: Any = None) -> graphviz.Digraph:
        """Draw the trie with graphviz (renders inline in Jupyter).

        Nodes show their id and prefix, plus their weight when ``ws`` (one value per
        node, e.g. the output of `weight_sum`) is given, shaded by weight; leaves are
        double circles reached by an "End-of-Token (ID: n)" edge.
        """
        from genlm.backend.trie._draw import render

        if ws is not None:
            ws = as_numpy(as_weights(ws))
            if ws.ndim != 1 or ws.shape[0] != self.num_nodes:
                raise ValueError(
                    f"visualize needs one weight per node ({self.num_nodes}), "
                    f"got shape {tuple(ws.shape)}"
                )
        return render(self, ws)


def _encode(decode: list[Any]) -> tuple[np.ndarray, np.ndarray, list, list[Hashable] | None]:
    """The entries' symbol codes, concatenated in vocabulary order.

    Returns ``(flat, lengths, symbols, keys)``: ``flat`` holds bytes (uint8) when every
    entry is a `Token` or ``bytes``, else int32 codes where ``256 + j`` stands for
    ``symbols[j]``; ``keys`` is None for Token/bytes vocabularies (built lazily) and the
    `word2leaf` keys otherwise.
    """
    types = set(map(type, decode))
    if types <= {Token, bytes}:
        if bytes in types:
            _warn_plain_bytes(sum(type(item) is bytes for item in decode))
        lengths = np.fromiter(map(len, decode), np.int64, len(decode))
        return np.frombuffer(b"".join(decode), np.uint8), lengths, [], None
    keys: list[Hashable] = []
    sequences: list[Any] = []
    codes: dict[Hashable, int] = {}
    symbols: list[Any] = []
    plain_bytes = 0
    for item in decode:
        keys.append(_key(item))
        if isinstance(item, (bytes, bytearray)):
            plain_bytes += not isinstance(item, Token)
            sequences.append(np.frombuffer(bytes(item), np.uint8))
        else:
            sequences.append(np.asarray(_symbol_codes(item, codes, symbols), np.int64))
    if plain_bytes:
        _warn_plain_bytes(plain_bytes)
    lengths = np.fromiter(map(len, sequences), np.int64, len(sequences))
    flat = np.concatenate([*sequences, np.zeros(0, np.int64)]).astype(np.int32)
    return flat, lengths, symbols, keys


def _key(item: Any) -> Hashable:
    """`word2leaf` key of a vocabulary entry."""
    if isinstance(item, Token):
        return (bytes(item), item.token_id)
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    return item


def _warn_plain_bytes(count: int) -> None:
    warnings.warn(
        f"Passing plain bytes to TokenCharacterTrie is deprecated ({count} entries): pass "
        "genlm.backend.Token(token_id, bytes) objects instead",
        DeprecationWarning,
        stacklevel=4,
    )


def _symbol_codes(item: Any, codes: dict[Hashable, int], symbols: list[Any]) -> list[int]:
    """Codes of a non-bytes entry's symbols: its elements if iterable, else the item itself."""
    try:
        hash(item)
    except TypeError:
        raise TypeError(f"vocabulary entries must be hashable, got {item!r}") from None
    sequence = item if isinstance(item, Iterable) else (item,)
    out = []
    for symbol in sequence:
        if isinstance(symbol, int) and not isinstance(symbol, bool) and 0 <= symbol < _BYTE_CODES:
            out.append(symbol)
            continue
        code = codes.get(symbol)
        if code is None:
            code = codes[symbol] = _BYTE_CODES + len(symbols)
            symbols.append(symbol)
        out.append(code)
    return out


def _check_unique(keys: list[Hashable], positions: Iterable[int]) -> None:
    """Raise `ValueError` if two of ``keys`` (entries at ``positions``) are equal."""
    if len(set(keys)) == len(keys):
        return
    seen: dict[Hashable, int] = {}
    for position, key in zip(positions, keys, strict=True):
        if key in seen:
            raise ValueError(
                f"Duplicate word in vocabulary: {key!r} at positions {seen[key]} and {position}; "
                "use Token(token_id, bytes) to tell apart tokens with equal bytes"
            )
        seen[key] = position

"""`TokenCharacterTrie`: turns a distribution over tokens into weights of byte prefixes.

Every distinct prefix of the vocabulary's symbol sequences is a node, and each
vocabulary position gets its own leaf under the node of its full sequence (so
two tokens with equal bytes get two leaves). `weight_sum(ws)` gives, for every
node, the total weight of the tokens below it; `weight_max(ws)` the largest.

Symbols: a `Token` or plain ``bytes`` entry is the sequence of its byte values
(ints 0-255); any other iterable (a ``str``, a tuple) is the sequence of its
elements; anything else (e.g. an end-of-sequence object) is a single symbol, so
it hangs off the root on its own edge.

Speed: construction sorts the sequences and shares prefixes in one compiled
pass; nodes are numbered in depth-first preorder (children after parents,
siblings in sorted order, related nodes adjacent in memory) so both weight
functions are one reverse sweep over a flat parent array. The per-node Python
views clients read (`children`, `word2leaf`, `node2prefix`, `jump`, ...) are
built on first access.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Hashable, Iterable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from genlm.backend.tokenization.token import Token

if TYPE_CHECKING:
    import graphviz

_BYTE_CODES = 256  # codes below this are byte values; others index `_symbols`


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
        self._keys, flat, lengths, order, self._symbols = _encode(self.decode)
        starts = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        parent, symbol, position, leaf_of, size = _kernels.build_preorder(
            flat, starts, lengths, order
        )
        self.root = 0
        self.parent = parent
        self.leaf_of = leaf_of
        self._symbol = symbol
        self._position = position
        self._source = position.astype(np.int32)
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
        """``ws`` as a contiguous float64 numpy vector of length ``len(decode)``."""
        ws = _as_numpy(ws)
        check_weights_shape(ws.shape, len(self.decode), batched=False)
        # The kernels read ``ws[-1]`` for prefix nodes (and discard it): keep one element.
        return np.ascontiguousarray(ws) if ws.shape[0] else np.zeros(1)

    def _matrix(self, ws: Any) -> np.ndarray:
        """A list of vectors or a 2-D array/tensor as a contiguous float64 ``[B, V]`` array."""
        if isinstance(ws, (list, tuple)):
            rows = [self._vector(w) for w in ws]
            return np.stack(rows) if rows else np.empty((0, max(len(self.decode), 1)))
        ws = _as_numpy(ws)
        check_weights_shape(ws.shape, len(self.decode), batched=True)
        return np.ascontiguousarray(ws) if ws.shape[1] else np.zeros((ws.shape[0], 1))

    def weight_sum(self, ws: Any) -> np.ndarray:
        """Per node, the sum of ``ws[i]`` over the positions ``i`` below it.

        ``ws``: numpy array or torch tensor (any device) of length ``len(decode)``.
        Returns a float64 array of length `num_nodes`; NaN weights propagate to
        every ancestor.
        """
        return self._run("sum_into", self._vector(ws)[None])[0]

    def weight_max(self, ws: Any) -> np.ndarray:
        """Per node, the max of ``ws[i]`` over the positions below it.

        A NaN weight makes every ancestor NaN (as `np.maximum` does); a node with no
        positions below it (only the root of an empty vocabulary) gets ``-inf``.
        """
        return self._run("max_into", self._vector(ws)[None])[0]

    def batch_weight_sum(self, ws: Any) -> np.ndarray:
        """`weight_sum` of B distributions (list of vectors or ``[B, V]``) -> ``[B, num_nodes]``."""
        return self._run("sum_into", self._matrix(ws))

    def batch_weight_max(self, ws: Any) -> np.ndarray:
        """`weight_max` of B distributions -> ``[B, num_nodes]``."""
        return self._run("max_into", self._matrix(ws))

    def _run(self, kernel: str, ws: np.ndarray) -> np.ndarray:
        # One compiled sweep per row; measured faster than one kernel looping over rows.
        from genlm.backend.trie import _kernels

        sweep = getattr(_kernels, kernel)
        out = np.empty((ws.shape[0], self.num_nodes), np.float64)
        for row, row_out in zip(ws, out, strict=True):
            sweep(self.parent, self._source, row, row_out)
        return out

    def mass_sum(self, p_llm: Any) -> np.ndarray:
        """Deprecated name of `weight_sum`."""
        warnings.warn("mass_sum is deprecated; use weight_sum", DeprecationWarning, stacklevel=2)
        return self.weight_sum(p_llm)

    def batch_mass_sum(self, p_llms: Any) -> np.ndarray:
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
        from genlm.backend.trie._draw import draw

        if ws is not None:
            ws = _as_numpy(ws)
            if ws.ndim != 1 or ws.shape[0] != self.num_nodes:
                raise ValueError(
                    f"visualize needs one weight per node ({self.num_nodes}), "
                    f"got shape {tuple(ws.shape)}"
                )
        return draw(self, ws)


def check_weights_shape(shape: tuple[int, ...], vocab_size: int, batched: bool) -> None:
    """Raise `ValueError` unless ``shape`` is ``(vocab_size,)`` (or ``(B, vocab_size)``)."""
    if batched and (len(shape) != 2 or shape[1] != vocab_size):
        raise ValueError(
            f"batched weights must have shape [B, {vocab_size}] (or be a list of vectors), "
            f"got shape {tuple(shape)}"
        )
    if not batched and (len(shape) != 1 or shape[0] != vocab_size):
        raise ValueError(
            f"weights must be 1-D with one entry per vocabulary position "
            f"(length {vocab_size}), got shape {tuple(shape)}"
        )


def _as_numpy(ws: Any) -> np.ndarray:
    """A numpy float64 copy/view of a numpy array, torch tensor (any device) or sequence."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(ws, torch.Tensor):
        return ws.detach().to(device="cpu", dtype=torch.float64).numpy()
    return np.asarray(ws, dtype=np.float64)


def _encode(decode: list[Any]) -> tuple[list[Hashable], np.ndarray, np.ndarray, np.ndarray, list]:
    """Keys, and the entries' symbol codes sorted lexicographically.

    Returns ``(keys, flat, lengths, order, symbols)``: ``flat`` concatenates the
    sorted code sequences, ``lengths`` their lengths, ``order[k]`` the position of
    the k-th sorted entry, and code ``256 + j`` stands for ``symbols[j]``.
    """
    keys: list[Hashable] = []
    sequences: list[bytes | list[int]] = []
    codes: dict[Hashable, int] = {}
    symbols: list[Any] = []
    plain_bytes = 0
    for item in decode:
        if isinstance(item, Token):
            raw = bytes(item)
            keys.append((raw, item.token_id))
            sequences.append(raw)
        elif isinstance(item, (bytes, bytearray)):
            raw = bytes(item)
            keys.append(raw)
            sequences.append(raw)
            plain_bytes += 1
        else:
            keys.append(item)
            sequences.append(_symbol_codes(item, codes, symbols))
    if plain_bytes:
        warnings.warn(
            f"TokenCharacterTrie got {plain_bytes} plain bytes entries; pass "
            "genlm.backend.Token(token_id, bytes) objects instead (plain bytes are deprecated)",
            DeprecationWarning,
            stacklevel=3,
        )
    _check_unique(keys)
    width = 1 if not symbols else 4
    sort_keys = sequences if width == 1 else _wide(sequences)
    order = sorted(range(len(sort_keys)), key=sort_keys.__getitem__)
    joined = b"".join([sort_keys[k] for k in order])
    dtype = np.uint8 if width == 1 else ">u4"
    flat = np.frombuffer(joined, dtype=dtype).astype(np.int32)
    lengths = np.fromiter((len(sort_keys[k]) // width for k in order), np.int64, len(order))
    return keys, flat, lengths, np.asarray(order, dtype=np.int64), symbols


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


def _wide(sequences: list[bytes | list[int]]) -> list[bytes]:
    """Big-endian uint32 encodings, which sort like the code sequences themselves."""
    byte_entries = [i for i, seq in enumerate(sequences) if isinstance(seq, bytes)]
    joined = b"".join([sequences[i] for i in byte_entries])
    wide_bytes = np.frombuffer(joined, dtype=np.uint8).astype(">u4").tobytes()
    out = [b""] * len(sequences)
    offset = 0
    for i in byte_entries:
        end = offset + 4 * len(sequences[i])
        out[i] = wide_bytes[offset:end]
        offset = end
    for i, seq in enumerate(sequences):
        if not isinstance(seq, bytes):
            out[i] = np.asarray(seq, dtype=">u4").tobytes()
    return out


def _check_unique(keys: list[Hashable]) -> None:
    if len(set(keys)) == len(keys):
        return
    seen: dict[Hashable, int] = {}
    for position, key in enumerate(keys):
        if key in seen:
            raise ValueError(
                f"duplicate vocabulary entry {key!r} at positions {seen[key]} and {position}; "
                "use Token(token_id, bytes) to tell apart tokens with equal bytes"
            )
        seen[key] = position

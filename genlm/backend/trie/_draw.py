"""Graphviz drawing of a token-character trie (see `TokenCharacterTrie.visualize`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from genlm.backend.tokenization.token import Token

if TYPE_CHECKING:
    import graphviz


class DrawableTrie(Protocol):
    """What `render` reads of a trie (`TokenCharacterTrie` has it all)."""

    @property
    def decode(self) -> Sequence[Any]: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def parent(self) -> np.ndarray: ...

    @property
    def idx_to_leaf(self) -> np.ndarray: ...

    @property
    def node2prefix(self) -> dict[int, list[Any]]: ...

    def symbol_of(self, node: int) -> Any: ...


_LIGHT = np.array([0xFF, 0xFF, 0xFF])
_DARK = np.array([0x4A, 0x90, 0xD9])


def render(trie: DrawableTrie, ws: np.ndarray | None) -> graphviz.Digraph:
    """A `graphviz.Digraph` of ``trie``, nodes shaded by ``ws`` (one weight per node) if given."""
    import graphviz

    position = np.full(trie.num_nodes, -1, np.int64)  # the vocabulary position of each leaf
    position[trie.idx_to_leaf[:, 1]] = trie.idx_to_leaf[:, 0]

    shade = _shades(ws) if ws is not None else None
    graph = graphviz.Digraph(name="trie", graph_attr={"rankdir": "LR"})
    graph.attr("node", fontname="Helvetica", fontsize="10", style="filled", fillcolor="white")
    graph.attr("edge", fontname="Helvetica", fontsize="9")
    prefixes = trie.node2prefix
    for node in range(trie.num_nodes):
        lines = [str(node), _prefix_text(prefixes[node])]
        if ws is not None:
            lines.append(f"{ws[node]:.3g}")
        label = "\\n".join(graphviz.escape(line) for line in lines)
        attrs = {"shape": "doublecircle" if position[node] >= 0 else "circle"}
        if shade is not None:
            attrs["fillcolor"] = shade[node]
        graph.node(str(node), label=label, **attrs)
    for node in range(1, trie.num_nodes):
        if position[node] >= 0:
            entry = trie.decode[position[node]]
            token_id = entry.token_id if isinstance(entry, Token) else int(position[node])
            label = f"End-of-Token (ID: {token_id})"
        else:
            label = _symbol_text(trie.symbol_of(node))
        graph.edge(str(trie.parent[node]), str(node), label=graphviz.escape(label))
    return graph


def _symbol_text(symbol: Any) -> str:
    if isinstance(symbol, int) and 0 <= symbol < 256:
        return bytes([symbol]).decode("utf-8", "backslashreplace")
    return str(symbol)


def _prefix_text(prefix: list[Any]) -> str:
    if all(isinstance(s, int) and 0 <= s < 256 for s in prefix):
        return repr(bytes(prefix))
    return repr([_symbol_text(s) for s in prefix])


def _shades(ws: np.ndarray) -> list[str]:
    """Fill colours from white (smallest finite weight) to blue (largest)."""
    finite = np.isfinite(ws)
    scaled = np.zeros(ws.shape[0])
    if finite.any():
        low, high = ws[finite].min(), ws[finite].max()
        scaled[finite] = (ws[finite] - low) / (high - low) if high > low else 1.0
    colours = np.rint(_LIGHT + scaled[:, None] * (_DARK - _LIGHT)).astype(int)
    return [f"#{r:02x}{g:02x}{b:02x}" for r, g, b in colours]

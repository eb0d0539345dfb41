"""The prefix trees of `PrefixKVStore`: `KVNode`, one plain record per token prefix (its
cached next-token logprobs and its chain of KV blocks), and the walks over them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from genlm.backend.kv.pool import Chain


@dataclass(eq=False, repr=False, slots=True)
class KVNode:
    """One token prefix: its children, cached next-token logprobs and KV chain (plain data;
    slotted: a tree holds a node per token of every cached prefix)."""

    parent: KVNode | None = None
    token: int | None = None
    depth: int = 0
    children: dict[int, KVNode] = field(default_factory=dict)
    logprobs: Any = None
    chain: Chain | None = None
    pinned: bool = False

    def __repr__(self) -> str:
        """One line about this node alone: a tree thousands of tokens deep (parent and
        children link every node) prints in constant time and space."""
        blocks = 0 if self.chain is None else len(self.chain)
        return (
            f"KVNode(depth={self.depth}, token={self.token}, children={len(self.children)}, "
            f"blocks={blocks}, pinned={self.pinned}, logprobs={self.logprobs is not None})"
        )


def walk(node: KVNode, ids: Sequence[int]) -> tuple[KVNode, int]:
    """Follow ``ids`` from ``node`` (a root, or a node on the path of ``ids``) as far as
    the tree goes: ``(deepest node, tokens of ids it covers)``. Reads ``ids[node.depth:]``
    in one slice (a `PrefixHandle` reads only the chunks it spans)."""
    for token in ids[node.depth :]:
        child = node.children.get(token)
        if child is None:
            return node, node.depth
        node = child
    return node, len(ids)


def node_at(node: KVNode, ids: Sequence[int]) -> KVNode:
    """The node for ``ids`` below ``node`` (at depth ``node.depth``), created as needed."""
    for token in ids[node.depth :]:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = KVNode(node, token, node.depth + 1)
        node = child
    return node


def kv_source(node: KVNode, search: int = 256) -> KVNode | None:
    """The node whose chain holds the longest KV usable for ``node``'s prefix: the nearest
    ancestor-or-self with a chain, or a descendant's (its chain starts with ``node``'s
    prefix; a few nodes are searched). None for a root."""
    if node.parent is None:
        return None
    ancestor: KVNode | None = node
    while ancestor is not None and ancestor.chain is None:
        ancestor = ancestor.parent
    if ancestor is node:
        return node
    stack = list(node.children.values())
    while stack and search > 0:
        search -= 1
        candidate = stack.pop()
        if candidate.chain is not None:
            return candidate
        stack.extend(candidate.children.values())
    return ancestor


def kv_start(node: KVNode, length: int) -> tuple[KVNode | None, int]:
    """Where a request for a prefix of ``length`` ids starts (``node``: the deepest node
    on its path): the node whose chain holds the KV it reuses and the first token still
    to run, at most ``length - 1`` (``(None, 0)``: no KV to reuse)."""
    source = kv_source(node)
    if source is None or source.chain is None:
        return None, 0
    return source, min(source.depth, node.depth, length - 1)


def attached(node: KVNode) -> bool:
    """Whether ``node`` is still its parent's child (`prune` detaches a node and dropping a
    tree empties its nodes; an attached node's ancestors are attached, as a node is only
    detached once it has no children)."""
    parent, token = node.parent, node.token
    return parent is not None and token is not None and parent.children.get(token) is node


def prune(nodes: Sequence[KVNode]) -> None:
    """Detach each of ``nodes`` left with no value and no children, and so on up its
    path, so the trees stay bounded (between batches, when no caller holds a node)."""
    for node in nodes:
        while (
            node.parent is not None
            and node.token is not None
            and not node.children
            and node.logprobs is None
            and node.chain is None
            and node.parent.children.get(node.token) is node
        ):
            del node.parent.children[node.token]
            node = node.parent


def subtree(root: KVNode) -> list[KVNode]:
    """Every node of the tree under ``root``, ``root`` included."""
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes

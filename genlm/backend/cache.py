"""Caches: an LRU map of outputs and the token prefix trees behind KV reuse.

- `OutputCache`: LRU map from token-id tuples to tensors (e.g. logprobs).
- `TokenTrie`: a prefix tree of token ids; each node may hold the next-token
  log-probabilities after its prefix and the KV state (``past_key_values``,
  backend-specific) that ends at it.
- `DynamicTokenTrie`: a `TokenTrie` whose KV states and logprobs are bounded by
  budgets, evicting the least recently used first.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from genlm.backend.batching import check_int

if TYPE_CHECKING:
    from typing_extensions import Self


class OutputCache:
    """LRU map from token-id tuples to tensors, holding at most ``maxsize`` entries.

    With ``move_to_cpu=True`` values are stored on the CPU and handed back on the
    device they came from, so a large cache does not occupy accelerator memory.
    """

    def __init__(self, maxsize: int, move_to_cpu: bool = False):
        check_int("maxsize", maxsize, minimum=0)
        if not isinstance(move_to_cpu, bool):
            raise TypeError(f"move_to_cpu must be a bool, got {type(move_to_cpu).__name__}")
        self.maxsize = maxsize
        self.move_to_cpu = move_to_cpu
        self._data: OrderedDict[Hashable, tuple[Any, Any]] = OrderedDict()

    @staticmethod
    def _key(key: Any) -> Hashable:
        return tuple(key) if isinstance(key, list) else key

    def __getitem__(self, key: Any) -> Any:
        key = self._key(key)
        value, device = self._data[key]
        self._data.move_to_end(key)
        return value.to(device) if device is not None else value

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.maxsize == 0:
            return
        key = self._key(key)
        device = None
        if self.move_to_cpu and getattr(value, "device", None) is not None:
            device = value.device
            value = value.cpu()
        self._data[key] = (value, device)
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def __contains__(self, key: Any) -> bool:
        return self._key(key) in self._data

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()

    def discard(self, predicate: Callable[[Any], bool]) -> None:
        """Drop every entry whose key satisfies ``predicate``."""
        for key in [key for key in self._data if predicate(key)]:
            del self._data[key]


def storages(value: Any) -> list[tuple[Hashable, int]]:
    """The memory blocks behind a value: ``(block key, bytes)`` pairs.

    A torch tensor is charged for its whole underlying storage, keyed by the storage's
    address, so views of one buffer (e.g. rows of a batched KV tensor) are counted once
    and padding or unused rows are counted too. Other arrays (numpy, MLX) are charged
    their own size, keyed by object identity.
    """
    if value is None:
        return []
    if isinstance(value, tuple | list):
        return [block for item in value for block in storages(item)]
    storage = getattr(value, "untyped_storage", None)
    if storage is not None:
        storage = storage()
        return [(("storage", value.device, storage.data_ptr()), int(storage.nbytes()))]
    nbytes = getattr(value, "nbytes", None)
    if nbytes is None and hasattr(value, "element_size") and hasattr(value, "numel"):
        nbytes = value.element_size() * value.numel()
    if nbytes is None:
        nbytes = sys.getsizeof(value)
    return [(("object", id(value)), int(nbytes))]


class TokenTrie:
    """A node of a prefix tree over token ids.

    Attributes:
        children: ``token id -> child node``.
        logprobs: next-token log-probabilities after this node's prefix, or None.
        past_key_values: the KV state ending at this node (backend-specific), or None.
        parent, token, depth: where the node sits (the root has depth 0, token None).
    """

    __slots__ = (
        "children",
        "logprobs",
        "past_key_values",
        "parent",
        "token",
        "depth",
        "__weakref__",
    )

    def __init__(self, parent: Self | None = None, token: int | None = None):
        self.children: dict[int, Self] = {}
        self.logprobs: Any = None
        self.past_key_values: Any = None
        self.parent = parent
        self.token = token
        self.depth: int = 0 if parent is None else parent.depth + 1

    def has_token(self, token_id: int) -> bool:
        return token_id in self.children

    def get_token(self, token_id: int) -> Self | None:
        return self.children.get(token_id)

    def add_token(self, token_id: int, logprobs: Any = None) -> Self:
        """Return the child for ``token_id``, creating it if needed; set its logprobs if given."""
        node = self.children.get(token_id)
        if node is None:
            node = self.children[token_id] = self._new_child(token_id)
        if logprobs is not None:
            node.set_logprobs(logprobs)
        return node

    def _new_child(self, token_id: int) -> Self:
        return type(self)(self, token_id)

    def set_logprobs(self, logprobs: Any) -> None:
        self.logprobs = logprobs

    def set_past_key_values(self, past_key_values: Any) -> None:
        self.past_key_values = past_key_values

    def extend_cache(
        self,
        next_token_index: int,
        token_ids: Sequence[int],
        logprobs: Sequence[Any] | None,
        past_key_values: Any = None,
    ) -> Self:
        """Add ``token_ids[next_token_index:]`` below this node and return the deepest node.

        ``logprobs[j]`` (if given) is stored at the node for the prefix ending at
        ``token_ids[next_token_index + j]``; ``past_key_values`` at the deepest node.
        """
        node = self
        for j, token_id in enumerate(token_ids[next_token_index:]):
            node = node.add_token(token_id, None if logprobs is None else logprobs[j])
        if past_key_values is not None:
            node.set_past_key_values(past_key_values)
        return node

    def walk(self, token_ids: Sequence[int]) -> tuple[Self, int]:
        """Follow ``token_ids`` as far as the tree goes: ``(deepest node, tokens consumed)``."""
        node = self
        for i, token_id in enumerate(token_ids):
            child = node.children.get(token_id)
            if child is None:
                return node, i
            node = child
        return node, len(token_ids)

    def path_to_root(self) -> Iterator[Self]:
        """This node, its parent, ..., the root."""
        node: Self | None = self
        while node is not None:
            yield node
            node = node.parent

    def nearest_kv(self) -> Self | None:
        """This node or its nearest ancestor holding KV (the deepest KV on its path), or None."""
        return next(
            (node for node in self.path_to_root() if node.past_key_values is not None), None
        )

    def clear_kv_cache(self) -> None:
        """Drop the KV state of this node and of everything below it."""
        stack = [self]
        while stack:
            node = stack.pop()
            node.set_past_key_values(None)
            stack.extend(node.children.values())

    def __iter__(self) -> Iterator[Self]:
        """All nodes of this subtree (depth-first)."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


class _Budget:
    """LRU bookkeeping of the nodes holding one kind of value, within a size budget.

    Bytes are counted per memory block (see `storages`): a block shared by several
    nodes is charged once and released when the last of them lets go of it;
    ``on_release(value)`` is then called with the value that held it last.
    """

    def __init__(
        self,
        max_bytes: float,
        max_entries: float,
        drop: Callable[[Any], None],
        on_release: Callable[[Any], None] | None = None,
    ):
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.drop = drop
        self.on_release = on_release
        self.entries: OrderedDict[int, tuple[Any, list[Hashable], Any]] = OrderedDict()
        self.blocks: dict[Hashable, list[int]] = {}  # block key -> [references, bytes]
        self.nbytes = 0

    def touch(self, node: Any) -> None:
        if id(node) in self.entries:
            self.entries.move_to_end(id(node))

    def add(self, node: Any, value: Any) -> None:
        self.remove(node)
        keys = []
        for key, nbytes in storages(value):
            block = self.blocks.get(key)
            if block is None:
                block = self.blocks[key] = [0, nbytes]
                self.nbytes += nbytes
            block[0] += 1
            keys.append(key)
        self.entries[id(node)] = (node, keys, value)
        self.evict(0)

    def remove(self, node: Any) -> None:
        entry = self.entries.pop(id(node), None)
        if entry is None:
            return
        released = False
        for key in entry[1]:
            block = self.blocks[key]
            block[0] -= 1
            if block[0] == 0:
                del self.blocks[key]
                self.nbytes -= block[1]
                released = True
        if released and self.on_release is not None:
            self.on_release(entry[2])

    def evict(self, reserve_bytes: int) -> None:
        """Drop least recently used entries until ``reserve_bytes`` more would fit."""
        while self.entries and (
            self.nbytes + reserve_bytes > self.max_bytes or len(self.entries) > self.max_entries
        ):
            oldest = next(iter(self.entries.values()))[0]
            self.drop(oldest)


class DynamicTokenTrie(TokenTrie):
    """A `TokenTrie` with bounded memory: KV states and logprobs are evicted LRU.

    The budgets are shared by the whole tree (kept on the root): ``max_kv_bytes``
    and ``max_kv_entries`` bound the KV states, ``max_logprobs_bytes`` and
    ``max_logprobs_entries`` the cached logprobs (``None``: unbounded). Bytes are
    those of the underlying memory blocks, so views of one batched buffer are
    charged once (see `storages`). Reading a node through `touch` marks it, and
    its ancestors, as recently used, so a prefix is never evicted before the longer
    prefixes built on it. Pinned KV states (``set_past_key_values(kv, pinned=True)``)
    are outside the budget and stay until replaced or cleared. A root made with
    ``share_budgets_with=other_root`` is a separate tree under ``other_root``'s budgets.
    ``on_kv_release(kv)``
    is called when a KV memory block is no longer held by any node (e.g. to recycle
    the buffer).

    Evicting a value detaches the nodes left empty (no value, no children); inside
    `deferred_pruning` that waits until the block ends, so node references taken
    in it stay attached.
    """

    __slots__ = ("root", "kv_budget", "logprobs_budget", "pinned", "_hold", "_to_prune")
    root: DynamicTokenTrie
    kv_budget: _Budget
    logprobs_budget: _Budget
    _hold: int
    _to_prune: list[DynamicTokenTrie]

    def __init__(
        self,
        parent: DynamicTokenTrie | None = None,
        token: int | None = None,
        *,
        max_kv_bytes: float | None = None,
        max_kv_entries: float | None = None,
        max_logprobs_bytes: float | None = None,
        max_logprobs_entries: float | None = None,
        on_kv_release: Callable[[Any], None] | None = None,
        share_budgets_with: DynamicTokenTrie | None = None,
    ):
        super().__init__(parent, token)
        self.pinned = False
        if parent is None and share_budgets_with is not None:
            # Another tree (e.g. one per LoRA adapter) under the same budgets.
            self.root = self
            self.kv_budget = share_budgets_with.kv_budget
            self.logprobs_budget = share_budgets_with.logprobs_budget
            self._hold = 0
            self._to_prune = []
        elif parent is None:
            self.root = self
            inf = float("inf")
            self.kv_budget = _Budget(
                inf if max_kv_bytes is None else max_kv_bytes,
                inf if max_kv_entries is None else max_kv_entries,
                lambda node: node._evict(past_key_values=True),
                on_kv_release,
            )
            self.logprobs_budget = _Budget(
                inf if max_logprobs_bytes is None else max_logprobs_bytes,
                inf if max_logprobs_entries is None else max_logprobs_entries,
                lambda node: node._evict(past_key_values=False),
            )
            self._hold = 0
            self._to_prune = []
        else:
            self.root = parent.root
            self.kv_budget = parent.kv_budget
            self.logprobs_budget = parent.logprobs_budget

    def set_logprobs(self, logprobs: Any) -> None:
        self.logprobs = logprobs
        if logprobs is None:
            self.logprobs_budget.remove(self)
        else:
            self.logprobs_budget.add(self, logprobs)

    def set_past_key_values(self, past_key_values: Any, pinned: bool = False) -> None:
        """Store (or with None, drop) this node's KV state; ``pinned`` keeps it out of the budget."""
        self.past_key_values = past_key_values
        self.pinned = pinned and past_key_values is not None
        if past_key_values is None or self.pinned:
            self.kv_budget.remove(self)
        else:
            self.kv_budget.add(self, past_key_values)

    def make_room(self, kv_bytes: int) -> None:
        """Evict least recently used KV states until ``kv_bytes`` more fit in the budget."""
        self.kv_budget.evict(kv_bytes)

    def _evict(self, past_key_values: bool) -> None:
        if past_key_values:
            self.set_past_key_values(None)
        else:
            self.set_logprobs(None)
        if self.root._hold:
            self.root._to_prune.append(self)
        else:
            self._prune()

    def _prune(self) -> None:
        """Detach empty leaves (no logprobs, no KV, no children) so the tree stays bounded."""
        node = self
        while (
            node.parent is not None
            and node.token is not None
            and not node.children
            and node.logprobs is None
            and node.past_key_values is None
            and node.parent.children.get(node.token) is node
        ):
            del node.parent.children[node.token]
            node = node.parent

    @contextmanager
    def deferred_pruning(self) -> Iterator[DynamicTokenTrie]:
        """Within the block, evictions drop values but detach no node (done on exit)."""
        root = self.root
        root._hold += 1
        try:
            yield root
        finally:
            root._hold -= 1
            if not root._hold:
                pending, root._to_prune = root._to_prune, []
                for node in pending:
                    node._prune()

    def touch(self, ancestors: bool = True) -> None:
        """Mark this node (and by default its ancestors, first) as recently used."""
        nodes = reversed(list(self.path_to_root())) if ancestors else (self,)
        for node in nodes:
            self.kv_budget.touch(node)
            self.logprobs_budget.touch(node)

    @property
    def kv_nbytes(self) -> int:
        """Bytes of (unpinned) KV state currently held by the whole tree."""
        return self.kv_budget.nbytes

    @property
    def logprobs_nbytes(self) -> int:
        """Bytes of logprobs currently held by the whole tree."""
        return self.logprobs_budget.nbytes

    def clear(self) -> None:
        """Drop every value of this subtree (KV, pinned KV, logprobs) and its nodes."""
        for node in self:
            node.set_logprobs(None)
            node.set_past_key_values(None)
        self.children.clear()

    def clear_kv_cache(self) -> None:
        """Drop every KV state of this subtree (pinned ones too) and the nodes left empty."""
        super().clear_kv_cache()
        for node in [node for node in self if not node.children]:
            node._prune()

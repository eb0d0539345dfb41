"""A request: `Query` (a validated prefix and its adapter), `TokenIds` (the prefix) and
`PrefixIndex`, which validates prefixes and remembers them.

A decode step's requests each extend by one id a prefix that the step before validated.
`PrefixIndex` finds that prefix in O(1), by its length and last ids, and compares it
with the request (tuple equality of exact ints), so only the new id's range is checked;
its entry also keeps the prefix-tree nodes made for the prefix, from which the tree is
walked in O(new tokens). Nothing here depends on how the interpreter
hashes or serializes: ``type``, tuple equality, ``hash``, ``min`` and ``max`` only.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import numpy as np

if TYPE_CHECKING:
    from genlm.backend.kv.store import KVNode


class Query(NamedTuple):
    """One next-token request: a validated prefix (a `TokenIds` where it was validated
    here, or a `genlm.backend.llm.handle.PrefixHandle`) and the adapter that serves it."""

    token_ids: Sequence[int]
    lora: str | None = None


NO_NODES: dict[str, KVNode] = {}  # shared by entries without an adapter's node; never written


class PrefixEntry:
    """A validated prefix in a `PrefixIndex`, made from ``prefix`` (a tuple of exact ints)
    and the entry of ``prefix[:-1]`` (``parent``), if any.

    Its ids are ``head + tail``, plain tuples, which the collector walks once and then
    stops tracking (a tuple subclass, `TokenIds`, it would walk at every collection).
    ``head`` is its parent's, shared: a decode step's entry holds only the ids since that
    head, not a copy of the prompt per particle for the collector to walk; once the tail
    would outgrow the head, the whole prefix becomes the head. ``node``: a node on the path
    of its ids in the base model's prefix tree: the node made for them (`PrefixCachedLM`
    remembers it), or until then its parent's; ``adapter_nodes``: the same by adapter,
    its parent's dict until one is remembered (then a copy), so that a decode step's entry
    allocates no dict.
    """

    __slots__ = ("adapter_nodes", "head", "node", "tail")

    def __init__(self, prefix: tuple[int, ...], parent: PrefixEntry | None = None):
        if parent is None or len(prefix) > 2 * len(parent.head):
            self.head: tuple[int, ...] = tuple(prefix)  # plain, whatever ``prefix`` is
            self.tail: tuple[int, ...] = ()
        else:
            self.head, self.tail = parent.head, prefix[len(parent.head) :]
        self.node: KVNode | None = None if parent is None else parent.node
        self.adapter_nodes: dict[str, KVNode] = NO_NODES if parent is None else parent.adapter_nodes

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def holds(self, prefix: tuple[int, ...], end: int) -> bool:
        """Whether its ids are ``prefix[:end]`` (tuple equality)."""
        head, tail = self.head, self.tail
        split = len(head)
        return split + len(tail) == end and prefix[:split] == head and prefix[split:end] == tail


class TokenIds(tuple[int, ...]):
    """A validated prefix: exact ints in the vocabulary, hashed once.

    A request's prefix is a dict key several times a step (the batch's distinct requests);
    a tuple's hash costs O(length) every time, this one once (the same value as
    ``tuple``'s, so the two kinds of key mix in a dict). ``entry``: its `PrefixEntry` in
    the index that validated it (None for a copy, which drops it); no reference to another
    prefix, so nothing keeps a `TokenIds` alive beyond the requests that use it.
    """

    _hash: int
    entry: PrefixEntry | None

    def __new__(cls, ids: Sequence[int]) -> TokenIds:
        self = super().__new__(cls, ids)
        self._hash = tuple.__hash__(self)
        self.entry = None
        return self

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[TokenIds], tuple[tuple[int, ...]]]:
        """What `copy` and `pickle` rebuild it from: its ids (not its entry, which holds
        nodes of this process's tree)."""
        return TokenIds, (tuple(self),)


# Ids at the end of a prefix that index it with its length (`PrefixIndex`).
TAIL_IDS = 8


class PrefixIndex:
    """Validates token-id prefixes and remembers the valid ones, so that a request equal
    to one, or extending one by an id (a decode step's), has only that id's range checked.

    An entry (`PrefixEntry`) is indexed by a hash of its length and last `TAIL_IDS` ids,
    made in O(1) (two prefixes with the same index only replace each other: an entry is
    used only for ids equal to its own). Validity is a pure function of the ids and
    ``vocab_size``, so an entry never goes stale. Two generations of about ``budget``
    tokens each are kept (a hit in the older one moves to the newer). Callers on several
    threads need no lock: an entry's ids never change, so a race only loses an entry.
    """

    def __init__(self, vocab_size: int, budget: int = 1 << 20):
        self.vocab_size = vocab_size
        self.budget = budget
        self._current: dict[int, PrefixEntry] = {}
        self._previous: dict[int, PrefixEntry] = {}
        self._tokens = 0

    def validated(self, ids: list[Any] | tuple[Any, ...]) -> TokenIds:
        """``ids`` (a non-empty list or tuple) as exact ints, each in ``[0, vocab_size)``:
        their types checked in one C pass, then the range of the last id only where the
        ids before it are a validated prefix (or the ids are), else of all (``min``,
        ``max``). ``TypeError``/``ValueError`` naming the first bad id and its position."""
        if operator.countOf(map(type, ids), int) != len(ids):
            ids = self._converted(ids)
        prefix = TokenIds(ids)  # the one copy of the ids a request makes
        key = _index_key(len(prefix), prefix[-TAIL_IDS:])
        entry = self._get(key)
        if entry is not None and entry.holds(prefix, len(prefix)):
            prefix.entry = entry
            return prefix
        parent = self._get(_index_key(len(prefix) - 1, prefix[-TAIL_IDS - 1 : -1]))
        if parent is not None and parent.holds(prefix, len(prefix) - 1):
            valid = 0 <= prefix[-1] < self.vocab_size
        else:
            parent = None
            valid = 0 <= min(prefix) and max(prefix) < self.vocab_size
        if not valid:
            raise_for_bad_id(prefix, self.vocab_size)
        prefix.entry = entry = PrefixEntry(prefix, parent)
        self._add(key, entry)
        return prefix

    def _converted(self, ids: list[Any] | tuple[Any, ...]) -> tuple[int, ...]:
        """Ids not all exact ints: `exact_ints`, else `raise_for_bad_id`."""
        converted = exact_ints(ids)
        if converted is None:
            raise_for_bad_id(ids, self.vocab_size)
        return converted

    def checked(self, ids: list[Any] | tuple[Any, ...]) -> tuple[int, ...]:
        """``ids`` (a non-empty list or tuple) as exact ints in ``[0, vocab_size)``, as
        `validated` checks them, but neither looked up nor remembered (a handle's ids:
        the handle remembers them itself)."""
        if operator.countOf(map(type, ids), int) != len(ids):
            ids = self._converted(ids)
        if not (0 <= min(ids) and max(ids) < self.vocab_size):
            raise_for_bad_id(ids, self.vocab_size)
        return tuple(ids)

    def _get(self, key: int) -> PrefixEntry | None:
        entry = self._current.get(key)
        if entry is None:
            entry = self._previous.get(key)
            if entry is not None:
                self._add(key, entry)
        return entry

    def _add(self, key: int, entry: PrefixEntry) -> None:
        length = len(entry)
        self._tokens += length
        if self._tokens > self.budget:
            self._previous, self._current, self._tokens = self._current, {}, length
        self._current[key] = entry


def _index_key(length: int, tail: tuple[int, ...]) -> int:
    """`PrefixIndex`'s index of a prefix of ``length`` ids ending with ``tail`` (its last
    `TAIL_IDS`)."""
    return hash((length, tail))


def tuple_of_ids(token_ids: Any) -> tuple[Any, ...]:
    """A prefix given as anything but a list or tuple (a tensor, an array, an iterable),
    as a tuple (its ids not yet checked); ``TypeError``/``ValueError`` for what is no
    sequence of ids (a string, a set or mapping, a tensor not 1-D)."""
    import torch

    if isinstance(token_ids, torch.Tensor | np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        return tuple(token_ids.tolist())
    if isinstance(token_ids, str | bytes):
        raise TypeError("token_ids must be a sequence of integer token ids, not a string")
    if isinstance(token_ids, Set | Mapping):
        raise TypeError(
            f"token_ids must be an ordered sequence of token ids, got a "
            f"{type(token_ids).__name__} (its order is arbitrary): pass a list"
        )
    try:
        return tuple(token_ids)
    except TypeError:
        raise TypeError(
            f"token_ids must be a sequence of integer token ids, got {type(token_ids).__name__}"
        ) from None


def exact_ints(ids: Sequence[Any]) -> tuple[int, ...] | None:
    """``ids`` as exact ints where each is an integer (an int subclass, a numpy integer;
    not a bool), else None."""
    if not all(
        issubclass(kind, int | np.integer) and kind is not bool for kind in set(map(type, ids))
    ):
        return None
    return tuple(map(int, ids))


def raise_for_bad_id(
    ids: Sequence[Any], vocab_size: int, start: int = 0, note: str = ""
) -> NoReturn:
    """Raise `checked_id`'s error for the first bad id of ``ids`` (which has one), naming
    its position (counted from ``start``) followed by ``note``."""
    for position, token_id in enumerate(ids, start):
        checked_id(token_id, vocab_size, "token id", f" at position {position}{note}")
    raise AssertionError(f"no bad token id in {ids!r}")


def checked_id(token_id: Any, vocab_size: int, what: str, where: str = "") -> int:
    """``token_id`` as an int in ``[0, vocab_size)``; ``TypeError``/``ValueError`` naming it."""
    if isinstance(token_id, bool) or not isinstance(token_id, int | np.integer):
        raise TypeError(f"{what} {token_id!r}{where} is not an integer ({type(token_id).__name__})")
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"{what} {token_id}{where} is outside the vocabulary [0, {vocab_size})")
    return int(token_id)

"""`PrefixHandle`: a particle's prefix as a value its LM has checked, so that a step sends
only its new ids (SPEC §3, "Prefix handles").

A handle's ids are stored as a persistent chunked sequence: full chunks of `CHUNK` ids,
plain tuples linked from the newest back to the first (``(previous, chunk)`` pairs, which
the collector stops tracking as it does any tuple of untracked items), and a tail of fewer
than `CHUNK` ids. Extending copies the tail and links a chunk as it fills, so a child
shares every full chunk of its parent and costs O(new ids + `CHUNK`), whatever its length.
Its hash is a polynomial hash of its ids carried over from its parent (O(new ids)); two
children of one handle compare equal in O(`CHUNK`), as their chunks are the same objects.

A handle also carries what a backend remembers for its prefix, inherited by its extensions
until the backend remembers its own: ``node`` and ``adapter_nodes``, its nodes in the prefix
trees (as a `genlm.backend.llm.request.PrefixEntry`'s), and ``memo``, a backend's state for
it (the mock's digest, vLLM's session). Nothing refers back to a handle: once no caller
holds it, it is freed, and with it what it remembered.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar, overload

from genlm.backend.llm.request import NO_NODES, exact_ints, raise_for_bad_id, tuple_of_ids

if TYPE_CHECKING:
    from genlm.backend.kv.store import KVNode

# Ids per full chunk: extending copies a tail of fewer ids than this.
CHUNK = 32
# The polynomial hash of a handle's ids: modulo a Mersenne prime, so it never overflows a
# machine word for long in CPython's small-int fast paths.
_MODULUS = (1 << 61) - 1
_BASE = 1_000_003

# A handle's full chunks: None, or the newest chunk and the ones before it.
Spine = tuple[Any, tuple[int, ...]] | None


class HandleLM(Protocol):
    """What a handle needs of the LM that made it: its open state and context length."""

    @property
    def max_context_length(self) -> int | None: ...

    def _check_open(self) -> None: ...


class HandleOwner:
    """The LM a handle belongs to, weakly (a handle does not keep a model alive), with what
    checking new ids needs: its vocabulary size, and its name for errors."""

    __slots__ = ("__weakref__", "_lm", "name", "vocab_size")

    def __init__(self, lm: HandleLM, vocab_size: int):
        self._lm = weakref.ref(lm)
        self.vocab_size = vocab_size
        self.name = f"{type(lm).__name__} object at {id(lm):#x}"

    def lm(self) -> HandleLM:
        """The LM, open: its closed ``RuntimeError`` after ``close()``, or a
        ``RuntimeError`` once it is collected."""
        lm = self._lm()
        if lm is None:
            raise RuntimeError(
                f"the {self.name} that made this handle is gone: make a handle with a live LM"
            )
        lm._check_open()
        return lm


class PrefixHandle(Sequence[int]):
    """A token-id prefix its LM has checked (made by ``lm.handle(token_ids)``), immutable
    like a tuple: `extend` and ``+`` make a new handle in time proportional to the new ids.

    ``len(h)``, ``h[i]``, ``h[a:b]`` (a list) and ``iter(h)`` read its ids (``h[i]`` in
    time proportional to the distance from the end); `ids` is their tuple, `lora_name` its
    adapter (None: the LM's default when a request runs). ``copy.copy`` and
    ``copy.deepcopy`` return the handle itself; it equals a handle of the same LM with the
    same ids and adapter, nothing else; pickling it raises ``TypeError``.

    Attributes:
        node: its node (or its parent's) in the base model's prefix tree, for the
            prefix-cached backends (as `genlm.backend.llm.request.PrefixEntry`'s).
        adapter_nodes: the same by adapter name.
        memo: what its backend remembers for it (the mock's digest, vLLM's session link),
            inherited by its extensions until the backend remembers their own.
    """

    __slots__ = (
        "__weakref__",
        "_hash",
        "_key",
        "_length",
        "_lora",
        "_owner",
        "_spine",
        "_tail",
        "adapter_nodes",
        "memo",
        "node",
    )

    _owner: HandleOwner
    _spine: Spine
    _tail: tuple[int, ...]
    _length: int
    _key: int
    _hash: int
    _lora: str | None
    node: KVNode | None
    adapter_nodes: dict[str, KVNode]
    memo: Any

    def __init__(self) -> None:
        raise TypeError("make a PrefixHandle with lm.handle(token_ids), from the LM it serves")

    # -- reading --------------------------------------------------------------------------

    @property
    def ids(self) -> tuple[int, ...]:
        """Its ids, as a tuple (built in time proportional to its length)."""
        return tuple(itertools.chain.from_iterable(self._chunks()))

    @property
    def lora_name(self) -> str | None:
        """The adapter it is bound to (None: the LM's default adapter, resolved per request)."""
        return self._lora

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step != 1:
                return list(self.ids[index])
            return self._from(start)[: stop - start] if stop > start else []
        position = operator.index(index)
        if position < 0:
            position += self._length
        if not 0 <= position < self._length:
            raise IndexError(f"handle index {index} out of range for {self._length} ids")
        spine, begin = self._spine, self._length - len(self._tail)
        if position >= begin:
            return self._tail[position - begin]
        while True:
            assert spine is not None  # position < begin: a chunk holds it
            spine, chunk = spine
            begin -= CHUNK
            if position >= begin:
                return chunk[position - begin]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._chunks())

    def __reversed__(self) -> Iterator[int]:
        return reversed(self.ids)

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        return self.ids.index(value, start, self._length if stop is None else stop)

    def _chunks(self) -> list[tuple[int, ...]]:
        """Its full chunks and its tail, first to last."""
        parts = [self._tail]
        spine = self._spine
        while spine is not None:
            spine, chunk = spine
            parts.append(chunk)
        parts.reverse()
        return parts

    def _from(self, start: int) -> list[int]:
        """``ids[start:]`` as a list, reading only the chunks it spans."""
        parts = [self._tail]
        spine, begin = self._spine, self._length - len(self._tail)
        while begin > start:
            assert spine is not None  # begin > 0: a chunk is left
            spine, chunk = spine
            parts.append(chunk)
            begin -= CHUNK
        ids = list(itertools.chain.from_iterable(reversed(parts)))
        return ids[start - begin :] if start > begin else ids

    # -- extending ------------------------------------------------------------------------

    def extend(self, new_ids: Sequence[int]) -> PrefixHandle:
        """A new handle for these ids followed by ``new_ids`` (a list or tuple of ids),
        checked as a request's (``TypeError``/``ValueError`` naming a bad id, its position
        and this handle's length; ``ValueError`` past the model's context length; the LM's
        closed ``RuntimeError`` after ``close()``), in time proportional to ``new_ids``."""
        lm = self._owner.lm()
        if type(new_ids) is not list and type(new_ids) is not tuple:
            if isinstance(new_ids, PrefixHandle):
                raise TypeError(
                    "extend takes new token ids (a list or tuple), not a PrefixHandle: "
                    "extend a handle by list(other.ids) to append another's ids"
                )
            new_ids = tuple_of_ids(new_ids)
        if not new_ids:
            return self
        ids = self._checked(new_ids)
        limit = lm.max_context_length
        if limit is not None and self._length + len(ids) > limit:
            raise ValueError(
                f"extending a handle of {self._length} tokens by {len(ids)} gives "
                f"{self._length + len(ids)} tokens, more than the model's context length "
                f"of {limit} tokens"
            )
        return _extended(self, ids, self._lora)

    def __add__(self, new_ids: Sequence[int]) -> PrefixHandle:
        """``h + new_ids``: `extend`."""
        return self.extend(new_ids)

    def _checked(self, new_ids: list[Any] | tuple[Any, ...]) -> tuple[int, ...]:
        """``new_ids`` as a tuple of exact ints in the vocabulary, else the error of the
        first bad one, naming its position in the extended handle and this one's length."""
        vocab_size = self._owner.vocab_size
        ids = new_ids if operator.countOf(map(type, new_ids), int) == len(new_ids) else None
        if ids is None:
            ids = exact_ints(new_ids)
        if ids is None or not (0 <= min(ids) and max(ids) < vocab_size):
            raise_for_bad_id(
                new_ids,
                vocab_size,
                start=self._length,
                note=f" (extending a handle of {self._length} ids)",
            )
        return tuple(ids)

    # -- a value --------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        """A handle of the same LM with the same ids and adapter (chunks shared with it
        are not compared again); False for anything else, a tuple or list included."""
        if self is other:
            return True
        if not isinstance(other, PrefixHandle):
            return False
        if (
            self._hash != other._hash
            or self._length != other._length
            or self._key != other._key
            or self._owner is not other._owner
            or self._lora != other._lora
            or self._tail != other._tail
        ):
            return False
        mine, theirs = self._spine, other._spine
        while mine is not theirs:
            assert mine is not None and theirs is not None  # of one length
            if mine[1] != theirs[1]:
                return False
            mine, theirs = mine[0], theirs[0]
        return True

    def __hash__(self) -> int:
        return self._hash

    def __copy__(self) -> PrefixHandle:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> PrefixHandle:
        return self

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(
            "a PrefixHandle cannot be pickled: it belongs to the LM that made it. Pickle "
            "its h.ids (a tuple of token ids) and make a handle of them with "
            "lm.handle(ids) where they are loaded"
        )

    def __repr__(self) -> str:
        """One line, in constant time: its length, last ids and adapter."""
        last = ", ".join(map(str, self._tail[-4:] if self._tail else self[-1:]))
        more = "..., " if self._length > 4 or len(self._tail) < min(4, self._length) else ""
        return f"PrefixHandle(<{self._length} ids: {more}{last}>, lora_name={self._lora!r})"


def _extended(parent: PrefixHandle, ids: tuple[int, ...], lora: str | None) -> PrefixHandle:
    """``parent`` followed by ``ids`` (exact ints, checked), bound to ``lora``: its full
    chunks shared, its hash carried on, what it remembered inherited."""
    key = parent._key
    for token_id in ids:
        key = (key * _BASE + token_id + 1) % _MODULUS
    spine, tail = parent._spine, parent._tail + ids
    while len(tail) >= CHUNK:
        spine, tail = (spine, tail[:CHUNK]), tail[CHUNK:]
    return _made(
        parent._owner,
        spine,
        tail,
        parent._length + len(ids),
        key,
        lora,
        parent.node,
        parent.adapter_nodes,
        parent.memo,
    )


def new_handle(owner: HandleOwner, ids: Sequence[int], lora: str | None) -> PrefixHandle:
    """A handle of ``ids`` (exact ints in the vocabulary, checked by the caller), bound to
    ``lora``, remembering nothing yet."""
    root = _made(owner, None, (), 0, 0, lora, None, NO_NODES, None)
    return _extended(root, tuple(ids), lora)


def rebound(handle: PrefixHandle, lora: str | None) -> PrefixHandle:
    """``handle``'s ids bound to ``lora`` (the same handle if it is bound to it), sharing
    its storage: what `sample` continues a handle bound to the default adapter with."""
    if handle._lora == lora:
        return handle
    return _made(
        handle._owner,
        handle._spine,
        handle._tail,
        handle._length,
        handle._key,
        lora,
        handle.node,
        handle.adapter_nodes,
        handle.memo,
    )


def _made(
    owner: HandleOwner,
    spine: Spine,
    tail: tuple[int, ...],
    length: int,
    key: int,
    lora: str | None,
    node: KVNode | None,
    adapter_nodes: dict[str, KVNode],
    memo: Any,
) -> PrefixHandle:
    handle = object.__new__(PrefixHandle)
    handle._owner = owner
    handle._spine = spine
    handle._tail = tail
    handle._length = length
    handle._key = key
    handle._hash = hash((key, length, lora))
    handle._lora = lora
    handle.node = node
    handle.adapter_nodes = adapter_nodes
    handle.memo = memo
    return handle


def plain_ids(ids: Sequence[int]) -> Sequence[int]:
    """A handle's ids as a tuple (for what reads them all), other ids as they are."""
    return ids.ids if type(ids) is PrefixHandle else ids


# -- methods of user subclasses that take token ids but not handles --------------------------

F = TypeVar("F", bound=Callable[..., Any])


def takes_handles(method: F) -> F:
    """Mark a method that takes `PrefixHandle` s where it takes token ids: `AsyncLM`
    leaves it as it is in a subclass (`lists_for_handles` wraps the others)."""
    method.__takes_handles__ = True  # type: ignore[attr-defined]
    return method


def handles_taken(method: Any) -> bool:
    """Whether ``method`` was marked with `takes_handles`."""
    return getattr(method, "__takes_handles__", False)

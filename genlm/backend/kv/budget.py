"""What the store's logprobs budget counts: the memory cached values occupy, shared memory
counted once (`SharedMemory`).

Next-token log-probabilities cached at the nodes are usually rows of one batch, views of
its memory (`memory_key`): the batch's bytes count once while any of its rows is cached.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


def memory_key(value: Any) -> Hashable:
    """What names the memory a cached value occupies: a torch tensor's storage (the rows
    of one batch, views of it, share it), else the value itself."""
    storage = getattr(value, "untyped_storage", None)
    return id(value) if storage is None else ("storage", storage().data_ptr())


def memory_nbytes(value: Any) -> int:
    """Bytes of the memory a cached value occupies (`memory_key`): a torch tensor's whole
    storage, else ``value.nbytes``."""
    storage = getattr(value, "untyped_storage", None)
    return int(value.nbytes) if storage is None else storage().nbytes()


class SharedMemory:
    """The bytes of the memory the values charged to it occupy, each memory counted once
    for all the values that share it (``nbytes_of``: a value's memory's bytes)."""

    def __init__(self, nbytes_of: Callable[[Any], int] = memory_nbytes):
        self.nbytes_of = nbytes_of
        self.nbytes = 0
        self._values: dict[Hashable, int] = {}  # values charged, per memory (`memory_key`)

    def charge(self, value: Any) -> None:
        key = memory_key(value)
        held = self._values.get(key, 0)
        if not held:
            self.nbytes += self.nbytes_of(value)
        self._values[key] = held + 1

    def uncharge(self, value: Any) -> None:
        key = memory_key(value)
        held = self._values.pop(key) - 1
        if held:
            self._values[key] = held
        else:
            self.nbytes -= self.nbytes_of(value)

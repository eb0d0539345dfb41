"""Caches: an LRU map of outputs, and the name of the prefix-KV tree's node type.

- `OutputCache`: LRU map from token-id tuples to tensors (e.g. logprobs).
- `TokenTrie`: the node type of the prefix tree behind the prefix-KV caches (the
  ``cache`` root of `AsyncTransformer` and `AsyncMlxLM`), `genlm.backend.kv.store.KVNode`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from genlm.backend.checks import check_int
from genlm.backend.kv.store import KVNode as TokenTrie

__all__ = ["OutputCache", "TokenTrie"]


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

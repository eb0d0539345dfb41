"""`BlockPool`: the memory a `PrefixKVStore` hands out blocks of, and what pools share.

A pool holds, for every layer, the keys and values of ``capacity * block_size`` token
slots; token ``j`` of a chain lives in slot ``chain[j // block_size] * block_size +
j % block_size``. The store decides the capacity (`resize`) and which blocks a prefix
uses; a backend's forward reads and writes slots (`slots`), applies the store's
copy-on-write copies (`copy`) and gathers a chain's KV for `walk_cache` (`read`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from genlm.backend.checks import check_int

# Tokens per block, for every backend.
BLOCK_SIZE = 16

# The ids of the blocks holding a prefix's KV: token ``j`` in block ``chain[j // block_size]``.
Chain = tuple[int, ...]


@dataclass(frozen=True)
class BlockCopy:
    """Copy the first ``tokens`` token slots of block ``source`` into block ``target``."""

    source: int
    target: int
    tokens: int


class BlockPool(Protocol):
    """What `PrefixKVStore` and a backend's forward need of the KV memory."""

    block_size: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: every layer's keys and values of ``block_size`` tokens."""

    def resize(self, blocks: int) -> None:
        """Hold ``blocks`` blocks (the first call allocates), keeping the contents of the
        blocks both sizes have; block 0 stays all zeros."""

    def free(self) -> None:
        """Let go of every block's memory: the pool holds nothing until the next `resize`,
        which allocates afresh (block 0 zeroed)."""

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        """Apply copy-on-write copies (no target is another's source)."""

    def slots(self, chain: Chain, tokens: int) -> Any:
        """Pool positions of a chain's first ``tokens`` tokens."""

    def read(self, chain: Chain, tokens: int) -> Any:
        """A copy of a chain's first ``tokens`` tokens' KV (the pool's own layout)."""


@dataclass(frozen=True)
class KVLayout:
    """Shape of a model's KV state, the same for every layer (``device``: None on MLX)."""

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: Any
    itemsize: int
    device: Any = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "itemsize"):
            check_int(f"KVLayout.{name}", getattr(self, name), minimum=1)

    def block_bytes(self, block_size: int) -> int:
        return self.num_layers * 2 * self.num_heads * self.head_dim * block_size * self.itemsize


def uniform_layout(layers: Sequence[tuple[Any, Any]]) -> tuple[KVLayout | None, str]:
    """The layout of a probe's per-layer ``(keys, values)`` arrays (torch or MLX,
    ``[batch, heads, tokens, head_dim]``), or None and why the store cannot hold them."""
    kinds = {
        (array.shape[1], array.shape[3], array.dtype, getattr(array, "device", None))
        for layer in layers
        for array in layer
    }
    if len(kinds) != 1:
        return None, "its layers' KV shapes differ"
    heads, dim, dtype, device = kinds.pop()
    return KVLayout(len(layers), heads, dim, dtype, layers[0][0].itemsize, device), ""


class NoKVPool:
    """The pool of a model whose KV cannot be reused: no memory, every request runs its
    whole prefix (the store keeps only logprobs)."""

    block_size = BLOCK_SIZE
    block_bytes = 1

    def __init__(self, reason: str):
        warnings.warn(
            f"KV reuse is off for this model ({reason}): every request runs its whole prefix",
            stacklevel=3,
        )

    def resize(self, blocks: int) -> None:
        """Nothing to hold."""

    def free(self) -> None:
        """Nothing held."""

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        raise NotImplementedError("KV reuse is off for this model")

    def slots(self, chain: Chain, tokens: int) -> Any:
        raise NotImplementedError("KV reuse is off for this model")

    def read(self, chain: Chain, tokens: int) -> Any:
        raise NotImplementedError("KV reuse is off for this model")

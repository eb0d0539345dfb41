"""`MlxBlockPool`: the KV blocks of an mlx-lm model (the MLX backend's pool)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from genlm.backend.checks import check_int
from genlm.backend.kv.pool import BLOCK_SIZE, BlockCopy, Chain, KVLayout


class MlxBlockPool:
    """The KV blocks of every layer: ``keys[layer][block * block_size + offset, head, dim]``
    (``values`` alike), ``mx.array``s evaluated where they change."""

    def __init__(self, layout: KVLayout, block_size: int = BLOCK_SIZE):
        check_int("block_size", block_size, minimum=1)
        self.layout = layout
        self.block_size = block_size
        self.keys: list[Any] = []
        self.values: list[Any] = []

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes(self.block_size)

    def resize(self, blocks: int) -> None:
        """Hold ``blocks`` blocks (more or fewer), keeping the first ones' contents (block 0
        stays zero)."""
        import mlx.core as mx

        layout = self.layout
        slots = blocks * self.block_size

        def resized(old: Any) -> Any:
            new = mx.zeros((slots, layout.num_heads, layout.head_dim), dtype=layout.dtype)
            kept = min(slots, old.shape[0]) if old is not None else 0
            if kept:
                new[:kept] = old[:kept]
            return new

        if not self.keys:
            self.keys, self.values = [None] * layout.num_layers, [None] * layout.num_layers
        for pool in (self.keys, self.values):  # one array at a time: old and new never all live
            for layer, old in enumerate(pool):
                pool[layer] = resized(old)
                mx.eval(pool[layer])
                del old

    def free(self) -> None:
        """Drop every layer's keys and values; the next `resize` allocates afresh."""
        self.keys, self.values = [], []

    def slots(self, chain: Chain, tokens: int) -> np.ndarray:
        """Pool positions of a chain's first ``tokens`` tokens."""
        blocks = np.asarray(chain, dtype=np.int32)[:, None] * self.block_size
        return (blocks + np.arange(self.block_size, dtype=np.int32)).reshape(-1)[:tokens]

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        """Apply the store's copy-on-write copies. The copied slots are read (and evaluated)
        first, so the write can reuse each pool's buffer instead of copying the whole pool."""
        if not copies:
            return
        import mlx.core as mx

        size = self.block_size
        source = mx.array(np.concatenate([np.arange(c.tokens) + c.source * size for c in copies]))
        target = mx.array(np.concatenate([np.arange(c.tokens) + c.target * size for c in copies]))
        for pool in (self.keys, self.values):
            copied = [layer[source] for layer in pool]
            mx.eval(copied)
            for layer, rows in zip(pool, copied, strict=True):
                layer[target] = rows

    def read(self, chain: Chain, tokens: int) -> list[tuple[Any, Any]]:
        """Per layer, a copy of a chain's first ``tokens`` keys and values
        (``[1, kv_heads, tokens, head_dim]`` each), evaluated."""
        import mlx.core as mx

        slots = mx.array(self.slots(chain, tokens))
        past = [
            (keys[slots].transpose(1, 0, 2)[None], values[slots].transpose(1, 0, 2)[None])
            for keys, values in zip(self.keys, self.values, strict=True)
        ]
        mx.eval(past)
        return past

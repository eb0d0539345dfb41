"""`TorchBlockPool`: the KV blocks of a torch model (the HF backend's pool)."""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import numpy as np
import torch

from genlm.backend.checks import check_int
from genlm.backend.kv.pool import BLOCK_SIZE, BlockCopy, Chain, KVLayout


class TorchBlockPool:
    """The KV blocks of every layer: ``layers[layer][0 / 1, block * block_size + offset, head, dim]``.

    One tensor per layer, so that a resize holds only one layer twice while it copies. A
    store that sizes the pool once (CUDA graphs hold the layers' addresses) resizes it only
    to allocate it. On CUDA the layers a resize or `free` replaces go back to the device
    (the caching allocator would keep them reserved), so the pool holds on the device only
    what it holds.
    """

    def __init__(self, layout: KVLayout, block_size: int = BLOCK_SIZE):
        check_int("block_size", block_size, minimum=1)
        self.layout = layout
        self.block_size = block_size
        self.layers: list[torch.Tensor] = []

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes(self.block_size)

    def resize(self, blocks: int) -> None:
        """Hold ``blocks`` blocks, keeping the contents of the blocks both sizes have (block 0
        stays zero), one layer at a time."""
        layout = self.layout
        slots = blocks * self.block_size
        shape = (2, slots, layout.num_heads, layout.head_dim)
        if not self.layers:
            self.layers = [self._empty(shape) for _ in range(layout.num_layers)]
            for layer in self.layers:
                layer[:, : self.block_size].zero_()
            return
        for index, old in enumerate(self.layers):
            kept = min(slots, old.shape[1])
            layer = self._empty(shape)
            layer[:, :kept].copy_(old[:, :kept])
            self.layers[index] = layer
            del old, layer  # the old layer goes before the next one is allocated
        self._release_replaced()

    def free(self) -> None:
        """Drop every layer (on CPU its memory map goes back to the system once no tensor
        uses it); the next `resize` allocates afresh."""
        self.layers = []
        self._release_replaced()

    def _release_replaced(self) -> None:
        """On CUDA, hand the dropped layers' memory back to the device: a resize is rare (the
        pool grows geometrically, trims between batches), so its sync costs little."""
        if self.layout.device.type == "cuda":
            torch.cuda.empty_cache()

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialized layer. On CPU, an anonymous memory map of its own: its pages cost
        memory once written and go back to the system when it is freed (the C allocator
        would keep freed layers and, by raising its mmap threshold, later tensors too)."""
        layout = self.layout
        if layout.device.type != "cpu":
            return torch.empty(shape, dtype=layout.dtype, device=layout.device)
        buffer = mmap.mmap(-1, math.prod(shape) * layout.itemsize)
        return torch.frombuffer(buffer, dtype=layout.dtype).view(shape)

    def slots(self, chain: Chain, tokens: int) -> torch.Tensor:
        """Pool positions of a chain's first ``tokens`` tokens."""
        blocks = torch.tensor(chain, device=self.layout.device)
        offsets = torch.arange(self.block_size, device=self.layout.device)
        return (blocks[:, None] * self.block_size + offsets).flatten()[:tokens]

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        """Apply `BlockCopy`s (no target is another's source): the token slots built on the
        host with numpy, moved to the device in one copy, then one gather and one indexed
        write per layer, however many blocks are copied."""
        if not copies:
            return
        size = self.block_size
        fields = np.array([(c.source, c.target, c.tokens) for c in copies], np.int64)
        tokens = fields[:, 2]
        # token j of copy i: offset j, found as position - the copy's first position
        offsets = np.arange(tokens.sum()) - np.repeat(np.cumsum(tokens) - tokens, tokens)
        pairs = np.repeat(fields[:, :2] * size, tokens, axis=0) + offsets[:, None]
        device = self.layout.device
        source, target = torch.from_numpy(pairs.T.copy()).to(device, non_blocking=True)
        for layer in self.layers:
            layer.index_copy_(1, target, layer.index_select(1, source))

    def read(self, chain: Chain, tokens: int) -> torch.Tensor:
        """``[layers, 2, heads, tokens, head_dim]``: a copy of a chain's first ``tokens``."""
        slots = self.slots(chain, tokens)
        return torch.stack([layer[:, slots] for layer in self.layers]).permute(0, 1, 3, 2, 4)

"""`ResultBlocks`: float32 result blocks that callers lease, reused once every lease ends.

A fresh block of tens of megabytes is served by new zero-filled pages, which can cost as
much as computing it, and on CUDA a device-to-host copy into pageable memory is several
times slower than into pinned (page-locked) memory, whose allocation is slower still. So
the tries write their batched results into blocks kept here and hand callers a leased view.

A lease is an object that exports the block's memory (``__array_interface__``); the array
a caller gets is made from it, so that array and every view derived from it (a row, a
slice, a transpose: numpy keeps the chain of bases to the exporting object) hold the
lease. When the last of them is gone the lease is collected and its block is free again
(`weakref.finalize`): a caller's result is never overwritten while any part of it is
reachable, and no reference count is read.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np


class _Lease:
    """Exports ``block`` to numpy; alive while any array made from it is."""

    def __init__(self, block: np.ndarray):
        self.block = block
        self.__array_interface__ = block.__array_interface__


class ResultBlocks:
    """float32 ``[rows, cols]`` blocks leased to callers, reused once their lease ends.

    Args:
        pinned: allocate page-locked host memory (for copies from a CUDA device).
        max_bytes: most bytes of free blocks kept for reuse, the oldest dropped first; the
            latest released block is kept whatever its size, so a loop of calls larger than
            this still reuses one (leased blocks are the callers' and never count).
        min_bytes: smaller pageable results are plain new arrays: malloc serves them from
            memory it holds (no fresh pages), in less time than a lease takes.
    """

    def __init__(self, pinned: bool = False, max_bytes: int = 256 << 20, min_bytes: int = 1 << 17):
        self.pinned = pinned
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self.free: list[np.ndarray] = []
        self.allocated = 0  # blocks ever allocated, for tests and monitoring
        self._lock = threading.Lock()

    def take(self, rows: int, cols: int) -> np.ndarray:
        """A writable ``[rows, cols]`` float32 array leased to the caller: its memory is
        not handed out again while it (or any view of it) is alive."""
        if not self.pinned and rows * cols * 4 < self.min_bytes:
            return np.empty((rows, cols), np.float32)
        with self._lock:
            fits = [i for i, b in enumerate(self.free) if b.shape[0] >= rows and b.shape[1] == cols]
            block = self.free.pop(fits[0]) if fits else self._allocate(rows, cols)
        lease = _Lease(block[:rows])
        weakref.finalize(lease, self._release, block).atexit = False
        return np.asarray(lease)

    def _allocate(self, rows: int, cols: int) -> np.ndarray:
        self.allocated += 1
        if not self.pinned:
            return np.empty((rows, cols), np.float32)
        import torch

        # The numpy view keeps the pinned tensor (its base) alive.
        return torch.empty((rows, cols), dtype=torch.float32, pin_memory=True).numpy()

    def _release(self, block: np.ndarray) -> None:
        with self._lock:
            self.free.append(block)
            while len(self.free) > 1 and sum(b.nbytes for b in self.free) > self.max_bytes:
                self.free.pop(0)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled empty (so a trie still pickles): blocks and the lock are this process's."""
        return ResultBlocks, (self.pinned, self.max_bytes, self.min_bytes)

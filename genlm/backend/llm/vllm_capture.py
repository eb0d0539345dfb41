"""The engine-side half of `AsyncVirtualLM`'s logits capture: a vLLM logits processor.

vLLM loads `FullLogitsCapture` by name (`genlm.backend.llm.vllm.CAPTURE_PROCESSOR`) inside
whichever process samples (the engine core, or each tensor-parallel worker), so this module
imports vllm at the top and nothing in `genlm.backend` imports it otherwise.

A request opts in through its ``SamplingParams.extra_args[CAPTURE_KEY] = (path, row,
width)``: at every step the processor writes that request's full row of float32 logits
into row ``row`` of the shared file ``path`` (``width`` floats per row). The caller
reuses its files step after step; each is memory-mapped once (`RowFiles`), so writing a
row opens nothing. Rows are found through vLLM's public `BatchUpdate` bookkeeping
(added, removed, moved requests), so reordering of the persistent batch never mixes
requests up; a chunked prefill writes the row more than once and the last write, the
one at the end of the prompt, is the one the caller reads.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

from genlm.backend.llm.vllm import CAPTURE_KEY

logger = logging.getLogger(__name__)

Target = tuple[str, int, int]  # (file path, row, width)


def capture_target(params: SamplingParams) -> Target | None:
    """The ``(path, row, width)`` a request asks its logits to be written to, if any."""
    extra = params.extra_args or {}
    target = extra.get(CAPTURE_KEY)
    if target is None:
        return None
    path, row, width = target
    return str(path), int(row), int(width)


def apply_batch_update(
    targets: dict[int, Any], batch_update: BatchUpdate | None, new_target
) -> None:
    """Keep ``targets`` (persistent-batch index -> target) in step with vLLM's batch.

    Applies the update in vLLM's documented order: removed, added, moved.
    ``new_target(params)`` gives the target of an added request, or None.
    """
    if batch_update is None:
        return
    for index in batch_update.removed:
        targets.pop(index, None)
    for index, params, _prompt_ids, _output_ids in batch_update.added:
        target = new_target(params)
        if target is None:
            targets.pop(index, None)
        else:
            targets[index] = target
    for a, b, direction in batch_update.moved:
        a_target = targets.pop(a, None)
        b_target = targets.pop(b, None)
        if a_target is not None:
            targets[b] = a_target
        if direction == MoveDirectionality.SWAP and b_target is not None:
            targets[a] = b_target


class RowFiles:
    """Memory maps of the capture files that requests write to.

    The caller reuses its files step after step, while between steps no request names
    them (a session waiting for its next chunk leaves vLLM's batch): so the `KEEP_UNUSED`
    most recently used maps stay when no request names them, and a map whose path now
    names another file (the caller removed it and made a new one) is dropped.
    """

    KEEP_UNUSED = 4

    def __init__(self):
        # path -> (mapping, [rows, width] view, file identity); least recently used first
        self.maps: dict[str, tuple[mmap.mmap, np.ndarray, tuple[int, int]]] = {}

    def rows(self, path: str, width: int) -> np.ndarray:
        """The float32 ``[rows, width]`` view of ``path``, mapped on first use."""
        entry = self.maps.get(path)
        if entry is None or entry[1].shape[1] != width:
            self._unmap(path)
            fd = os.open(path, os.O_RDWR)
            try:
                stat = os.fstat(fd)
                mapping = mmap.mmap(fd, stat.st_size)
            finally:
                os.close(fd)
            view = np.frombuffer(mapping, dtype=np.float32).reshape(-1, width)
            entry = self.maps[path] = (mapping, view, (stat.st_dev, stat.st_ino))
        return entry[1]

    def check(self, paths: set[str]) -> None:
        """Drop the maps of ``paths`` (just named by new requests) that are no longer the
        file at that path."""
        for path in paths:
            entry = self.maps.get(path)
            if entry is not None:
                try:
                    stat = os.stat(path)
                except OSError:
                    self._unmap(path)
                    continue
                if (stat.st_dev, stat.st_ino) != entry[2]:
                    self._unmap(path)

    def keep_only(self, paths: set[str]) -> None:
        """Keep the maps of ``paths`` (the files current requests name, now the most
        recently used) and the `KEEP_UNUSED` most recently used others; unmap the rest."""
        for path in paths:
            if path in self.maps:
                self.maps[path] = self.maps.pop(path)
        unused = [p for p in self.maps if p not in paths]
        for path in unused[: max(len(unused) - self.KEEP_UNUSED, 0)]:
            self._unmap(path)

    def _unmap(self, path: str) -> None:
        entry = self.maps.pop(path, None)
        if entry is None:
            return
        mapping, view, _ = entry
        del view, entry
        try:
            mapping.close()
        except BufferError:  # a view still alive elsewhere: unmapped at collection
            pass


def write_row(files: RowFiles, target: Target, logits_row: torch.Tensor) -> None:
    """Write one row of logits (padded with -inf, or cut, to ``width``) into its file."""
    path, row, width = target
    rows = files.rows(path, width)
    n = min(width, logits_row.shape[0])
    rows[row, :n] = logits_row[:n].numpy()
    rows[row, n:] = -np.inf


class FullLogitsCapture(LogitsProcessor):
    """Copies the logits of opted-in requests to their callers; leaves the logits unchanged."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        self.targets: dict[int, Target] = {}
        self.files = RowFiles()
        self._warned = False

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = sampling_params.extra_args or {}
        target = extra.get(CAPTURE_KEY)
        if target is not None and (not isinstance(target, list | tuple) or len(target) != 3):
            raise ValueError(
                f"extra_args[{CAPTURE_KEY!r}] must be (path, row, width), got {target!r}"
            )

    def is_argmax_invariant(self) -> bool:
        # False makes vLLM call `apply` for greedy requests too (it skips argmax-invariant
        # processors when every request is greedy).
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        apply_batch_update(self.targets, batch_update, capture_target)
        if batch_update is not None:
            added = (capture_target(params) for _, params, _, _ in batch_update.added)
            self.files.check({target[0] for target in added if target is not None})
            self.files.keep_only({target[0] for target in self.targets.values()})

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.targets:
            return logits
        indices = [i for i in sorted(self.targets) if i < logits.shape[0]]
        rows = logits[indices].to(device="cpu", dtype=torch.float32)
        for i, index in enumerate(indices):
            try:
                write_row(self.files, self.targets[index], rows[i])
            except (OSError, ValueError) as error:
                # The caller finds the row unwritten and raises; the engine keeps serving.
                if not self._warned:
                    logger.warning(
                        "genlm logits capture cannot write %s: %s", self.targets[index][0], error
                    )
                    self._warned = True
        return logits

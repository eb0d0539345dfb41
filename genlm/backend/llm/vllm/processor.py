"""The engine's half of the capture: `FullLogitsCapture`, the logits processor that vLLM
loads by name (`CAPTURE_PROCESSOR`) in the process that samples, and what it writes with.

A request asks for its logits with ``SamplingParams.extra_args[CAPTURE_KEY] = (path, row,
width)`` (`capture_target`); at every step the processor writes the request's float32
logits into row ``row`` of the shared file ``path`` (`write_row`), each file mapped once
(`MappedFiles`). A chunked prefill writes the row more than once and the last write, at
the end of the prompt, is the one the caller reads.

One class serves both of vLLM's model runners, which load processors by different base
classes and drive them differently:

- the V1 runner (``vllm.v1.sample.logits_processor.LogitsProcessor``; vLLM's CPU build):
  ``update_state(BatchUpdate)`` says which persistent-batch index holds which request
  (added, removed, moved: `apply_batch_update`), and ``apply(logits)`` gets row ``i`` for
  index ``i``;
- Model Runner V2 (``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``; the
  default of the CUDA builds): ``add_request(slot, params)`` for each request entering a
  slot, again for each streaming-input chunk (every step of a session) and for a request
  that takes over a freed slot, and ``apply(logits, ctx)`` where row ``i`` belongs to slot
  ``ctx.idx_mapping_np[i]`` (`rows_to_write`).

vLLM's processes import this module, and so does the caller's half (`capture`) for
`CAPTURE_KEY`, without vllm: it imports the standard library, numpy and torch, nothing
of the client, and vllm only when `FullLogitsCapture` is first looked up.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

logger = logging.getLogger(__name__)

# The engine-side logits processor, named so that vLLM loads it in its own processes.
CAPTURE_PROCESSOR = f"{__name__}:FullLogitsCapture"
# ``SamplingParams.extra_args`` key through which a request asks for its logits.
CAPTURE_KEY = "genlm_capture"

Target = tuple[str, int, int]  # (file path, row, width)


def capture_target(params: SamplingParams) -> Target | None:
    """The ``(path, row, width)`` a request asks its logits to be written to, if any."""
    target = (params.extra_args or {}).get(CAPTURE_KEY)
    if target is None:
        return None
    path, row, width = target
    return str(path), int(row), int(width)


def apply_batch_update(targets: dict[int, Target], batch_update: BatchUpdate | None) -> None:
    """Keep ``targets`` (persistent-batch index -> target) in step with the V1 runner's
    batch, in vLLM's documented order: removed, added (`capture_target`), moved."""
    from vllm.v1.sample.logits_processor import MoveDirectionality

    if batch_update is None:
        return
    for index in batch_update.removed:
        targets.pop(index, None)
    for index, params, _prompt_ids, _output_ids in batch_update.added:
        targets.pop(index, None)
        if (target := capture_target(params)) is not None:
            targets[index] = target
    for a, b, direction in batch_update.moved:
        a_target, b_target = targets.pop(a, None), targets.pop(b, None)
        if a_target is not None:
            targets[b] = a_target
        if direction == MoveDirectionality.SWAP and b_target is not None:
            targets[a] = b_target


def rows_to_write(
    targets: dict[int, Target], num_rows: int, ctx: LogitsContext | None
) -> tuple[list[int], list[Target]]:
    """The rows of a ``num_rows``-row logits batch that requests asked for, in order, and
    their targets. ``targets`` is keyed by persistent-batch index under the V1 runner
    (``ctx`` None: row ``i`` is index ``i``) and by request slot under V2 (row ``i`` is slot
    ``ctx.idx_mapping_np[i]``). Under V2 with speculative decoding a request has a row per
    draft token; its first (``ctx.expanded_local_pos`` 0) is the next token's distribution
    after the committed context, read through one copy of the row-to-slot map."""
    if ctx is None:
        rows = [i for i in sorted(targets) if i < num_rows]
        return rows, [targets[i] for i in rows]
    slots = ctx.idx_mapping_np
    if num_rows == len(slots):
        pairs = [(i, slot) for i, slot in enumerate(slots.tolist()) if slot in targets]
    else:
        first = (ctx.expanded_local_pos == 0).cpu().numpy()
        row_slots = ctx.expanded_idx_mapping.cpu().numpy()
        pairs = [
            (int(i), slot) for i in np.flatnonzero(first) if (slot := int(row_slots[i])) in targets
        ]
    return [i for i, _ in pairs], [targets[slot] for _, slot in pairs]


class MappedFiles:
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
        for path in paths & self.maps.keys():
            try:
                stat = os.stat(path)
                current = (stat.st_dev, stat.st_ino) == self.maps[path][2]
            except OSError:
                current = False
            if not current:
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


def write_row(files: MappedFiles, target: Target, logits_row: torch.Tensor) -> None:
    """Write one row of logits (padded with -inf, or cut, to ``width``) into its file."""
    path, row, width = target
    rows = files.rows(path, width)
    n = min(width, logits_row.shape[0])
    rows[row, :n] = logits_row[:n].numpy()
    rows[row, n:] = -np.inf


def __getattr__(name: str) -> Any:
    """`FullLogitsCapture`, defined on first lookup (see the module doc)."""
    if name == "FullLogitsCapture":
        return processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def processor_class() -> type:
    """`FullLogitsCapture`: a subclass of both runners' ``LogitsProcessor`` base classes,
    so that either loader accepts it (see the module doc)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as LogitsProcessorV2

    class FullLogitsCapture(LogitsProcessor, LogitsProcessorV2):
        """Copies the logits of opted-in requests to their callers; leaves the logits unchanged."""

        __qualname__ = "FullLogitsCapture"  # the name vLLM loads it by (and pickle finds it by)

        def __init__(self, vllm_config: Any, *runner_state: Any):
            # V1: (vllm_config, device, is_pin_memory); V2: (vllm_config, req_states).
            self.targets: dict[int, Target] = {}  # by batch index (V1) or slot (V2)
            self.files = MappedFiles()
            self._named: set[str] = set()  # files V2 requests named since the last step
            self._warned = False

        @classmethod
        def validate_params(cls, sampling_params: SamplingParams) -> None:
            target = (sampling_params.extra_args or {}).get(CAPTURE_KEY)
            if target is not None and (not isinstance(target, list | tuple) or len(target) != 3):
                raise ValueError(
                    f"extra_args[{CAPTURE_KEY!r}] must be (path, row, width), got {target!r}"
                )

        # The V1 runner's hooks.

        def is_argmax_invariant(self) -> bool:
            # False makes vLLM call `apply` for greedy requests too (it skips argmax-invariant
            # processors when every request is greedy).
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            apply_batch_update(self.targets, batch_update)
            if batch_update is not None:
                added = (capture_target(params) for _, params, _, _ in batch_update.added)
                self.files.check({target[0] for target in added if target is not None})
                self.files.keep_only({target[0] for target in self.targets.values()})

        # Model Runner V2's hooks.

        def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
            """Take slot ``req_idx`` for a request (or its next chunk); True makes V2 call
            `apply` for it, greedy or not. A slot's earlier request is forgotten here."""
            target = capture_target(sampling_params)
            if target is None:
                self.targets.pop(req_idx, None)
                return False
            self.targets[req_idx] = target
            self._named.add(target[0])
            return True

        def apply_staged_writes(self) -> None:
            """Once a step, after its requests were added: the file maps they need."""
            if self._named:
                self.files.check(self._named)
                self.files.keep_only({target[0] for target in self.targets.values()})
                self._named = set()

        # Both runners'.

        def apply(self, logits: torch.Tensor, ctx: LogitsContext | None = None) -> torch.Tensor:
            """Write the asked-for rows (``ctx``: V2's batch layout, None under V1): one
            device-to-host copy of them a step, which waits for the step's logits (its
            cost under async scheduling: docs/backends.md)."""
            if not self.targets:
                return logits
            rows, targets = rows_to_write(self.targets, logits.shape[0], ctx)
            if not rows:
                return logits
            selected = logits if len(rows) == logits.shape[0] else logits[rows]
            values = selected.to(device="cpu", dtype=torch.float32)
            for value, target in zip(values, targets, strict=True):
                try:
                    write_row(self.files, target, value)
                except (OSError, ValueError) as error:
                    # The caller finds the row unwritten and raises; the engine keeps serving.
                    if not self._warned:
                        logger.warning("genlm logits capture cannot write %s: %s", target[0], error)
                        self._warned = True
            return logits

    return FullLogitsCapture

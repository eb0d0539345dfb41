"""Full-vocabulary rows out of vLLM: the capture, both the caller's half and the engine's.

vLLM samples tokens; the backend needs each request's whole next-token distribution.
`LogitsProcessorCapture` (the default) tags each request with ``SamplingParams.extra_args
[CAPTURE_KEY] = (path, row, width)``, and `FullLogitsCapture`, a logits processor that vLLM
loads by name (`CAPTURE_PROCESSOR`) in whichever process samples, writes the request's
float32 logits into row ``row`` of the shared file ``path`` at every step. Both sides map
each file once (`MappedFiles` on the engine's) and reuse it step after step. Rows are found
through vLLM's public `BatchUpdate` bookkeeping (added, removed, moved requests), so
reordering of the persistent batch never mixes requests up; a chunked prefill writes the row
more than once and the last write, at the end of the prompt, is the one the caller reads.
`EngineLogprobsCapture` asks vLLM for ``logprobs=-1`` instead: public API only, and works
wherever the sampler runs, but every row travels as Python lists through vLLM's output
processing, and the first such request pays a one-off warm-up (seconds on CPU). Compared in
``benchmark/bench_vllm.py --captures``.

vLLM's processes import this module for the processor, the caller without vllm: so it
imports the standard library, numpy and torch, and vllm only when `FullLogitsCapture` (a
subclass of vLLM's ``LogitsProcessor``) is first looked up.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from genlm.backend.llm.protocols import LogprobsCapture

logger = logging.getLogger(__name__)

# The engine-side logits processor, named so that vLLM loads it in its own processes.
CAPTURE_PROCESSOR = "genlm.backend.llm.vllm.capture:FullLogitsCapture"
# ``SamplingParams.extra_args`` key through which a request asks for its logits.
CAPTURE_KEY = "genlm_capture"


def shared_memory_dir() -> str:
    """Where capture files go: RAM-backed ``/dev/shm`` when there is one, else the temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


class MissingRowsError(RuntimeError):
    """The logits processor wrote no logits for some rows of a batch."""


class _CaptureFile:
    """A float32 file of ``capacity x width`` rows, memory-mapped here and reused batch
    after batch (so the engine maps it once too); removed when closed or collected."""

    def __init__(self, directory: str, capacity: int, width: int):
        fd, self.path = tempfile.mkstemp(prefix="genlm-logits-", suffix=".f32", dir=directory)
        self._removal = weakref.finalize(self, Path(self.path).unlink, missing_ok=True)
        try:
            os.ftruncate(fd, capacity * width * 4)
            self._map = mmap.mmap(fd, capacity * width * 4)
        finally:
            os.close(fd)
        self.rows = np.frombuffer(self._map, dtype=np.float32).reshape(capacity, width)
        self.capacity, self.width = capacity, width

    def close(self) -> None:
        """Remove the file (its memory goes with the last view of its mapping)."""
        self._removal()


class _FileBatch:
    """A batch whose rows are the first ``n`` rows of a capture file, NaN until the
    engine-side logits processor writes them."""

    def __init__(self, file: _CaptureFile, n: int):
        self.path, self.n, self.width = file.path, n, file.width
        self.rows = torch.from_numpy(file.rows[:n])
        self.rows.fill_(math.nan)

    def sampling_kwargs(self, row: int) -> dict[str, Any]:
        return {"extra_args": {CAPTURE_KEY: (self.path, row, self.width)}}

    def read(self, outputs: Sequence[Any]) -> torch.Tensor:
        """The batch's rows: a view of the file, valid until the batch ends. The processor
        writes whole rows, so a row whose first entry is still NaN was never written."""
        missing = torch.isnan(self.rows[:, 0]).nonzero().flatten().tolist()
        if missing:
            raise MissingRowsError(
                f"The vLLM logits processor wrote no logits for rows {missing} of {self.n} "
                f"(is {CAPTURE_PROCESSOR!r} in the engine's logits_processors, and does the "
                f"sampler run on this host? If not, use EngineLogprobsCapture)."
            )
        return self.rows


class LogitsProcessorCapture:
    """Full-vocabulary logits through vLLM's custom logits-processor interface.

    Each batch takes a float32 file of NaN rows in ``directory`` (default ``/dev/shm``);
    every request names its row, the processor fills it, and rows still NaN afterwards
    raise `MissingRowsError`. ``directory`` must be visible to the process that samples (a
    shared filesystem if that is another host; `AsyncVirtualLM.from_name` checks it with a
    probe request). Files are reused from batch to batch (a fresh file costs ~1.5 ms of
    CPU a step): `KEEP_FILES` stay between batches, `close` removes those too.
    """

    engine_opts: dict[str, Any] = {"logits_processors": [CAPTURE_PROCESSOR]}
    KEEP_FILES = 2

    def __init__(self, directory: str | None = None):
        self.directory = directory or shared_memory_dir()
        self._free: list[_CaptureFile] = []
        self._lock = threading.Lock()  # for LMs that share this capture

    @contextmanager
    def batch(self, n: int, width: int) -> Iterator[_FileBatch]:
        """A file's first ``n`` rows for one batch. After a failed batch the file is
        removed, not reused: requests of an abandoned step may still write to it."""
        file = self._take(n, width)
        try:
            yield _FileBatch(file, n)
        except BaseException:
            file.close()
            raise
        self._give_back(file)

    def _take(self, n: int, width: int) -> _CaptureFile:
        """A free file with room for ``n`` rows of ``width``, else a new one (its rows
        rounded up to a power of two, so that batches of nearby sizes share it)."""
        with self._lock:
            for i, file in enumerate(self._free):
                if file.width == width and file.capacity >= n:
                    return self._free.pop(i)
        return _CaptureFile(self.directory, 1 << max(n - 1, 0).bit_length(), width)

    def _give_back(self, file: _CaptureFile) -> None:
        with self._lock:
            files = sorted([*self._free, file], key=lambda f: f.capacity, reverse=True)
            self._free, dropped = files[: self.KEEP_FILES], files[self.KEEP_FILES :]
        for extra in dropped:
            extra.close()

    def close(self) -> None:
        """Remove the files kept between batches (the capture stays usable)."""
        with self._lock:
            files, self._free = self._free, []
        for file in files:
            file.close()


class _LogprobsBatch:
    """A batch whose rows come back as vLLM's own ``logprobs=-1`` output."""

    def __init__(self, n: int, width: int):
        self.n, self.width = n, width

    def sampling_kwargs(self, row: int) -> dict[str, Any]:
        return {"logprobs": -1, "flat_logprobs": True}

    def read(self, outputs: Sequence[Any]) -> torch.Tensor:
        rows = torch.full((self.n, self.width), float("-inf"))
        for i, output in enumerate(outputs):
            position = output.outputs[0].logprobs
            if hasattr(position, "token_ids"):  # FlatLogprobs: one position, flat lists
                token_ids, values = position.token_ids, position.logprobs
            else:
                token_ids = list(position[0])
                values = [entry.logprob for entry in position[0].values()]
            ids = torch.as_tensor(token_ids, dtype=torch.long)
            keep = ids < self.width
            rows[i, ids[keep]] = torch.as_tensor(values, dtype=torch.float32)[keep]
        return rows


class EngineLogprobsCapture:
    """Full-vocabulary log-probabilities by asking vLLM for ``logprobs=-1`` (see module doc)."""

    engine_opts: dict[str, Any] = {"max_logprobs": -1}

    @contextmanager
    def batch(self, n: int, width: int) -> Iterator[_LogprobsBatch]:
        yield _LogprobsBatch(n, width)

    def close(self) -> None:
        """Nothing is kept between batches."""


CAPTURES = {"processor": LogitsProcessorCapture, "logprobs": EngineLogprobsCapture}


def make_capture(capture: Any) -> LogprobsCapture:
    """The capture `AsyncVirtualLM.from_name`'s ``capture`` names: one of `CAPTURES` by name,
    or a capture object (with ``engine_opts``, ``batch`` and ``close``) as it is."""
    if isinstance(capture, str) and capture in CAPTURES:
        return CAPTURES[capture]()
    if not isinstance(capture, str) and all(
        hasattr(capture, name) for name in ("engine_opts", "batch", "close")
    ):
        return capture
    raise ValueError(
        f"capture must be one of {sorted(CAPTURES)} or a capture object such as "
        f"LogitsProcessorCapture(directory=...) or EngineLogprobsCapture(), got {capture!r}"
    )


# The engine's half: what runs in the process that samples.

Target = tuple[str, int, int]  # (file path, row, width)


def capture_target(params: SamplingParams) -> Target | None:
    """The ``(path, row, width)`` a request asks its logits to be written to, if any."""
    target = (params.extra_args or {}).get(CAPTURE_KEY)
    if target is None:
        return None
    path, row, width = target
    return str(path), int(row), int(width)


def apply_batch_update(targets: dict[int, Target], batch_update: BatchUpdate | None) -> None:
    """Keep ``targets`` (persistent-batch index -> target) in step with vLLM's batch, in
    vLLM's documented order: removed, added (`capture_target`), moved."""
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
        return _processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _processor_class() -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class FullLogitsCapture(LogitsProcessor):
        """Copies the logits of opted-in requests to their callers; leaves the logits unchanged."""

        __qualname__ = "FullLogitsCapture"  # the name vLLM loads it by (and pickle finds it by)

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
            self.targets: dict[int, Target] = {}
            self.files = MappedFiles()
            self._warned = False

        @classmethod
        def validate_params(cls, sampling_params: SamplingParams) -> None:
            target = (sampling_params.extra_args or {}).get(CAPTURE_KEY)
            if target is not None and (not isinstance(target, list | tuple) or len(target) != 3):
                raise ValueError(
                    f"extra_args[{CAPTURE_KEY!r}] must be (path, row, width), got {target!r}"
                )

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
                            "genlm logits capture cannot write %s: %s",
                            self.targets[index][0],
                            error,
                        )
                        self._warned = True
            return logits

    return FullLogitsCapture

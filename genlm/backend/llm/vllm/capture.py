"""Full-vocabulary rows out of vLLM: the caller's half of the capture.

vLLM samples tokens; the backend needs each request's whole next-token distribution.
`LogitsProcessorCapture` (the default) tags each request with ``SamplingParams.extra_args
[CAPTURE_KEY] = (path, row, width)``, and `FullLogitsCapture`, a logits processor that vLLM
loads by name (`CAPTURE_PROCESSOR`) in whichever process samples, writes the request's
float32 logits into row ``row`` of the shared file ``path`` at every step, under either of
vLLM's model runners (the engine's half: `genlm.backend.llm.vllm.processor`). Both sides map
each file once and reuse it step after step. `EngineLogprobsCapture` asks vLLM for
``logprobs=-1`` instead: public API only, and works wherever the sampler runs, but every
row travels as Python lists through vLLM's output processing, and the first such request
pays a one-off warm-up (seconds on CPU). Compared in ``benchmark/bench_vllm.py --captures``.

Capture files take their whole size when they are made (`reserve_space`): a sparse file
on a full tmpfs (``/dev/shm`` is 64 MB in Docker's and Kubernetes' containers by default)
would kill the first process that writes into its mapping with SIGBUS instead. Where the
directory has no room, a capture in the default directory moves to the temp dir for good
(one logged warning), and one given its ``directory`` raises `CaptureSpaceError` (see
`LogitsProcessorCapture`).

The caller imports this module without vllm: it imports the standard library, numpy and
torch. ``genlm.backend.llm.vllm.capture:FullLogitsCapture``, the processor's name before
it had a module of its own, still loads the same class.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from genlm.backend.llm.vllm.processor import CAPTURE_KEY as CAPTURE_KEY
from genlm.backend.llm.vllm.processor import CAPTURE_PROCESSOR as CAPTURE_PROCESSOR
from genlm.backend.llm.vllm.processor import processor_class

if TYPE_CHECKING:
    from genlm.backend.llm.protocols import LogprobsCapture

logger = logging.getLogger(__name__)

# The errors of a file system without room for a file: full, over a size or a quota limit.
NO_ROOM = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def shared_memory_dir() -> str:
    """Where capture files go: RAM-backed ``/dev/shm`` when there is one, else the temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


def reserve_space(fd: int, size: int) -> None:
    """Give the file ``fd`` its first ``size`` bytes now, so that a file system without room
    raises ``OSError`` here (`NO_ROOM`) rather than SIGBUS at a write into a mapping:
    ``posix_fallocate``, or zeros written where the OS has none (macOS) or the file system
    cannot (``EOPNOTSUPP``)."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        try:
            fallocate(fd, 0, size)
            return
        except OSError as error:
            if error.errno != errno.EOPNOTSUPP:
                raise
    zeros = bytes(min(size, 1 << 20))
    written = 0
    while written < size:
        written += os.pwrite(fd, zeros[: size - written], written)


class MissingRowsError(RuntimeError):
    """The logits processor wrote no logits for some rows of a batch."""


class CaptureSpaceError(OSError):
    """A capture file found no room in its directory (nor in the fallback, if any)."""


class _CaptureFile:
    """A float32 file of ``capacity x width`` rows, its space reserved (`reserve_space`),
    memory-mapped here and reused batch after batch (so the engine maps it once too);
    removed when closed or collected, or at once if it cannot be made."""

    def __init__(self, directory: str, capacity: int, width: int):
        size = capacity * width * 4
        fd, self.path = tempfile.mkstemp(prefix="genlm-logits-", suffix=".f32", dir=directory)
        self._removal = weakref.finalize(self, Path(self.path).unlink, missing_ok=True)
        try:
            reserve_space(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            self._removal()
            raise
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


# How to give the capture room (where its directory is a container's small /dev/shm).
FIXES = (
    "give /dev/shm more room with `docker run --shm-size=1g` or `--ipc=host` (Kubernetes: "
    "an emptyDir volume with medium: Memory at /dev/shm), or name a local directory with room "
    "with capture=LogitsProcessorCapture(directory=...), or use capture='logprobs' (no files)"
)


def _capacity(n: int) -> int:
    """The rows of the file made for a batch of ``n``: rounded up to a power of two, so
    that batches of nearby sizes share it."""
    return 1 << max(n - 1, 0).bit_length()


def _size(size: int) -> str:
    """``size`` bytes, for a person."""
    return f"{size:,} bytes ({size / 1e6:.1f} MB)"


def _no_room(
    error: OSError, capacity: int, width: int, directories: list[str]
) -> CaptureSpaceError:
    """The error for a file of ``capacity x width`` float32s that none of ``directories``
    could hold (``error``: the last directory's)."""
    free = []
    for directory in directories:
        try:
            free.append(f"{directory} ({_size(shutil.disk_usage(directory).free)} free)")
        except OSError:
            free.append(directory)
    return CaptureSpaceError(
        error.errno,
        f"No room for a vLLM capture file ({capacity} rows of {width} float32 logits: "
        f"{_size(capacity * width * 4)}) in {' or in '.join(free)}: {error.strerror}. To fix: "
        f"{FIXES}.",
    )


class LogitsProcessorCapture:
    """Full-vocabulary logits through vLLM's custom logits-processor interface.

    Each batch takes a float32 file of NaN rows in ``directory`` (default ``/dev/shm``);
    every request names its row, the processor fills it, and rows still NaN afterwards
    raise `MissingRowsError`. ``directory`` must be visible to the process that samples (a
    shared filesystem if that is another host; `AsyncVirtualLM.from_name` checks it with a
    probe request). Files are reused from batch to batch (a fresh file's pages are
    faulted in again): `KEEP_FILES` stay between batches, `close` removes those too.

    A file takes its space when made (the first batch of its size): where the directory
    has no room, the default directory gives way to the temp dir (on this host, so the
    engine's processes here see it) for this file and the later ones, with one logged
    warning; a ``directory`` given here has no fallback (it may be the one shared with
    another machine). Where no directory has room, `CaptureSpaceError` names the
    directory, the bytes needed and the fixes; it fails that batch's callers alone.
    `AsyncVirtualLM.from_name` calls `check_room` before the engine starts.
    """

    engine_opts: dict[str, Any] = {"logits_processors": [CAPTURE_PROCESSOR]}
    KEEP_FILES = 2

    def __init__(self, directory: str | None = None):
        self.directory = directory or shared_memory_dir()
        fallback = tempfile.gettempdir()
        same = os.path.realpath(fallback) == os.path.realpath(self.directory)
        self._fallback = None if directory is not None or same else fallback
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
        """A free file with room for ``n`` rows of ``width``, else a new one (`_capacity`)."""
        with self._lock:
            for i, file in enumerate(self._free):
                if file.width == width and file.capacity >= n:
                    return self._free.pop(i)
        return self._new_file(_capacity(n), width)

    def check_room(self, n: int, width: int) -> None:
        """Make the file a batch of ``n`` rows of ``width`` takes, and remove it: where no
        directory has room for it, `CaptureSpaceError` now (before an engine starts)
        rather than at the first batch that size; where only the fallback has, the
        capture moves there now."""
        self._new_file(_capacity(n), width).close()

    def _new_file(self, capacity: int, width: int) -> _CaptureFile:
        """A new file in the capture's directory, else in its fallback (moving there)."""
        directory, fallback = self.directory, self._fallback
        try:
            return _CaptureFile(directory, capacity, width)
        except OSError as error:
            if error.errno not in NO_ROOM:
                raise
            if fallback is None:
                raise _no_room(error, capacity, width, [directory]) from error
        try:
            file = _CaptureFile(fallback, capacity, width)
        except OSError as error:
            if error.errno not in NO_ROOM:
                raise
            raise _no_room(error, capacity, width, [directory, fallback]) from error
        with self._lock:
            moved, self.directory, self._fallback = self._fallback is not None, fallback, None
        if moved:
            logger.warning(
                "No room for a vLLM capture file of %s in %s: capture files go to %s from "
                "now on (to keep them in memory: %s)",
                _size(capacity * width * 4),
                directory,
                fallback,
                FIXES,
            )
        return file

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


def __getattr__(name: str) -> Any:
    """`FullLogitsCapture` by its older name (see the module doc)."""
    if name == "FullLogitsCapture":
        return processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

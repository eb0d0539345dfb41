"""The memory that genlm.backend holds in this process, apart from what a test holds itself.

A process's resident memory is no measure of it: it counts the test's own references (a
transformers KV cache grown by ``torch.cat`` at every step) and what the C allocator keeps
of memory freed in pieces. `held_bytes` counts, once every unreachable object is freed:

- ``python``: live allocations (Python objects, numpy arrays) made with a frame of
  genlm.backend on the stack, as `tracemalloc` (started by `tracing`) recorded them;
- ``tensors``: the storages of every live torch tensor but the test's own (``own``);
- ``mapped``: the capture files (`genlm.backend.llm.vllm.capture`) mapped in this process.

Tensor storages are not allocated through Python's allocator, so tracemalloc does not see
them, and Python 3.11 cannot tell where a tensor object was made; so they are counted all,
less the test's. Linux only (``/proc/self/maps``).
"""

import functools
import gc
import os
import tracemalloc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

import genlm.backend

LIBRARY_DIR = os.path.join(os.path.realpath(os.path.dirname(genlm.backend.__file__)), "")
# How `_CaptureFile` names its files.
CAPTURE_FILE_PREFIX = "genlm-logits-"


@contextmanager
def tracing(frames: int = 64) -> Iterator[None]:
    """Record every Python allocation with its innermost ``frames`` frames (deep enough to
    reach the library's frame under vLLM's calls)."""
    tracemalloc.start(frames)
    try:
        yield
    finally:
        tracemalloc.stop()


def held_bytes(own: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes the library holds now, by kind (see the module doc); ``own``: the tensors the
    test holds itself (a reference model's weights and cache), left out."""
    gc.collect()
    return {"python": library_python_bytes(), "tensors": tensor_bytes(own), "mapped": mapped()}


def library_python_bytes() -> int:
    """Live traced allocations made with a frame of genlm.backend on the stack. (Grouped by
    traceback first: `tracemalloc.Snapshot.filter_traces` takes minutes over every frame of
    every trace, with fnmatch.)"""
    statistics = tracemalloc.take_snapshot().statistics("traceback")
    return sum(
        statistic.size
        for statistic in statistics
        if any(in_library(frame.filename) for frame in statistic.traceback)
    )


@functools.cache
def in_library(filename: str) -> bool:
    return os.path.realpath(filename).startswith(LIBRARY_DIR)


def tensor_bytes(own: Iterable[torch.Tensor]) -> int:
    """The storages of the live tensors, each once, but those of ``own``."""
    left_out = {tensor.untyped_storage().data_ptr() for tensor in own}
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # By the type's MRO: isinstance reads __class__ (a property on some objects), and
        # issubclass goes through torch's metaclass (3 us an object, a million objects).
        if torch.Tensor not in type(obj).__mro__ or obj.layout != torch.strided or obj.is_meta:
            continue
        storage = obj.untyped_storage()
        if storage.data_ptr() not in left_out:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def mapped() -> int:
    """Bytes of this process's mappings of capture files (removed ones too, while mapped)."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and Path(fields[5].split(" (deleted)")[0]).name.startswith(
                CAPTURE_FILE_PREFIX
            ):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                total += end - start
    return total


def assert_rows_hold_only_themselves(rows: Iterable[torch.Tensor], vocab_size: int) -> None:
    """Each row a call returned owns a storage of its own ``vocab_size`` floats: a caller
    that keeps one row keeps nothing of its batch, nor of another caller's row."""
    rows = list(rows)
    assert [row.untyped_storage().nbytes() for row in rows] == [4 * vocab_size] * len(rows)
    assert len({row.untyped_storage().data_ptr() for row in rows}) == len(rows)

"""The measure of the library's memory behind the vLLM long-run test (`held_memory`): it
counts what library code keeps and leaves out what the test keeps itself."""

import sys

import pytest
import torch
from held_memory import held_bytes, tracing

from genlm.backend.cache import OutputCache
from genlm.backend.llm.vllm.capture import LogitsProcessorCapture

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")

MIB = 1 << 20


def test_what_library_code_keeps_is_counted_and_the_tests_own_is_not():
    with tracing():
        reference = torch.zeros(4 * MIB // 4)  # the test's own, named as such
        before = held_bytes(own=[reference])
        cache = OutputCache(10)
        cache[list(range(10_000))] = torch.ones(MIB // 4)  # the key's tuple is made there
        kept_by_the_test = [list(range(10_000)), torch.ones(MIB // 4)]
        reference = torch.cat([reference, reference])  # grows, as a reference KV cache does
        after = held_bytes(own=[reference])
    grown = {kind: after[kind] - before[kind] for kind in after}
    # the cached tensor and the test's second one (tensors are counted all, but the own)
    assert 2 * MIB <= grown["tensors"] < 2 * MIB + 64 * 1024, grown
    # the cache's key tuple (80 KB), not the test's list of as many new ints (360 KB)
    assert 80_000 <= grown["python"] < 100_000, grown
    assert grown["mapped"] == 0
    assert len(cache) == 1 and kept_by_the_test


def test_mapped_capture_files_are_counted_until_they_are_unmapped(tmp_path):
    capture = LogitsProcessorCapture(directory=str(tmp_path))
    with tracing():
        before = held_bytes()["mapped"]
        with capture.batch(4, 1000) as batch:
            batch.rows.fill_(0)
        del batch
        assert held_bytes()["mapped"] - before >= 4 * 1000 * 4  # kept for the next batch
        capture.close()
        assert held_bytes()["mapped"] == before

"""AsyncTokenCharacterTrie: concurrent awaits batched, results equal to the direct calls."""

import asyncio
import inspect
import threading

import numpy as np
import pytest
import torch

from genlm.backend import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    Token,
    TokenCharacterTrie,
)

VOCAB = [Token(i, b) for i, b in enumerate([b"", b"a", b"ab", b"abc", b"b", b"ba", b"ab"])]


def distributions(n, seed=0):
    return np.random.default_rng(seed).random((n, len(VOCAB)))


def brute_sum(ws):
    """Sum of ``ws`` over the tokens starting with each prefix, by prefix bytes."""
    return {
        bytes(t[:k]): sum(w for u, w in zip(VOCAB, ws, strict=True) if u.startswith(bytes(t[:k])))
        for t in VOCAB
        for k in range(len(t) + 1)
    }


@pytest.mark.parametrize("backend", ["sequential", "parallel"])
async def test_concurrent_calls_form_one_batch_off_the_event_loop(backend):
    trie = AsyncTokenCharacterTrie.from_vocab(VOCAB, backend=backend)
    threads = []
    batch_weight_sum = trie.trie.batch_weight_sum

    def recording(ws, out=None):
        threads.append(threading.get_ident())
        return batch_weight_sum(ws, out=out)

    trie.trie.batch_weight_sum = recording
    ws = distributions(20)
    results = await asyncio.gather(*(trie.weight_sum(w) for w in ws))
    assert list(trie.batch_sizes) == [20]
    assert threading.get_ident() not in threads
    inner = trie.trie
    for w, result in zip(ws, results, strict=True):
        expected = brute_sum(w)
        for node, prefix in inner.node2prefix.items():
            if node not in inner.leaf2word:
                assert result[node] == pytest.approx(expected[bytes(prefix)], rel=1e-5)
    maxima = await asyncio.gather(*(trie.weight_max(torch.tensor(w)) for w in ws))
    np.testing.assert_allclose(np.stack(maxima), inner.batch_weight_max(ws), rtol=1e-6)
    await trie.cleanup()


def test_works_across_successive_event_loops():
    trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB))
    trie.start()
    ws = distributions(5)

    async def run():
        return await asyncio.gather(*(trie.weight_sum(w) for w in ws))

    first, second = asyncio.run(run()), asyncio.run(run())
    np.testing.assert_allclose(np.stack(first), np.stack(second))
    np.testing.assert_allclose(np.stack(first), trie.trie.batch_weight_sum(ws))
    trie.shutdown()


async def test_bad_input_fails_only_its_own_caller():
    trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB))
    good = distributions(3)
    results = await asyncio.gather(
        trie.weight_sum(good[0]),
        trie.weight_sum(np.ones(len(VOCAB) + 1)),
        trie.weight_max(np.ones((2, len(VOCAB)))),
        trie.weight_sum(good[1]),
        return_exceptions=True,
    )
    assert isinstance(results[1], ValueError) and isinstance(results[2], ValueError)
    np.testing.assert_allclose(results[0], trie.trie.weight_sum(good[0]))
    np.testing.assert_allclose(results[3], trie.trie.weight_sum(good[1]))


async def test_a_failing_batch_fails_its_callers_only():
    trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB))
    real = trie.trie.batch_weight_sum
    calls = []

    def fail_once(ws, out=None):
        calls.append(len(ws))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(ws, out=out)

    trie.trie.batch_weight_sum = fail_once
    ws = distributions(4)
    first = await asyncio.gather(*(trie.weight_sum(w) for w in ws), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in first)
    second = await asyncio.gather(*(trie.weight_sum(w) for w in ws))
    np.testing.assert_allclose(np.stack(second), real(ws))


def test_from_vocab_backends():
    assert isinstance(AsyncTokenCharacterTrie.from_vocab(VOCAB).trie, ParallelTokenCharacterTrie)
    sequential = AsyncTokenCharacterTrie.from_vocab(VOCAB, backend="sequential").trie
    assert type(sequential) is TokenCharacterTrie
    parallel = AsyncTokenCharacterTrie.from_vocab(VOCAB, device="cpu").trie
    assert parallel.device == "cpu"
    with pytest.raises(ValueError, match="backend"):
        AsyncTokenCharacterTrie.from_vocab(VOCAB, backend="gpu")


@pytest.mark.parametrize("backend", ["sequential", "parallel"])
@pytest.mark.parametrize("kind", [np.array, torch.tensor, list])
async def test_weights_are_taken_when_called_not_when_the_batch_runs(backend, kind):
    """A caller changing its weights after the call (before the batch runs) changes nothing."""
    trie = AsyncTokenCharacterTrie.from_vocab(VOCAB, backend=backend)
    original = distributions(2, seed=3)
    ws = [kind(list(w)) for w in original]
    tasks = [
        asyncio.create_task(trie.weight_sum(ws[0])),
        asyncio.create_task(trie.weight_max(ws[1])),
    ]
    for w in ws:  # in place, before the tasks first run
        for i in range(len(w)):
            w[i] = 100.0
    sums, maxima = await asyncio.gather(*tasks)
    inner = trie.trie
    expected = brute_sum(original[0])
    for node, prefix in inner.node2prefix.items():
        if node not in inner.leaf2word:
            assert sums[node] == pytest.approx(expected[bytes(prefix)], rel=1e-5)
    brute_max = {  # the max of the original weights over the tokens under each prefix
        bytes(prefix): max(
            w for t, w in zip(VOCAB, original[1], strict=True) if t.startswith(bytes(prefix))
        )
        for prefix in inner.node2prefix.values()
    }
    for node, prefix in inner.node2prefix.items():
        if node not in inner.leaf2word:
            assert maxima[node] == pytest.approx(brute_max[bytes(prefix)], rel=1e-5)
    await trie.cleanup()


async def test_results_held_by_callers_are_never_overwritten():
    """Result blocks are recycled only once no caller holds a row of them."""
    trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB))
    first_ws, second_ws = distributions(5, seed=1), distributions(5, seed=2)
    first = await asyncio.gather(*(trie.weight_sum(w) for w in first_ws))
    kept = [row.copy() for row in first]
    for _ in range(3):  # later batches, some of whose results are dropped at once
        await asyncio.gather(*(trie.weight_sum(w) for w in second_ws))
    for row, copy in zip(first, kept, strict=True):
        np.testing.assert_array_equal(row, copy)
    expected = trie.trie.batch_weight_sum(second_ws)
    again = await asyncio.gather(*(trie.weight_sum(w) for w in second_ws))
    np.testing.assert_array_equal(np.stack(again), expected)
    await trie.cleanup()


async def test_a_view_derived_from_a_dropped_row_keeps_its_block():
    """A caller's slice of its row holds the block even after the row itself is gone."""
    trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB))
    first = await trie.weight_sum(distributions(1, seed=1)[0])
    tail, kept = first[1:], first[1:].copy()
    del first
    for seed in (2, 3, 4):
        await asyncio.gather(*(trie.weight_sum(w) for w in distributions(3, seed=seed)))
    np.testing.assert_array_equal(tail, kept)
    await trie.cleanup()


async def test_rows_of_a_batch_keep_its_block_until_every_caller_drops_theirs():
    from genlm.backend.trie._results import ResultBlocks

    trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB))
    trie.trie._results = ResultBlocks(min_bytes=0)  # lease even these tiny results
    first = await asyncio.gather(*(trie.weight_sum(w) for w in distributions(3, seed=5)))
    allocated = trie.trie._results.allocated
    kept = first[1]
    del first
    for seed in (6, 7):
        await asyncio.gather(*(trie.weight_sum(w) for w in distributions(3, seed=seed)))
    assert trie.trie._results.allocated == allocated + 1  # one row kept its block leased
    expected = brute_sum(distributions(3, seed=5)[1])
    for node, prefix in trie.trie.node2prefix.items():
        if trie.trie._is_leaf[node]:
            continue
        assert kept[node] == pytest.approx(expected[bytes(prefix)], rel=1e-5)
    await trie.cleanup()


CLOSED = r"^AsyncTokenCharacterTrie used after close\(\): create a new one \(pause\(\), "
CALLS_AFTER_CLOSE = {
    "weight_sum": lambda trie: trie.weight_sum(np.ones(len(VOCAB))),
    "weight_max": lambda trie: trie.weight_max(torch.ones(len(VOCAB))),
    "start": lambda trie: trie.start(),
    "pause": lambda trie: trie.pause(),
    "cleanup": lambda trie: trie.cleanup(),
    "shutdown": lambda trie: trie.shutdown(),
}


def has_workers(trie):
    """Whether any of ``trie``'s batchers holds a worker thread (started only by its executor)."""
    return any(batcher._executor is not None for batcher in trie._batchers.values())


@pytest.mark.parametrize("backend", ["sequential", "parallel"])
@pytest.mark.parametrize("call", CALLS_AFTER_CLOSE)
async def test_every_method_of_a_closed_trie_raises_and_starts_no_thread(backend, call):
    trie = AsyncTokenCharacterTrie.from_vocab(VOCAB, backend=backend)
    ws = distributions(1)[0]
    np.testing.assert_allclose(await trie.weight_sum(ws), trie.trie.weight_sum(ws), rtol=1e-6)
    assert has_workers(trie)
    trie.close()
    assert not has_workers(trie)
    with pytest.raises(RuntimeError, match=CLOSED):
        result = CALLS_AFTER_CLOSE[call](trie)
        if inspect.iscoroutine(result):
            await result
    assert not has_workers(trie)


async def test_close_is_idempotent_and_the_with_blocks_close_quietly_after_it():
    """A second close, and leaving a ``with`` / ``async with`` block after an explicit
    close, do nothing (and raise nothing)."""
    trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB))
    trie.close()
    trie.close()
    with AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB)) as trie:
        await trie.weight_sum(np.ones(len(VOCAB)))
        trie.close()
    async with AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB)) as trie:
        await trie.weight_max(np.ones(len(VOCAB)))
        trie.close()
    assert not has_workers(trie)
    with pytest.raises(RuntimeError, match=CLOSED):
        trie.pause()


def close_on_another_thread(trie):
    """``trie.close()`` on a thread of its own, while this loop waits for it."""
    thread = threading.Thread(target=trie.close)
    thread.start()
    thread.join()


@pytest.mark.parametrize("close", [AsyncTokenCharacterTrie.close, close_on_another_thread])
async def test_requests_waiting_at_close_get_the_closed_error_not_a_cancellation(close):
    trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB))
    ws = distributions(1)[0]
    waiting = [
        asyncio.ensure_future(trie.weight_sum(ws)),
        asyncio.ensure_future(trie.weight_max(ws)),
    ]
    await asyncio.sleep(0)  # queued; their batches have not run
    close(trie)
    for task in waiting:
        with pytest.raises(RuntimeError, match=CLOSED):
            await task
        assert not task.cancelled()


def test_the_weight_kernels_release_the_gil():
    """So the event loop keeps running while the async trie's worker thread sweeps."""
    from genlm.backend.trie import _kernels

    for kernel in (_kernels.sum_into, _kernels.batch_sum_into, _kernels.max_into):
        assert kernel.targetoptions.get("nogil") is True, kernel.__name__

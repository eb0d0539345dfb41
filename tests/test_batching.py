"""The shared AutoBatcher, driven by a stand-in model that records its calls."""

import asyncio
import threading
import time

import pytest

from genlm.backend.batching import AutoBatcher


class StandIn:
    """Squares its inputs; records every batch and the thread it ran on."""

    def __init__(self, delay=0.0, fail_on=None):
        self.batches = []
        self.threads = set()
        self.delay = delay
        self.fail_on = fail_on

    def __call__(self, keys):
        self.batches.append(list(keys))
        self.threads.add(threading.get_ident())
        if self.delay:
            time.sleep(self.delay)
        if self.fail_on is not None and self.fail_on in keys:
            raise RuntimeError(f"boom on {self.fail_on}")
        return [k * k for k in keys]


async def first_of(work, sentinel_seconds):
    """``work``'s result, asserting it came before a sentinel that sleeps ``sentinel_seconds``
    on the same loop finished (an order, not a wall-clock bound)."""
    task = asyncio.ensure_future(work)
    sentinel = asyncio.ensure_future(asyncio.sleep(sentinel_seconds))
    await asyncio.wait({task, sentinel}, return_when=asyncio.FIRST_COMPLETED)
    assert task.done() and not sentinel.done()
    sentinel.cancel()
    return task.result()


async def test_concurrent_requests_form_one_batch_without_waiting_for_timeout():
    model = StandIn()
    batcher = AutoBatcher(model, batch_size=100, timeout=5.0)
    # Flushed when the loop went idle: before a sentinel as long as the timeout.
    results = await first_of(asyncio.gather(*(batcher.submit(i) for i in range(50))), 5.0)
    assert results == [i * i for i in range(50)]
    assert model.batches == [list(range(50))]
    assert threading.get_ident() not in model.threads  # ran off the event loop thread


async def test_requests_that_come_while_others_are_ready_join_the_same_batch():
    """The idle flush waits until no ready callback adds a request: callers that submit
    after a few turns of the loop each (other work first, as a particle might do) still
    form one batch, staggered so that each turn brings new ones, and after the flush was
    first scheduled."""
    model = StandIn()
    batcher = AutoBatcher(model, batch_size=100, timeout=None)

    async def caller(key):
        for _ in range(key % 5):
            await asyncio.sleep(0)
        return await batcher.submit(key)

    results = await asyncio.gather(*(caller(i) for i in range(40)))
    assert results == [i * i for i in range(40)]
    assert [sorted(batch) for batch in model.batches] == [list(range(40))]


async def test_batches_are_capped_at_batch_size():
    model = StandIn()
    batcher = AutoBatcher(model, batch_size=8, timeout=None)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(20)))
    assert results == [i * i for i in range(20)]
    assert [len(b) for b in model.batches] == [8, 8, 4]
    assert sorted(k for b in model.batches for k in b) == list(range(20))


async def test_identical_keys_are_computed_once():
    model = StandIn()
    batcher = AutoBatcher(model, batch_size=10)
    results = await asyncio.gather(*(batcher.submit(i % 3) for i in range(12)))
    assert results == [(i % 3) ** 2 for i in range(12)]
    assert model.batches == [[0, 1, 2]]


async def test_later_callers_of_a_key_get_copies_of_its_result_made_in_one_call():
    """Results that are objects a caller may edit (lists here): the first caller of a key
    gets the result, each later one a copy, all made by one ``copy_results`` call."""
    calls = []

    def copy_results(results):
        calls.append(results)
        return [list(result) for result in results]

    def pairs(keys):
        return [[k, k] for k in keys]

    batcher = AutoBatcher(pairs, batch_size=100, timeout=None, copy_results=copy_results)
    results = await asyncio.gather(*(batcher.submit(k) for k in [1, 2, 1, 1, 3, 2]))
    assert results == [[1, 1], [2, 2], [1, 1], [1, 1], [3, 3], [2, 2]]
    assert len({id(result) for result in results}) == 6  # each caller's own
    assert calls == [[[1, 1], [1, 1], [2, 2]]]  # one call, for the three later callers
    results[0].append(9)
    assert results[2] == [1, 1] and results[3] == [1, 1]


async def test_results_are_shared_without_copy_results_and_a_failed_copy_fails_its_callers():
    def lists(keys):
        return [[k] for k in keys]

    shared = AutoBatcher(lists, batch_size=100, timeout=None)
    first, second = await asyncio.gather(shared.submit(1), shared.submit(1))
    assert first is second  # ints, say, need no copy

    def refuse(results):
        raise MemoryError("no room for the copies")

    failing = AutoBatcher(lists, batch_size=100, timeout=None, copy_results=refuse)
    outcomes = await asyncio.gather(*(failing.submit(k) for k in [1, 1, 2]), return_exceptions=True)
    assert outcomes[0] == [1] and outcomes[2] == [2]
    assert isinstance(outcomes[1], MemoryError)
    assert await failing.submit(3) == [3]  # and the batcher serves on


async def test_next_batch_gathers_while_current_one_computes():
    model = StandIn(delay=0.1)
    batcher = AutoBatcher(model, batch_size=100, timeout=None)

    async def late(i):
        await asyncio.sleep(0.02)  # arrives while the first batch is running
        return await batcher.submit(i)

    results = await asyncio.gather(batcher.submit(0), *(late(i) for i in range(1, 6)))
    assert results == [i * i for i in range(6)]
    assert model.batches == [[0], [1, 2, 3, 4, 5]]


async def test_timeout_bounds_the_wait_when_the_loop_stays_busy():
    model = StandIn()
    batcher = AutoBatcher(model, batch_size=100, timeout=0.05)
    stop = False

    async def busy():  # keeps the loop from ever being idle
        while not stop:
            await asyncio.sleep(0)

    async def trickle():
        tasks = []
        for i in range(40):
            tasks.append(asyncio.ensure_future(batcher.submit(i)))
            await asyncio.sleep(0.005)
        return await asyncio.gather(*tasks)

    spinner = asyncio.ensure_future(busy())
    assert await first_of(batcher.submit(-1), 2.0) == 1  # at the timeout: the loop never idles
    results = await trickle()
    stop = True
    await spinner
    assert results == [i * i for i in range(40)]


async def test_error_reaches_every_caller_of_the_batch_and_batcher_keeps_serving():
    model = StandIn(fail_on=3)
    batcher = AutoBatcher(model, batch_size=10)
    outcomes = await asyncio.gather(*(batcher.submit(i) for i in range(5)), return_exceptions=True)
    assert all(isinstance(o, RuntimeError) and "boom on 3" in str(o) for o in outcomes)
    assert await asyncio.gather(batcher.submit(7), batcher.submit(8)) == [49, 64]


async def test_wrong_number_of_results_is_an_error_for_the_callers():
    batcher = AutoBatcher(lambda keys: [0], batch_size=10)
    outcomes = await asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True)
    assert all(isinstance(o, RuntimeError) and "returned 1 results" in str(o) for o in outcomes)


async def test_cancelled_caller_does_not_disturb_the_others():
    model = StandIn(delay=0.05)
    batcher = AutoBatcher(model, batch_size=10)
    queued = [asyncio.ensure_future(batcher.submit(i)) for i in range(4)]
    await asyncio.sleep(0)
    queued[1].cancel()
    results = await asyncio.gather(*queued, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError)
    assert [results[i] for i in (0, 2, 3)] == [0, 4, 9]

    running = [asyncio.ensure_future(batcher.submit(i)) for i in range(10, 14)]
    await asyncio.sleep(0.01)  # the batch is now computing
    running[0].cancel()
    results = await asyncio.gather(*running, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert results[1:] == [121, 144, 169]


async def test_cancelled_before_flush_is_not_computed():
    model = StandIn()
    batcher = AutoBatcher(model, batch_size=10)
    a = asyncio.ensure_future(batcher.submit(1))
    b = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0)  # both queued
    a.cancel()
    assert await b == 4
    assert model.batches == [[2]]


async def test_reset_drops_queued_requests():
    model = StandIn()
    batcher = AutoBatcher(model, batch_size=10, timeout=None)
    queued = asyncio.ensure_future(batcher.submit(5))
    await asyncio.sleep(0)  # queued, and the idle flush is pending
    batcher.reset()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert model.batches == []
    assert await batcher.submit(6) == 36


def test_works_across_successive_event_loops():
    model = StandIn()
    batcher = AutoBatcher(model, batch_size=4)

    async def run(offset):
        return await asyncio.gather(*(batcher.submit(offset + i) for i in range(6)))

    assert asyncio.run(run(0)) == [i * i for i in range(6)]
    assert asyncio.run(run(10)) == [(10 + i) ** 2 for i in range(6)]
    batcher.pause()
    assert asyncio.run(run(20)) == [(20 + i) ** 2 for i in range(6)]


def test_abandoned_loop_does_not_block_the_next_one():
    model = StandIn(delay=0.05)
    batcher = AutoBatcher(model, batch_size=4)

    async def abandon():
        asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.01)  # the batch is running when the loop ends

    asyncio.run(abandon())
    assert asyncio.run(batcher.submit(3)) == 9


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        AutoBatcher(StandIn(), batch_size=0)
    with pytest.raises(ValueError, match="timeout"):
        AutoBatcher(StandIn(), timeout=-1)


def test_run_sync_uses_the_worker_thread():
    batcher = AutoBatcher(StandIn())
    assert batcher.run_sync(threading.get_ident) != threading.get_ident()


async def test_a_batch_that_cannot_reach_the_worker_fails_its_callers_instead_of_hanging():
    """The worker shut down between the flush's executor lookup and its submission (a close
    on another thread): the batch's callers get the error, and the batcher serves on."""
    model = StandIn()
    batcher = AutoBatcher(model, batch_size=4, timeout=0.01)
    executor = batcher._get_executor()
    executor.shutdown(wait=True)  # the worker gone, its handle not yet dropped
    results = await asyncio.gather(
        *(first_of(batcher.submit(k), 5) for k in (1, 2)), return_exceptions=True
    )
    assert [str(r) for r in results] == ["cannot schedule new futures after shutdown"] * 2
    batcher._executor = None  # the close that shut it down lets it go
    assert await batcher.submit(3) == 9


async def test_a_batcher_closed_for_good_refuses_work_at_once():
    batcher = AutoBatcher(StandIn(), batch_size=4, timeout=0.01, name="genlm-test")
    assert await batcher.submit(2) == 4
    batcher.close()
    closed = r"^genlm-test: used after its owner was closed$"
    with pytest.raises(RuntimeError, match=closed):
        batcher.run_sync(abs, -1)
    with pytest.raises(RuntimeError, match=closed):
        await batcher.submit(2)
    assert batcher._executor is None


async def test_closing_for_good_tells_queued_callers_why_instead_of_cancelling_them():
    """Callers waiting at the close never cancelled anything: they get the owner's error
    (their tasks fail, not cancelled), and nothing of theirs runs."""
    model = StandIn()
    batcher = AutoBatcher(model, batch_size=8, timeout=10)
    waiting = [asyncio.ensure_future(batcher.submit(k)) for k in (1, 2, 3)]
    await asyncio.sleep(0)  # queued; the idle flush has not run
    batcher.close("Owner used after close()")
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert [type(r) for r in results] == [RuntimeError] * 3
    assert {str(r) for r in results} == {"Owner used after close()"}
    assert not any(task.cancelled() for task in waiting)
    assert model.batches == []
    with pytest.raises(RuntimeError, match=r"^Owner used after close\(\)$"):
        await batcher.submit(4)


async def test_closing_from_another_thread_answers_queued_callers_on_their_loop():
    """A close from another thread (an owner closed in ``asyncio.to_thread``) answers the
    queued callers through their loop: they wake up at once rather than hang."""
    batcher = AutoBatcher(StandIn(), batch_size=8, timeout=10)
    waiting = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0)
    closing = threading.Thread(target=batcher.close, args=("closed elsewhere",))
    closing.start()
    closing.join()  # the loop waits here, before its idle flush
    with pytest.raises(RuntimeError, match="^closed elsewhere$"):
        await first_of(waiting, 5)


async def test_a_pause_cancels_queued_callers_and_serves_again():
    model = StandIn()
    batcher = AutoBatcher(model, batch_size=8, timeout=10)
    queued = asyncio.ensure_future(batcher.submit(5))
    await asyncio.sleep(0)
    batcher.pause()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert await batcher.submit(6) == 36 and model.batches == [[6]]


async def produce(batcher, first, done):
    """Queue two new keys (from ``first`` on) every turn of the loop until ``done()``: the
    idle flush never finds the queue settled, so only the size or the timeout flushes.
    Returns the callers and the number of batches formed while producing."""
    callers, key = [], first
    while not done():
        callers += [asyncio.ensure_future(batcher.submit(k)) for k in (key, key + 1)]
        key += 2
        await asyncio.sleep(0)
    return callers, batcher.num_batches


async def test_an_assigned_timeout_flushes_a_queue_that_keeps_growing():
    batcher = AutoBatcher(StandIn(), batch_size=100_000, timeout=None)
    turns = iter(range(300))
    callers, formed = await produce(batcher, 0, lambda: next(turns, None) is None)
    assert formed == 0  # no timeout, no full batch: it waits for the loop to settle
    assert await asyncio.gather(*callers) == [k * k for k in range(len(callers))]
    assert batcher.num_batches == 1
    batcher.timeout = 0.01
    deadline = time.monotonic() + 60
    callers, formed = await produce(
        batcher, 10**6, lambda: batcher.num_batches >= 3 or time.monotonic() > deadline
    )
    assert formed >= 3  # fired by the timeout while the queue kept growing
    await asyncio.gather(*callers)


def test_batch_size_and_timeout_are_checked_when_assigned():
    batcher = AutoBatcher(StandIn(), batch_size=4, timeout=0.5)
    for name, bad, error in [
        ("batch_size", 0, ValueError),
        ("batch_size", 1.5, TypeError),
        ("timeout", -1, ValueError),
        ("timeout", float("nan"), ValueError),
    ]:
        with pytest.raises(error, match=name):
            setattr(batcher, name, bad)
    assert (batcher.batch_size, batcher.timeout) == (4, 0.5)

"""`AutoBatcher`: turns many concurrent awaits into few batched model calls.

Every backend (and the async trie) funnels its requests through one of these.
Callers ``await batcher.submit(key)``; the batcher

- collects concurrent requests and flushes a batch as soon as it is full
  (``batch_size``) or the event loop has nothing else ready to run, so there is
  no fixed wait when every particle has already asked; ``timeout`` (seconds,
  timed from the first queued request) bounds the wait when the loop stays busy;
- computes each distinct key once per batch (identical prefixes are deduplicated); a
  key's second and later callers get copies of its result, made by ``copy_results`` in
  one call for the batch (results that are not copied, such as ints, are shared), so that
  each caller's result is its own;
- runs ``process_batch`` in a worker thread, one batch at a time, so the next
  batch gathers while the current one computes (torch releases the GIL);
- delivers a failure to every caller of the failed batch and keeps serving; a result
  that is an exception instance fails only that key's callers; a cancelled caller never
  disturbs the others;
- `pause` stops the worker (queued callers get ``CancelledError``, as from `reset`; the
  next call starts a new one); `close` stops it for good: queued and later callers get
  its owner's ``RuntimeError`` saying it was closed, never a cancellation they did not
  ask for;
- works from successive event loops (``asyncio.run`` twice); a second event loop
  running at the same time (another thread) gets a clear ``RuntimeError``, never a hang;
- keeps bounded statistics: ``num_batches``, ``num_requests`` and the sizes of the
  last ``STATS_WINDOW`` batches (``batch_sizes``).

``process_batch(keys) -> results`` receives distinct keys and returns one result
per key, in order (a list, or anything indexable such as a ``[B, V]`` tensor).
``AutoBatcher[K, R]`` is generic: keys of type ``K``, one ``R`` per awaited key.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar

from genlm.backend.checks import check_batching, check_int, check_seconds

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class BatchResults(Protocol[R_co]):
    """What ``process_batch`` returns: ``len`` and one result per index (a list, a
    ``[B, V]`` tensor or array)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> R_co: ...


class AutoBatcher(Generic[K, R]):
    """Batch concurrent requests (keys ``K``) for a synchronous batched function (one
    ``R`` per key)."""

    STATS_WINDOW = 1000

    def __init__(
        self,
        process_batch: Callable[[list[K]], BatchResults[R]],
        batch_size: int = 20,
        timeout: float | None = 0.02,
        name: str = "genlm-batcher",
        copy_results: Callable[[list[R]], Sequence[R]] | None = None,
    ):
        check_batching(batch_size, timeout)
        self.process_batch = process_batch
        self.copy_results = copy_results
        self._batch_size = int(batch_size)
        self._timeout = None if timeout is None else float(timeout)
        self.name = name
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._closed_message: str | None = None  # closed for good: what every call is told
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[K, list[asyncio.Future[R]]] = {}
        self._reset_loop_state()
        self.batch_sizes: deque[int] = deque(maxlen=self.STATS_WINDOW)
        self.num_batches = 0
        self.num_requests = 0

    @property
    def batch_size(self) -> int:
        """Most distinct keys per batch; assigning it (checked as the constructor checks it)
        changes the batches formed after it: a queue that reaches it flushes."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        check_int("batch_size", value, minimum=1)
        self._batch_size = int(value)

    @property
    def timeout(self) -> float | None:
        """Longest wait (seconds) from the first queued request while the loop stays busy;
        assigning it (checked as the constructor checks it) applies from the next
        request that finds the queue empty."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        check_seconds("timeout", value)
        self._timeout = None if value is None else float(value)

    def _reset_loop_state(self) -> None:
        self._pending = {}
        self._idle_handle: asyncio.Handle | None = None
        self._idle_late = False  # requests came after the idle flush was scheduled
        self._timer_handle: asyncio.TimerHandle | None = None
        self._deadline_passed = False
        self._busy = False

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if (
            loop is not self._loop
            and self._loop is not None
            and self._loop.is_running()
            and (self._pending or self._busy)
        ):
            raise RuntimeError(
                f"{self.name}: this object is already serving requests on another running "
                "event loop (another thread). Use it from one event loop at a time, or "
                "create one per thread"
            )
        if loop is not self._loop:
            # A new event loop (e.g. a second asyncio.run): whatever was queued on the
            # old one can never be delivered, so start afresh.
            self._loop = loop
            self._reset_loop_state()
        return loop

    async def submit(self, key: K) -> R:
        """Queue ``key`` and wait for its result."""
        if self._closed_message is not None:
            raise RuntimeError(self._closed_message)
        loop = self._bind_loop()
        future: asyncio.Future[R] = loop.create_future()
        waiters = self._pending.setdefault(key, [])
        waiters.append(future)
        if len(self._pending) >= self._batch_size:
            self._maybe_flush(full=True)
        else:
            if len(self._pending) == 1 and len(waiters) == 1 and self._timeout is not None:
                self._cancel_timer()
                self._timer_handle = loop.call_later(self._timeout, self._on_timeout)
            self._schedule_idle_flush(loop)
        return await future

    def _schedule_idle_flush(self, loop: asyncio.AbstractEventLoop) -> None:
        # Every new request pushes the flush to the back of the ready queue: it runs
        # only once all callbacks that were ready (other particles) have had their turn.
        # One handle serves them all: a request that comes after it was scheduled marks it
        # late, and a late flush goes to the back once more when its turn comes
        # (`_on_idle`), instead of a cancelled handle and a new one per request.
        if self._idle_handle is None:
            self._idle_handle = loop.call_soon(self._on_idle, loop)
            self._idle_late = False
        else:
            self._idle_late = True

    def _on_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._idle_late:
            self._idle_late = False
            self._idle_handle = loop.call_soon(self._on_idle, loop)
            return
        self._maybe_flush()

    def _on_timeout(self) -> None:
        self._timer_handle = None
        self._deadline_passed = True
        self._maybe_flush(full=True)

    def _cancel_timer(self) -> None:
        if self._timer_handle is not None:
            self._timer_handle.cancel()
            self._timer_handle = None

    def _maybe_flush(self, full: bool = False) -> None:
        if not full:
            self._idle_handle = None
        if self._busy:
            return  # flushed again when the running batch finishes
        batch = self._take_batch()
        if not batch:
            return
        self._busy = True
        self.batch_sizes.append(len(batch))
        self.num_batches += 1
        self.num_requests += len(batch)
        keys = list(batch)
        assert self._loop is not None  # bound by submit, which queued the batch
        try:
            work = self._loop.run_in_executor(self._get_executor(), self.process_batch, keys)
        except RuntimeError as error:  # closed for good, or the worker shut down under us
            work = self._loop.create_future()
            work.set_exception(error)
        work.add_done_callback(lambda done: self._deliver(batch, done))

    def _take_batch(self) -> dict[K, list[asyncio.Future[R]]]:
        """The next batch's keys and their callers still waiting (a caller's future is done
        once it cancelled), at most ``batch_size`` keys in arrival order: the whole queue
        when it fits (the usual flush, with no key hashed again), else its first keys."""
        batch: dict[K, list[asyncio.Future[R]]]
        if len(self._pending) <= self._batch_size:
            batch, self._pending = self._pending, {}
            if any(f.done() for waiters in batch.values() for f in waiters):
                batch = {key: live for key, waiters in batch.items() if (live := _waiting(waiters))}
        else:
            batch = {}
            for key in list(self._pending):
                waiters = _waiting(self._pending.pop(key))
                if waiters:
                    batch[key] = waiters
                if len(batch) == self._batch_size:
                    break
        if not self._pending:
            self._cancel_timer()
            self._deadline_passed = False
            if self._idle_handle is not None:
                self._idle_handle.cancel()
                self._idle_handle = None
        return batch

    def _deliver(
        self, batch: dict[K, list[asyncio.Future[R]]], done: asyncio.Future[BatchResults[R]]
    ) -> None:
        self._busy = False
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        if error is None:
            results = done.result()
            if len(results) != len(batch):
                error = RuntimeError(
                    f"{self.name}: process_batch returned {len(results)} results "
                    f"for {len(batch)} requests"
                )
        copies: list[tuple[asyncio.Future[R], R]] = []  # later callers of a key
        for i, waiters in enumerate(batch.values()):
            waiting = [future for future in waiters if not future.done()]
            if not waiting:
                continue
            result = error if error is not None else results[i]
            if isinstance(result, BaseException):
                for future in waiting:
                    future.set_exception(result)
                continue
            waiting[0].set_result(result)
            copies += ((future, result) for future in waiting[1:])
        if copies:
            self._deliver_copies(copies)
        if self._pending:
            # Callers just answered usually ask again at once: give them one turn of
            # the loop to join the next batch, unless that batch is already due.
            if len(self._pending) >= self._batch_size or self._deadline_passed:
                self._maybe_flush(full=True)
            elif self._loop is not None:
                self._schedule_idle_flush(self._loop)

    def _deliver_copies(self, copies: list[tuple[asyncio.Future[R], R]]) -> None:
        """Give each later caller of a key a copy of its result (`copy_results`, one call
        for all), or the result itself where results are not copied; a copy that fails
        fails those callers."""
        results = [result for _, result in copies]
        try:
            made = results if self.copy_results is None else self.copy_results(results)
        except Exception as error:  # noqa: BLE001 - delivered to the callers it concerns
            for future, _ in copies:
                future.set_exception(error)
            return
        for (future, _), copy in zip(copies, made, strict=True):
            future.set_result(copy)

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._closed_message is not None:
                raise RuntimeError(self._closed_message)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
            return self._executor

    def reset(self) -> None:
        """Drop queued (not yet running) requests; their callers get ``CancelledError``."""
        self._drop_queued(None)

    def _drop_queued(self, message: str | None) -> None:
        """Drop queued requests: their callers get ``RuntimeError(message)``, or
        ``CancelledError`` for None. From another thread than the running loop's, the
        callers are answered on that loop's thread (a future is not thread-safe)."""
        pending, self._pending = self._pending, {}
        self._cancel_timer()
        self._deadline_passed = False
        if self._idle_handle is not None:
            self._idle_handle.cancel()
            self._idle_handle = None
        loop = self._loop
        if loop is not None and loop.is_running() and not _running(loop):
            loop.call_soon_threadsafe(_answer_dropped, pending, message)
        else:
            _answer_dropped(pending, message)

    def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the worker thread and wait, serialising it with batches."""
        return self._get_executor().submit(fn, *args).result()

    def pause(self) -> None:
        """Drop queued requests (their callers get ``CancelledError``, as from `reset`) and
        stop the worker thread once the running batch is done; a new worker starts if the
        batcher is used again."""
        self._stop(self._closed_message)

    def close(self, message: str | None = None) -> None:
        """`pause` for good: queued callers, and every later call, get
        ``RuntimeError(message)`` (default: the batcher's own, naming it), so that a call
        racing its owner's close never runs on what the close freed, and a caller waiting
        at the close learns why, not that it was cancelled."""
        if self._closed_message is None:
            self._closed_message = message or f"{self.name}: used after its owner was closed"
        self._stop(self._closed_message)

    def _stop(self, message: str | None) -> None:
        self._drop_queued(message)
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def _answer_dropped(pending: dict[Any, list[asyncio.Future[Any]]], message: str | None) -> None:
    for waiters in pending.values():
        for future in waiters:
            if future.done():
                continue
            if message is None:
                future.cancel()
            else:
                future.set_exception(RuntimeError(message))


def _running(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is the loop running in this thread."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _waiting(futures: list[asyncio.Future[R]]) -> list[asyncio.Future[R]]:
    """The futures whose callers still wait (not cancelled, not answered)."""
    return [future for future in futures if not future.done()]

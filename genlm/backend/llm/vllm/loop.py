"""The event loop that drives a vLLM engine, on its own thread, wherever the caller runs
(`genlm.backend.llm.vllm.handle` says why the engine needs one).

`EngineLoop.run` never waits on a loop whose thread has ended, takes an optional time
limit, and `EngineLoop.cancel_running` ends the calls in flight, so closing a backend
never waits on a wedged engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)

# How often (seconds) a caller waiting on the loop checks that its thread still runs.
LIVENESS_CHECK = 1.0
# Longest wait (seconds) for the loop's remaining tasks to end when it is closed.
LOOP_CLOSE_TIMEOUT = 10.0


class EngineLoopClosedError(RuntimeError):
    """The engine's loop stopped, or was closed, while a call waited on it."""


class EngineLoop:
    """An asyncio event loop on a daemon thread, shared by every wrapper of one engine."""

    def __init__(self, name: str = "genlm-vllm-engine"):
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._running: set[concurrent.futures.Future] = set()
        self._running_lock = threading.Lock()
        self._abandoned = False
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the loop still runs calls (not once `abandon` gave up on it)."""
        return self._thread.is_alive() and not self.loop.is_closed() and not self._abandoned

    def abandon(self) -> None:
        """Give up on a loop whose thread is stuck in a call that never returns (an engine's
        shutdown): the calls in flight end, the loop is asked to stop once that call
        returns, and nobody waits for it (its thread is a daemon)."""
        self._abandoned = True
        self.cancel_running()
        self.loop.call_soon_threadsafe(self.loop.stop)

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run ``coroutine`` on the loop and wait for its result (from any other thread).

        Raises `EngineLoopClosedError` if the loop stops or is closed before the result
        comes (or `cancel_running` ends the call), and ``TimeoutError`` after ``timeout``
        seconds (the coroutine is cancelled).
        """
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError(f"{self.name}: run() called on the loop's own thread")
        if not self.alive:
            coroutine.close()
            raise EngineLoopClosedError(f"{self.name}: the engine's event loop is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        with self._running_lock:
            self._running.add(future)
        try:
            return self._wait(future, timeout)
        finally:
            with self._running_lock:
                self._running.discard(future)

    def _wait(self, future: concurrent.futures.Future, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = LIVENESS_CHECK if deadline is None else deadline - time.monotonic()
            concurrent.futures.wait([future], timeout=max(0.0, min(left, LIVENESS_CHECK)))
            if future.done():
                try:
                    return future.result()
                except concurrent.futures.CancelledError:
                    raise EngineLoopClosedError(
                        f"{self.name}: the call was cancelled (the engine is closing)"
                    ) from None
            if not self.alive:
                future.cancel()
                raise EngineLoopClosedError(
                    f"{self.name}: the engine's event loop stopped before the call ended"
                )
            if deadline is not None and time.monotonic() >= deadline:
                future.cancel()
                raise TimeoutError(f"{self.name}: the call did not end within {timeout:g} s")

    def cancel_running(self) -> None:
        """Cancel every call in flight; their callers get `EngineLoopClosedError`."""
        with self._running_lock:
            running = list(self._running)
        for future in running:
            future.cancel()

    def close(self) -> None:
        """Cancel the loop's remaining tasks, stop it and its thread (idempotent; waits at
        most about `LOOP_CLOSE_TIMEOUT` seconds)."""
        if self.loop.is_closed() or self._abandoned:
            return
        self.cancel_running()
        if self._thread.is_alive():
            try:
                self.run(_cancel_other_tasks(), timeout=LOOP_CLOSE_TIMEOUT)
            except (TimeoutError, EngineLoopClosedError):
                logger.warning("%s: tasks still running when its loop closed", self.name)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(LOOP_CLOSE_TIMEOUT)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_other_tasks() -> None:
    """Cancel every task of the running loop but this one, and wait until they end."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)

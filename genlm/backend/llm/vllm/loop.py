"""The event loop that drives a vLLM engine, on its own thread, and the engine's handle.

vLLM's ``AsyncLLM`` binds its output handler (the task that moves outputs from the engine
core to the requests waiting for them) to one asyncio loop: the loop running where the
engine is built, or else the loop of its first request. An engine built inside a running
loop (``async def main()`` under ``asyncio.run``, any Jupyter cell) therefore has its
handler on the caller's loop, while the backend's requests run on the `EngineLoop`: their
outputs are put on queues from the wrong thread, nothing wakes the loop that waits for
them, and every step waits forever. So `start_engine` builds the engine on its
`EngineLoop`, inside that running loop: the handler lives there whatever the caller's
thread or loop, and an engine built elsewhere with its handler on another loop is refused
(`engine_handle`) instead of hanging. Every wrapper of one engine shares its
`EngineHandle`: that loop and the engine's `Sessions`. `EngineLoop.run` never waits on a
loop whose thread has ended and takes a time limit, so closing never waits on a wedged engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from genlm.backend.llm.vllm.sessions import Sessions
from genlm.backend.llm.vllm.shm import remove_left_behind, watch_shared_memory

logger = logging.getLogger(__name__)

# How often (seconds) a caller waiting on the loop checks that its thread still runs.
LIVENESS_CHECK = 1.0
# Longest wait (seconds) for the loop's remaining tasks to end when it is closed.
LOOP_CLOSE_TIMEOUT = 10.0
# Longest waits (seconds) of `EngineHandle.stop`: for the sessions to close; for the
# engine's processes to stop (vLLM kills them after that); and for vLLM's shutdown call to
# return after that. So `AsyncVirtualLM.close` returns within about `CLOSE_TIMEOUT`
# seconds, even when vLLM's shutdown never returns.
SESSIONS_CLOSE_TIMEOUT = 10.0
ENGINE_SHUTDOWN_TIMEOUT = 30.0
SHUTDOWN_GRACE = 5.0
CLOSE_TIMEOUT = SESSIONS_CLOSE_TIMEOUT + ENGINE_SHUTDOWN_TIMEOUT + SHUTDOWN_GRACE


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


class EngineHandle:
    """What every wrapper of one engine shares: the `EngineLoop` that drives it and its
    `Sessions` (so their budget is the engine's), made together by `engine_handle`."""

    def __init__(self, engine: Any, loop: EngineLoop):
        try:
            self.sessions = Sessions(engine)
        except BaseException:
            loop.close()  # an engine whose limits cannot be read: nothing left running
            raise
        self.engine = engine
        self.loop = loop
        watch_shared_memory(engine)

    def stop(self) -> None:
        """Close the sessions, shut the engine down, then stop the loop and drop this
        handle from `engine_handle`'s registry, in at most `CLOSE_TIMEOUT` seconds (vLLM
        kills engine processes still running after `ENGINE_SHUTDOWN_TIMEOUT`). A shutdown
        call that has not returned by then holds the loop's thread: the loop is abandoned,
        not waited for. Within the same time, the shared memory of engine processes that
        died uncleanly is removed once they have all exited (`genlm.backend.llm.vllm.shm`)."""
        if not self.loop.alive:
            return  # stopped already, through another wrapper of the same engine
        try:
            self.loop.run(self.sessions.close(), timeout=SESSIONS_CLOSE_TIMEOUT)
        except (TimeoutError, EngineLoopClosedError) as error:
            logger.warning("vLLM sessions not closed before shutdown: %s", error)
        stuck = False
        deadline = time.monotonic() + ENGINE_SHUTDOWN_TIMEOUT + SHUTDOWN_GRACE
        try:
            self.loop.run(
                _call(functools.partial(self.engine.shutdown, timeout=ENGINE_SHUTDOWN_TIMEOUT)),
                timeout=ENGINE_SHUTDOWN_TIMEOUT + SHUTDOWN_GRACE,
            )
        except TimeoutError as error:
            stuck = True
            logger.warning("vLLM engine shutdown did not return; left behind: %s", error)
        except EngineLoopClosedError as error:
            logger.warning("vLLM engine shutdown did not finish: %s", error)
        finally:
            _forget(self)
            if stuck:
                self.loop.abandon()
            else:
                self.loop.close()
            remove_left_behind(self.engine, deadline)


async def _call(fn: Callable[[], Any]) -> Any:
    """``fn()``, called inside the running loop (where loop-bound objects bind)."""
    return fn()


_HANDLES: weakref.WeakKeyDictionary[Any, EngineHandle] = weakref.WeakKeyDictionary()
_HANDLES_LOCK = threading.Lock()


def start_engine(factory: Callable[[], Any]) -> Any:
    """The engine ``factory()`` builds, built on a new `EngineLoop`'s thread inside its
    running loop, which then drives it (see the module doc)."""
    loop = EngineLoop()
    try:
        engine = loop.run(_call(factory))
    except BaseException:
        loop.close()
        raise
    with _HANDLES_LOCK:
        _HANDLES[engine] = EngineHandle(engine, loop)
    return engine


def engine_handle(engine: Any) -> EngineHandle:
    """The one `EngineHandle` of ``engine`` (made on first use, and anew once its loop has
    stopped). Raises ``ValueError``, before any loop starts, for an engine (a vLLM
    ``AsyncLLM``) that handles its outputs on another loop: built inside a running event
    loop, it would never answer."""
    with _HANDLES_LOCK:
        handle = _HANDLES.get(engine)
        if handle is not None and not handle.loop.alive:
            handle = None
        handler = getattr(engine, "output_handler", None)
        if isinstance(handler, asyncio.Future) and (
            handle is None or handler.get_loop() is not handle.loop.loop
        ):
            raise ValueError(
                "This vLLM engine was built while an event loop was running (inside async code "
                "or a notebook cell), so its output handler runs on that loop and requests from "
                "AsyncVirtualLM would never be answered. Build it with AsyncVirtualLM.from_name, "
                "which starts the engine on its own loop, or outside any running event loop."
            )
        if handle is None:
            handle = _HANDLES[engine] = EngineHandle(engine, EngineLoop())
    return handle


def _forget(handle: EngineHandle) -> None:
    """Drop ``handle`` from the registry (stopped: its engine gets a new one if used again;
    the entry would otherwise keep the engine alive, as the handle refers to it)."""
    with _HANDLES_LOCK:
        if _HANDLES.get(handle.engine) is handle:
            del _HANDLES[handle.engine]

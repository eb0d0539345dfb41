"""One vLLM engine's handle: the loop that drives it and its sessions, shared by every
wrapper of the engine; how the engine starts on that loop, and how it stops.

vLLM's ``AsyncLLM`` binds its output handler (the task that moves outputs from the engine
core to the requests waiting for them) to one asyncio loop: the loop running where the
engine is built, or else the loop of its first request. An engine built inside a running
loop (``async def main()`` under ``asyncio.run``, any Jupyter cell) therefore has its
handler on the caller's loop, while the backend's requests run on the `EngineLoop`: their
outputs are put on queues from the wrong thread, nothing wakes the loop that waits for
them, and every step waits forever. So `start_engine` builds the engine on its
`EngineLoop`, inside that running loop: the handler lives there whatever the caller's
thread or loop, and an engine built elsewhere with its handler on another loop is refused
(`check_output_handler`) instead of hanging.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from genlm.backend.llm.vllm.loop import EngineLoop, EngineLoopClosedError
from genlm.backend.llm.vllm.sessions import Sessions

logger = logging.getLogger(__name__)

# Longest waits (seconds) of `EngineHandle.stop`: for the sessions to close; for the
# engine's processes to stop (vLLM kills them after that); and for vLLM's shutdown call to
# return after that. So `AsyncVirtualLM.close` returns within about `CLOSE_TIMEOUT`
# seconds, even when vLLM's shutdown never returns.
SESSIONS_CLOSE_TIMEOUT = 10.0
ENGINE_SHUTDOWN_TIMEOUT = 30.0
SHUTDOWN_GRACE = 5.0
CLOSE_TIMEOUT = SESSIONS_CLOSE_TIMEOUT + ENGINE_SHUTDOWN_TIMEOUT + SHUTDOWN_GRACE


class EngineHandle:
    """What every wrapper of one engine shares: the `EngineLoop` that drives it and its
    `Sessions` (so their budget is the engine's), made together by `engine_handle`."""

    def __init__(self, engine: Any, loop: EngineLoop):
        self.engine = engine
        self.loop = loop
        self.sessions = Sessions(engine)

    def stop(self) -> None:
        """Close the sessions, shut the engine down, then stop the loop, in at most
        `CLOSE_TIMEOUT` seconds (vLLM kills engine processes still running after
        `ENGINE_SHUTDOWN_TIMEOUT`). A shutdown call that has not returned by then holds the
        loop's thread: the loop is abandoned, not waited for."""
        if not self.loop.alive:
            return  # stopped already, through another wrapper of the same engine
        try:
            self.loop.run(self.sessions.close(), timeout=SESSIONS_CLOSE_TIMEOUT)
        except (TimeoutError, EngineLoopClosedError) as error:
            logger.warning("vLLM sessions not closed before shutdown: %s", error)
        stuck = False
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
            close_engine_loop(self.engine, abandon=stuck)


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
    stopped; an engine whose output handler runs on another loop is refused, see
    `check_output_handler`)."""
    with _HANDLES_LOCK:
        handle = _HANDLES.get(engine)
        if handle is None or not handle.loop.alive:
            handle = _HANDLES[engine] = EngineHandle(engine, EngineLoop())
    check_output_handler(engine, handle.loop)
    return handle


def check_output_handler(engine: Any, loop: EngineLoop) -> None:
    """Raise ``ValueError`` if ``engine`` (a vLLM ``AsyncLLM``) handles its outputs on
    another loop than ``loop``: built inside a running event loop, it would never answer."""
    handler = getattr(engine, "output_handler", None)
    if isinstance(handler, asyncio.Future) and handler.get_loop() is not loop.loop:
        raise ValueError(
            "This vLLM engine was built while an event loop was running (inside async code or "
            "a notebook cell), so its output handler runs on that loop and requests from "
            "AsyncVirtualLM would never be answered. Build it with AsyncVirtualLM.from_name, "
            "which starts the engine on its own loop, or outside any running event loop."
        )


def close_engine_loop(engine: Any, abandon: bool = False) -> None:
    """Stop the loop that drives ``engine``, if there is one (``abandon``: without waiting
    for it, see `EngineLoop.abandon`)."""
    with _HANDLES_LOCK:
        handle = _HANDLES.pop(engine, None)
    if handle is not None:
        if abandon:
            handle.loop.abandon()
        else:
            handle.loop.close()

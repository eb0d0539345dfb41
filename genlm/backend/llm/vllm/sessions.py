"""Particles that live in the vLLM engine: streaming-input sessions over ``AsyncLLM``.

vLLM's v1 engine keeps a request open between inputs (``AsyncLLM.generate`` fed by an
async generator of ``StreamingInput`` chunks): each chunk appends prompt tokens to the
request, whose KV blocks stay in place. A particle's next context (its context plus one
token) is therefore one more chunk: no new request, no re-hash or recompute of its prefix.

`Sessions` runs one step of requests at a time. A request equal to a live session's
context plus one token continues it (one per session per step: other forks open new
sessions, which hit vLLM's prefix cache). Sessions a step does not extend stay paused,
so a particle whose batch comes round again finds its own, within a budget
(`Sessions._budget`) that always leaves a request slot free: room for a new session is
made by closing paused ones, least recently used first, and a request that does not fit
even then runs as an ordinary one-shot request in that slot, so paused sessions can
never deadlock it.

A request with a `PrefixHandle` finds the session it continues in O(1), from the handle
(`SessionLink`: the session its parent's request went through, which the handle inherits as
its ``memo``), and a session that no live handle can continue any more (every handle that
holds its link collected) is closed (`Sessions._unlinked`): particles that die in
resampling let go of their engine requests without a call.

They run on the engine's loop (`genlm.backend.llm.vllm.loop.EngineLoop`). A step
that stops making progress (no output for any of its requests for ``stall_timeout``
seconds: sessions waiting on each other for KV blocks, a request the engine dropped) fails
its callers with `StepStalledError` instead of waiting forever, and so does a step of an
engine that reports itself dead. A request the engine ends early (aborted by other code,
``pause_generation(mode="abort")``, a reset) is not taken for the end of its chunk: the step
fails with `RequestEndedError` at once, rather than passing on a missing row, or leaving a
dead session whose next chunk would never be answered.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Coroutine, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from genlm.backend.llm.handle import PrefixHandle
from genlm.backend.llm.vllm import api

# Longest wait (seconds) for a step's chunks to leave before the held scheduler resumes.
STEP_HOLD_TIMEOUT = 1.0
# Longest time (seconds) a step may go without any output before it fails (the default of
# `Sessions` and `AsyncVirtualLM`): far above any step's pause between two outputs.
STALL_TIMEOUT = 300.0
# How often (seconds) a waiting step asks the engine whether it is dead.
HEALTH_CHECK_INTERVAL = 1.0
# Longest wait (seconds) for requests to let go once cancelled or their sessions closed.
RELEASE_TIMEOUT = 10.0


class StepStalledError(TimeoutError, RuntimeError):
    """A step got no output from the engine for ``stall_timeout`` seconds (a
    ``RuntimeError`` like the other step errors, and a ``TimeoutError``)."""


class RequestEndedError(RuntimeError):
    """The engine ended a request of a step before its output: aborted, or a session
    finished before the chunk it was sent."""


def _finish_reason(output: Any) -> str | None:
    """Why vLLM finished a request (``"abort"``, ``"length"``, ...), None while it runs."""
    completions = getattr(output, "outputs", None) or [None]
    return getattr(completions[0], "finish_reason", None)


def _ended(request_id: str, output: Any) -> RequestEndedError:
    return RequestEndedError(
        f"vLLM ended request {request_id} before its output "
        f"(finish_reason {_finish_reason(output)!r}): "
        "something else aborted it (AsyncLLM.abort, pause_generation(mode='abort'), a reset "
        "of the engine) or the engine dropped it, so this step's callers get this error "
        "rather than a missing row; the next step opens a new session."
    )


@dataclass(frozen=True)
class EngineLimits:
    """What bounds the live sessions: the engine's request slots and KV blocks, and the
    tokens per block, as the running engine reports them (vLLM's engine core picks the block
    size for its attention backend and hardware: 16 on CUDA by default, 128 on CPU)."""

    max_num_seqs: int | None = None
    num_blocks: int | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.block_size is None:
            raise ValueError(
                f"the engine reports {self.num_blocks} KV blocks but no block size "
                "(vllm_config.cache_config.block_size): the sessions' KV budget needs both"
            )

    @classmethod
    def of(cls, engine: Any) -> EngineLimits:
        """Read the limits from an engine's ``vllm_config`` (no limits if it has none)."""
        config = getattr(engine, "vllm_config", None)
        if config is None:
            return cls()
        cache = config.cache_config
        return cls(
            max_num_seqs=config.scheduler_config.max_num_seqs,
            num_blocks=getattr(cache, "num_gpu_blocks", None),
            block_size=getattr(cache, "block_size", None),
        )

    def blocks(self, num_tokens: int) -> int:
        """KV blocks a request of ``num_tokens`` tokens (plus its sampled one) holds; 0
        where the engine reports no KV blocks to budget."""
        if self.block_size is None:
            return 0
        return num_tokens // self.block_size + 1


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One request of a step: a context (a tuple of ids, or a `PrefixHandle`), its adapter,
    its sampling parameters, and ``kind``: what else its chunks must share with a session's
    to continue it (the requester's capture: a session opened with one capture's parameters
    is never continued with another's, which on vLLM 0.32 kills the engine)."""

    token_ids: tuple[int, ...] | PrefixHandle
    lora: str | None
    lora_request: Any
    params: Any
    kind: Hashable = None

    def key(self, context: tuple[int, ...]) -> SessionKey:
        """The key of a session of ``context`` that this request's chunks may continue."""
        return (context, self.lora, self.kind)

    def chunk(self, token_ids: Sequence[int]) -> Any:
        """A streaming-input chunk of ``token_ids`` with this request's parameters."""
        return api.vllm_api().StreamingInput(prompt=_prompt(token_ids), sampling_params=self.params)


def _prompt(token_ids: Sequence[int]) -> dict[str, list[int]]:
    """A token prompt; a fresh list every time, as vLLM extends a session's list in place."""
    return {"prompt_token_ids": list(token_ids)}


# A live session's key: its context, adapter and `StepRequest.kind` (a session of a
# handle's context: the session itself, found through its `SessionLink`).
SessionKey = Hashable


class Session:
    """One streaming-input request: its context grows by one chunk per step.

    ``sent`` is set once the engine has sent the last chunk on to its core: vLLM asks
    the input stream for the next chunk only after sending the previous one. ``context``:
    its ids as a tuple, or None for a handle's (a session keeps no handle alive);
    ``link``: a weak reference to the `SessionLink` of its last chunk's handle, if any.
    """

    def __init__(self, engine: Any, request_id: str, request: StepRequest):
        self.request_id = request_id
        self.lora, self.kind = request.lora, request.kind
        self.context: tuple[int, ...] | None = None
        self.length = 0
        self.link: _LinkRef | None = None
        self._follow(request)
        self.sent = asyncio.Event()
        self._inputs: asyncio.Queue = asyncio.Queue()
        self._inputs.put_nowait(request.chunk(request.token_ids))
        self._outputs = engine.generate(
            self._chunks(), request.params, request_id, lora_request=request.lora_request
        )

    async def _chunks(self) -> Any:
        while (chunk := await self._inputs.get()) is not None:
            yield chunk
            self.sent.set()

    async def next_output(self) -> Any:
        """The engine's output for the chunk sent last. A chunk's output leaves the request
        open; a finished one, an aborted one (even if it looks like a chunk's end) or none
        means the engine ended the session: `RequestEndedError`."""
        try:
            output = await anext(self._outputs)
        except StopAsyncIteration:
            raise _ended(self.request_id, None) from None
        if getattr(output, "finished", False) or _finish_reason(output) == "abort":
            raise _ended(self.request_id, output)
        return output

    def extend(self, request: StepRequest) -> None:
        """Send the request's last token as the next chunk."""
        self.sent.clear()
        self._inputs.put_nowait(request.chunk(request.token_ids[-1:]))
        self._follow(request)

    def _follow(self, request: StepRequest) -> None:
        """Take the request's context as this session's (a handle's: its length alone)."""
        ids = request.token_ids
        self.context = None if isinstance(ids, PrefixHandle) else ids
        self.length = len(ids)

    @property
    def key(self) -> SessionKey:
        return self if self.context is None else (self.context, self.lora, self.kind)

    async def close(self) -> None:
        """End the input stream (the engine frees the request) and drain its outputs."""
        self._inputs.put_nowait(None)
        try:
            async for _ in self._outputs:
                pass
        except Exception:  # noqa: BLE001 (an engine shutting down; nothing to deliver)
            pass


class Sessions:
    """The live sessions of one engine (shared by its wrappers, so the budget is the
    engine's); runs on the engine's loop."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._last_output = 0.0  # loop time of the step's latest output
        self.limits = EngineLimits.of(engine)
        # Live sessions by key (context, adapter, kind), least recently used first.
        self.live: dict[SessionKey, Session] = {}
        self._ids = itertools.count()
        self._background_tasks: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()  # one step at a time, whichever wrapper sends it
        self._hold_steps = True  # see _pause
        # How requests were served: "continued", "opened", "one_shot"; and "closed".
        self.counts: Counter[str] = Counter()

    def _request_id(self) -> str:
        return f"genlm-{id(self):x}-{next(self._ids)}"

    async def step(
        self,
        requests: Sequence[StepRequest],
        one_shot: Sequence[StepRequest] = (),
        stall_timeout: float = STALL_TIMEOUT,
    ) -> list[Any]:
        """One engine output per request, in order: ``requests`` through sessions
        (continued or opened as the policy allows), then ``one_shot`` as ordinary
        requests (samples). A failure closes the step's sessions and is raised; so is
        `StepStalledError` after ``stall_timeout`` seconds without any output."""
        async with self._lock:
            if any(request.lora is not None for request in [*requests, *one_shot]):
                return await self._step_without_sessions([*requests, *one_shot], stall_timeout)
            held = len(requests) > 1 and self._pause()
            try:
                live, tasks = self._send(requests, one_shot)
                if held:
                    await self._all_sent(live, tasks)
            finally:
                resumed = self._background(self.engine.resume_generation()) if held else None
            try:
                if resumed is not None:
                    await self._check_resumed(resumed, tasks, stall_timeout)
                results = await self._results(tasks, stall_timeout)
            except Exception as failure:  # noqa: BLE001 (stalled, the engine died, a request failed)
                self._fail(live, failure)
            self._keep(live)
            return results

    def _send(
        self, requests: Sequence[StepRequest], one_shot: Sequence[StepRequest]
    ) -> tuple[list[Session], list[asyncio.Future]]:
        """Send each request as its session's next chunk, else as a new session while the
        budget allows, else as a one-shot request; then ``one_shot``. The step's sessions,
        and a task per request for its output."""
        claimed = [self._claim(request) for request in requests]
        slots, blocks = self._budget()
        for request, session in zip(requests, claimed, strict=True):
            if session is not None:  # the continued sessions take their room first
                slots, blocks = slots - 1, blocks - self.limits.blocks(len(request.token_ids))
        live: list[Session] = []
        waits: list[Awaitable[Any]] = []
        for request, session in zip(requests, claimed, strict=True):
            need = self.limits.blocks(len(request.token_ids))
            if session is not None:
                self.counts["continued"] += 1
                session.extend(request)
                self._link(session, request)
            elif slots >= 1 and blocks >= need:
                self._make_room(slots - 1, blocks - need)
                slots, blocks = slots - 1, blocks - need
                self.counts["opened"] += 1
                session = Session(self.engine, self._request_id(), request)
                self._link(session, request)
            else:
                self.counts["one_shot"] += 1
                waits.append(self._one_shot(request))
                continue
            live.append(session)
            waits.append(self._output_of(session))
        waits.extend(self._one_shot(request) for request in one_shot)
        return live, [asyncio.ensure_future(wait) for wait in waits]

    def _claim(self, request: StepRequest) -> Session | None:
        """The live session that ``request`` continues (its context but the last token),
        taken out of the table: a handle's through its link, in O(1)."""
        ids = request.token_ids
        if len(ids) < 2:
            return None
        if not isinstance(ids, PrefixHandle):
            return self.live.pop(request.key(ids[:-1]), None)
        link = ids.memo
        if type(link) is not SessionLink or link.length != len(ids) - 1:
            return None
        session = link.session
        if (
            session.link is None
            or session.link() is not link  # continued since, by another handle
            or self.live.get(session) is not session
            or (session.lora, session.kind) != (request.lora, request.kind)
        ):
            return None
        return self.live.pop(session)

    def _link(self, session: Session, request: StepRequest) -> None:
        """Make the session of a handle's request findable from the handle and its
        extensions (`SessionLink`, its ``memo``), and closed once none holds it."""
        handle = request.token_ids
        if not isinstance(handle, PrefixHandle):
            session.link = None
            return
        link = SessionLink(session, len(handle))
        session.link = _LinkRef(link, self._unlinked, session, asyncio.get_running_loop())
        handle.memo = link

    def _unlinked(self, ref: _LinkRef) -> None:
        """(Any thread, when a link is collected) close its session on the engine's loop,
        unless it went on with another handle; nothing if the loop is closed."""
        try:
            ref.loop.call_soon_threadsafe(self._close_unlinked, ref)
        except RuntimeError:  # the loop is closed: the engine's requests went with it
            pass

    def _close_unlinked(self, ref: _LinkRef) -> None:
        session = ref.session()
        if session is not None and session.link is ref and self.live.get(session) is session:
            del self.live[session]
            self.counts["unlinked"] += 1
            self._close_later(session)

    async def _check_resumed(
        self, resumed: asyncio.Future, tasks: Sequence[asyncio.Future], stall_timeout: float
    ) -> None:
        """Raise (the step's tasks cancelled) unless the held scheduler resumed: its answer
        comes long before the step's outputs, and without it they never come."""
        await asyncio.wait([resumed], timeout=stall_timeout)
        lost = resumed.exception() if resumed.done() else _stalled(len(tasks), stall_timeout)
        if lost is not None:
            await _cancel(tasks)
            raise lost

    def _keep(self, live: Sequence[Session]) -> None:
        """File the step's sessions as the most recently used, each replacing a paused
        session of the same key (one session per context is enough)."""
        for session in live:
            stale = self.live.pop(session.key, None)
            if stale is not None:
                self._close_later(stale)
            self.live[session.key] = session

    async def _step_without_sessions(
        self, requests: Sequence[StepRequest], stall_timeout: float
    ) -> list[Any]:
        """Every request as an ordinary one, after closing every live session, one group of
        requests per adapter (the base model counting as one), each after the last.

        For steps with LoRA adapter rows: an adapter's rows never share the engine with a
        session or with another adapter's rows, so each is served by its own weights."""
        await self._close_all()
        self.counts["one_shot"] += len(requests)
        results: list[Any] = [None] * len(requests)
        for lora in dict.fromkeys(request.lora for request in requests):
            group = [i for i, request in enumerate(requests) if request.lora == lora]
            tasks = [asyncio.ensure_future(self._one_shot(requests[i])) for i in group]
            for i, output in zip(group, await self._results(tasks, stall_timeout), strict=True):
                results[i] = output
        return results

    async def _results(self, tasks: Sequence[asyncio.Future], stall_timeout: float) -> list[Any]:
        """Each task's result, in order, once all have ended (else the first one's error).
        Raises (after cancelling the unfinished ones) `StepStalledError` when no output
        comes for ``stall_timeout`` seconds, and the engine's own error as soon as it
        reports itself dead."""
        loop = asyncio.get_running_loop()
        self._last_output = loop.time()
        pending = set(tasks)
        while pending:
            idle = loop.time() - self._last_output
            if idle >= stall_timeout:
                await _cancel(pending)
                raise _stalled(len(tasks), stall_timeout)
            wait = min(stall_timeout - idle, HEALTH_CHECK_INTERVAL)
            _, pending = await asyncio.wait(pending, timeout=wait)
            if pending and getattr(self.engine, "errored", False):
                await _cancel(pending)
                raise self.engine.dead_error
        return [task.result() for task in tasks]

    def _output_marked(self) -> None:
        self._last_output = asyncio.get_running_loop().time()

    async def _output_of(self, session: Session) -> Any:
        output = await session.next_output()
        self._output_marked()
        return output

    def _fail(self, live: Sequence[Session], error: BaseException) -> NoReturn:
        """Close the step's sessions and raise ``error`` to its callers."""
        for session in live:
            self._close_later(session)
        raise error

    def _pause(self) -> bool:
        """Hold the engine's scheduler (keeping every request) while a step's chunks go out.

        Each chunk reaches the engine core as its own message; unheld, the core starts a
        forward pass with the first few and runs the rest in a second one. Held, the
        step is one forward pass. Engines without ``pause_generation(mode="keep")``
        (older vLLM, stand-ins) are not held; neither after a pause fails once.
        """
        pause = getattr(self.engine, "pause_generation", None)
        if not self._hold_steps or pause is None:
            return False
        task = self._background(pause(mode="keep", clear_cache=False))
        task.add_done_callback(self._check_pause)
        return True

    def _check_pause(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._hold_steps = False

    async def _all_sent(self, live: Sequence[Session], tasks: Sequence[asyncio.Future]) -> None:
        """Wait until every session's chunk has gone to the engine core (or an output
        ended early: an error), at most `STEP_HOLD_TIMEOUT` seconds."""
        sent = asyncio.ensure_future(asyncio.gather(*(s.sent.wait() for s in live)))
        await asyncio.wait(
            [sent, *tasks], timeout=STEP_HOLD_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
        )
        sent.cancel()

    def _background(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Future:
        """Run ``coroutine`` without waiting for it (kept referenced until it ends)."""
        task = asyncio.ensure_future(coroutine)
        self._background_tasks.add(task)
        task.add_done_callback(self._forget_task)
        return task

    def _forget_task(self, task: asyncio.Future) -> None:
        self._background_tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved here; a step checks its pause and resume itself

    def _budget(self) -> tuple[int, int]:
        """The request slots and KV blocks sessions may hold: all but one of
        ``max_num_seqs`` (so one-shot requests always find a slot while sessions are
        paused) and half of the engine's blocks; unbounded where the engine says none."""
        slots, blocks = self.limits.max_num_seqs, self.limits.num_blocks
        return (1 << 30 if slots is None else slots - 1, 1 << 30 if blocks is None else blocks // 2)

    def _make_room(self, slots: int, blocks: int) -> None:
        """Close paused sessions, least recently used first, until they fit in ``slots``
        request slots and ``blocks`` KV blocks."""
        while self.live and (
            len(self.live) > slots
            or sum(self.limits.blocks(s.length) for s in self.live.values()) > blocks
        ):
            self._close_later(self.live.pop(next(iter(self.live))))

    async def _one_shot(self, request: StepRequest) -> Any:
        """An ordinary request's final output; `RequestEndedError` if it was aborted."""
        final = None
        request_id = self._request_id()
        outputs = self.engine.generate(
            _prompt(request.token_ids),
            request.params,
            request_id,
            lora_request=request.lora_request,
        )
        async for output in outputs:
            self._output_marked()
            final = output
        if final is None or _finish_reason(final) == "abort":
            raise _ended(request_id, final)
        return final

    def _close_later(self, session: Session) -> None:
        self.counts["closed"] += 1
        self._background(session.close())

    async def close(self) -> None:
        """Close every live session and wait until the engine has let them go."""
        async with self._lock:
            await self._close_all()

    async def _close_all(self) -> None:
        for session in self.live.values():
            self._close_later(session)
        self.live = {}
        if self._background_tasks:
            _, late = await asyncio.wait(list(self._background_tasks), timeout=RELEASE_TIMEOUT)
            await _cancel(late)


class SessionLink:
    """What a handle remembers of the session its request went through (its ``memo``,
    inherited by its extensions): the session, and the length of the handle's context.
    The session holds it weakly (`_LinkRef`): once no handle holds it, the session can
    never be continued, and is closed."""

    __slots__ = ("__weakref__", "length", "session")

    def __init__(self, session: Session, length: int):
        self.session = session
        self.length = length


class _LinkRef(weakref.ref[SessionLink]):
    """A session's weak reference to its `SessionLink`, with the session (weakly: no cycle)
    and the loop its `Sessions` runs on (for the callback, which runs on whichever thread
    drops the link)."""

    __slots__ = ("loop", "session")

    def __new__(
        cls,
        link: SessionLink,
        callback: Callable[[_LinkRef], Any],
        session: Session,
        loop: asyncio.AbstractEventLoop,
    ) -> _LinkRef:
        return super().__new__(cls, link, callback)

    def __init__(
        self,
        link: SessionLink,
        callback: Callable[[_LinkRef], Any],
        session: Session,
        loop: asyncio.AbstractEventLoop,
    ):
        # weakref.ref.__new__ made the reference; its __init__ only checks the arguments
        self.session = weakref.ref(session)
        self.loop = loop


def _stalled(n: int, stall_timeout: float) -> StepStalledError:
    return StepStalledError(
        f"vLLM gave no output for any of this step's {n} requests in {stall_timeout:g} s, "
        "so the step was abandoned: the engine may lack KV cache blocks for the live "
        "sessions (raise its KV space: kv_cache_memory_bytes, VLLM_CPU_KVCACHE_SPACE on CPU, "
        "gpu_memory_utilization), or have stopped answering. If steps legitimately take "
        "longer, raise AsyncVirtualLM's stall_timeout."
    )


async def _cancel(tasks: Collection[asyncio.Future]) -> None:
    """Cancel ``tasks`` and wait (at most `RELEASE_TIMEOUT` seconds) until they end."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=RELEASE_TIMEOUT)

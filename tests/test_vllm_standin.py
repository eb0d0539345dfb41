"""AsyncVirtualLM around a stand-in vLLM engine: everything but the engine, without vllm.

The stand-in mimics ``AsyncLLM.generate`` (one-shot requests and streaming-input
sessions fed chunk by chunk) and the engine-side logits processor's file protocol,
including what makes the mapping hard: requests finish in a shuffled order and a
chunked prefill first writes a wrong row that a later write replaces. Expected
log-probabilities come from the stand-in's own logits function, not from the backend.
"""

import abc
import asyncio
import errno
import gc
import hashlib
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from held_memory import assert_rows_hold_only_themselves

from genlm.backend.llm.vllm import (
    CAPTURE_KEY,
    CAPTURE_PROCESSOR,
    AsyncVirtualLM,
    EngineLogprobsCapture,
    LogitsProcessorCapture,
    defaults,
    engine_options,
    hash_to_int,
    logging_configured,
)
from genlm.backend.llm.vllm import api as api_module
from genlm.backend.llm.vllm import capture as capture_module
from genlm.backend.llm.vllm import loop as vllm_loop
from genlm.backend.llm.vllm.capture import CaptureSpaceError
from genlm.backend.llm.vllm.loop import EngineLoop, EngineLoopClosedError
from genlm.backend.llm.vllm.processor import processor_class
from genlm.backend.llm.vllm.sessions import EngineLimits, StepStalledError


@dataclass
class FakeSamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True
    logprobs: int | None = None
    flat_logprobs: bool = False
    extra_args: dict | None = None
    output_kind: str = "final"


@dataclass(frozen=True)
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class FakeStreamingInput:
    prompt: dict
    sampling_params: FakeSamplingParams


def use_fake_vllm_api(monkeypatch):
    """vLLM's API (``genlm.backend.llm.vllm.api``) as the fakes above, for the stand-in."""
    api = SimpleNamespace(
        SamplingParams=FakeSamplingParams,
        LoRARequest=FakeLoRARequest,
        StreamingInput=FakeStreamingInput,
        DELTA="delta",
    )
    monkeypatch.setattr(api_module, "vllm_api", lambda: api)


@pytest.fixture(autouse=True)
def fake_vllm_api(monkeypatch):
    use_fake_vllm_api(monkeypatch)


def stand_in_logits(prompt, vocab_size):
    """The stand-in model: logits are a pure function of the prompt."""
    seed = int.from_bytes(hashlib.blake2b(repr(tuple(prompt)).encode(), digest_size=4).digest())
    return torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def expected_logprobs(prompt, vocab_size):
    return torch.log_softmax(stand_in_logits(prompt, vocab_size), dim=-1)


class FlatPosition:
    """Like vLLM's FlatLogprobs for one position: sampled token first, then all tokens."""

    def __init__(self, logprobs, order):
        self.token_ids = [int(order[0])] + [int(t) for t in order]
        self.logprobs = [float(logprobs[t]) for t in self.token_ids]


@dataclass
class Request:
    """What the stand-in engine computed: ``kind`` is "open", "extend" or "one_shot"."""

    kind: str
    context: tuple
    params: FakeSamplingParams
    lora: FakeLoRARequest | None


class StandInEngine:
    """Enough of ``vllm.AsyncLLM`` for AsyncVirtualLM, plus a record of every request.

    With ``max_num_seqs`` / ``num_blocks`` it publishes a ``vllm_config`` like vLLM's, and
    counts the sessions open at once (``max_open``).
    """

    def __init__(self, tokenizer, vocab_size, max_num_seqs=None, num_blocks=None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        if max_num_seqs is not None:
            self.vllm_config = SimpleNamespace(
                scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                cache_config=SimpleNamespace(num_gpu_blocks=num_blocks, block_size=4),
            )
        self.requests = []
        self.threads = []
        self.shutdowns = 0
        self.removed_loras = []
        self.prefix_cache_resets = 0
        self.fail_with = None
        self.skip_capture_rows = set()
        self.open_sessions = set()
        self.max_open = 0
        self.rng = random.Random(0)

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self, timeout=None):
        self.shutdowns += 1

    async def remove_lora(self, lora_id):
        self.removed_loras.append(lora_id)

    async def reset_prefix_cache(self):
        self.prefix_cache_resets += 1

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.threads.append(threading.get_ident())
        if isinstance(prompt, dict):
            yield await self._compute(
                "one_shot", tuple(prompt["prompt_token_ids"]), params, lora_request
            )
            return
        self.open_sessions.add(request_id)
        self.max_open = max(self.max_open, len(self.open_sessions))
        try:
            context = ()
            async for chunk in prompt:
                kind = "extend" if context else "open"
                context += tuple(chunk.prompt["prompt_token_ids"])
                yield await self._compute(kind, context, chunk.sampling_params, lora_request)
        finally:
            self.open_sessions.discard(request_id)

    async def _compute(self, kind, context, params, lora):
        self.requests.append(Request(kind, context, params, lora))
        if self.fail_with is not None:
            raise self.fail_with
        for _ in range(self.rng.randrange(4)):  # requests finish in any order
            await asyncio.sleep(0)
        return self._run(context, params)

    def _write_capture(self, target, logits):
        path, row, width = target
        if row in self.skip_capture_rows:
            return
        with open(path, "r+b") as f:
            f.seek(row * width * 4)
            f.write(logits[:width].numpy().astype(np.float32).tobytes())

    def _run(self, prompt, p):
        target = (p.extra_args or {}).get(CAPTURE_KEY)
        logits = stand_in_logits(prompt, self.vocab_size)
        if target is not None:
            # A chunked prefill: the first chunk's row is wrong, the final one replaces it.
            self._write_capture(target, stand_in_logits(prompt[:1], self.vocab_size))
            self._write_capture(target, logits)
        logprobs = None
        if p.logprobs == -1:
            order = torch.randperm(self.vocab_size, generator=torch.Generator().manual_seed(1))
            logprobs = FlatPosition(torch.log_softmax(logits, -1), order)
        tokens = self._sample(prompt, p) if p.temperature > 0 else [int(logits.argmax())]
        return SimpleNamespace(
            prompt_token_ids=list(prompt),
            outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs)],
        )

    def _sample(self, prompt, p):
        generator = torch.Generator()
        generator.manual_seed(p.seed if p.seed is not None else random.getrandbits(32))
        context, tokens = list(prompt), []
        for _ in range(p.max_tokens):
            probs = torch.softmax(stand_in_logits(context, self.vocab_size) / p.temperature, -1)
            token = int(torch.multinomial(probs, 1, generator=generator))
            tokens.append(token)  # vLLM keeps the stop token in token_ids
            if token in p.stop_token_ids:
                break
            context.append(token)
        return tokens


class HoldingStandInEngine(StandInEngine):
    """The stand-in with vLLM's scheduler hold: nothing is computed between
    ``pause_generation(mode="keep")`` and ``resume_generation()``; as in vLLM, a task per
    session takes its chunks as soon as they come. ``events`` records "pause", "resume",
    "chunk" (taken) and "compute" in order; ``pause_error`` / ``resume_error`` make every
    pause / resume raise."""

    def __init__(self, *args, pause_error=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []
        self.pause_error = pause_error
        self.resume_error = None
        self._unpaused = None

    def unpaused(self):
        if self._unpaused is None:  # made on the engine's loop
            self._unpaused = asyncio.Event()
            self._unpaused.set()
        return self._unpaused

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        assert (mode, clear_cache) == ("keep", False)
        if self.pause_error is not None:
            raise self.pause_error
        self.events.append("pause")
        self.unpaused().clear()

    async def resume_generation(self):
        if self.resume_error is not None:
            raise self.resume_error
        self.events.append("resume")
        self.unpaused().set()

    async def generate(self, prompt, params, request_id, lora_request=None):
        if isinstance(prompt, dict):
            async for output in super().generate(prompt, params, request_id, lora_request):
                yield output
            return
        taken = asyncio.Queue()

        async def take_chunks():
            async for chunk in prompt:
                self.events.append("chunk")
                taken.put_nowait(chunk)
            taken.put_nowait(None)

        async def chunks():
            while (chunk := await taken.get()) is not None:
                yield chunk

        taker = asyncio.ensure_future(take_chunks())
        try:
            async for output in super().generate(chunks(), params, request_id, lora_request):
                yield output
        finally:
            taker.cancel()

    async def _compute(self, kind, context, params, lora):
        await self.unpaused().wait()
        self.events.append("compute")
        return await super()._compute(kind, context, params, lora)


def stop_left_running(engine):
    """Teardown: stop the engine's handle if an LM left it running (none once it closed)."""
    handle = vllm_loop._HANDLES.get(engine)
    if handle is not None:
        handle.stop()


@pytest.fixture
def engine(smollm2_tokenizer):
    engine = StandInEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))
    yield engine
    stop_left_running(engine)


@pytest.fixture
def lm(engine):
    return AsyncVirtualLM(engine, LogitsProcessorCapture(), batch_size=8, timeout=0.01)


async def test_each_returned_row_holds_only_itself_not_its_batch(lm):
    """A row a caller keeps holds its own floats, not the step's ``[B, V]`` batch."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8], [1, 2, 3]]
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    assert_rows_hold_only_themselves([*rows, lm.next_token_logprobs_sync([9, 9])], lm.vocab_size)


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]


async def test_batched_logprobs_map_to_their_requests_despite_reordering(lm, engine):
    results = await asyncio.gather(*(lm.next_token_logprobs(p) for p in PROMPTS))
    assert list(lm.batcher.batch_sizes) == [len(PROMPTS)]
    assert [r.kind for r in engine.requests] == ["open"] * len(PROMPTS)
    for prompt, logprobs in zip(PROMPTS, results, strict=True):
        assert logprobs.shape == (lm.vocab_size,)
        assert logprobs.dtype == torch.float32
        torch.testing.assert_close(logprobs, expected_logprobs(prompt, lm.vocab_size))


def test_sync_and_batch_sync_match_the_reference(lm):
    torch.testing.assert_close(
        lm.next_token_logprobs_sync(PROMPTS[0]), expected_logprobs(PROMPTS[0], lm.vocab_size)
    )
    batch = lm.batch_next_token_logprobs_sync(PROMPTS)
    assert batch.shape == (len(PROMPTS), lm.vocab_size)
    for prompt, row in zip(PROMPTS, batch, strict=True):
        torch.testing.assert_close(row, expected_logprobs(prompt, lm.vocab_size))


async def test_engine_logprobs_capture_gives_the_same_rows(engine):
    lm = AsyncVirtualLM(engine, EngineLogprobsCapture())
    results = await asyncio.gather(*(lm.next_token_logprobs(p) for p in PROMPTS))
    for prompt, logprobs in zip(PROMPTS, results, strict=True):
        torch.testing.assert_close(logprobs, expected_logprobs(prompt, lm.vocab_size))
    assert all(r.params.logprobs == -1 and r.params.flat_logprobs for r in engine.requests)


async def step(lm, engine, prompts):
    """One batch of requests: checks every row, returns the kinds of engine requests."""
    before = len(engine.requests)
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    for prompt, row in zip(prompts, rows, strict=True):
        torch.testing.assert_close(row, expected_logprobs(prompt, lm.vocab_size))
    return sorted(r.kind for r in engine.requests[before:])


async def test_one_token_extensions_continue_sessions_and_forks_open_new_ones(lm, engine):
    a, b = [1, 2, 3], [4, 5]
    assert await step(lm, engine, [a, b]) == ["open", "open"]
    # a forks: one child continues a's session, the other opens one; b continues.
    assert await step(lm, engine, [a + [7], a + [8], b + [9]]) == ["extend", "extend", "open"]
    extended = [r for r in engine.requests[-3:] if r.kind == "extend"]
    assert sorted(r.context for r in extended) == [(1, 2, 3, 7), (4, 5, 9)] or sorted(
        r.context for r in extended
    ) == [(1, 2, 3, 8), (4, 5, 9)]
    # Not a one-token extension of a live context: a new session.
    assert await step(lm, engine, [a + [7, 1, 2]]) == ["open"]
    assert len(engine.open_sessions) == 4  # paused sessions stay while the budget allows


async def test_sessions_stay_within_the_engine_slots_and_kv_blocks(smollm2_tokenizer):
    vocab = len(smollm2_tokenizer.get_vocab())
    for max_num_seqs, num_blocks, most in ((4, None, 3), (64, 16, 2)):
        engine = StandInEngine(smollm2_tokenizer, vocab, max_num_seqs, num_blocks)
        lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), batch_size=64, timeout=0.01)
        contexts = [[100 + i] * 9 for i in range(12)]  # 9 tokens: 3 blocks of 4 each
        for token in range(5):
            contexts = [c + [token] for c in contexts]
            kinds = await step(lm, engine, contexts)
            assert len(kinds) == 12 and engine.max_open <= most
        assert kinds.count("extend") == most and kinds.count("one_shot") == 12 - most
        lm.close()
        assert engine.open_sessions == set()
    assert EngineLimits.of(engine) == EngineLimits(64, 16, 4)
    assert EngineLimits.of(object()) == EngineLimits()


async def test_a_failed_step_closes_its_sessions_and_the_next_reopens(lm, engine):
    await step(lm, engine, [[1, 2], [3, 4]])
    engine.fail_with = RuntimeError("engine exploded")
    with pytest.raises(RuntimeError, match="exploded"):
        await lm.next_token_logprobs([1, 2, 5])
    engine.fail_with = None
    assert await step(lm, engine, [[1, 2, 5]]) == ["open"]


async def test_identical_prompts_are_computed_once(lm, engine):
    a, b, c = await asyncio.gather(
        lm.next_token_logprobs([7, 8]),
        lm.next_token_logprobs([7, 8]),
        lm.next_token_logprobs((7, 9)),
    )
    assert torch.equal(a, b)
    assert sorted(r.context for r in engine.requests) == [(7, 8), (7, 9)]


async def test_generate_runs_off_the_event_loop_thread(lm, engine):
    await lm.next_token_logprobs([1, 2])
    assert engine.threads and threading.get_ident() not in engine.threads


async def test_logprob_requests_are_greedy_single_token_and_tagged(lm, engine):
    await lm.next_token_logprobs([1, 2])
    (request,) = engine.requests
    params = request.params
    assert params.output_kind == "delta"
    assert params.max_tokens == 1 and params.temperature == 0.0 and not params.detokenize
    path, row, width = params.extra_args[CAPTURE_KEY]
    assert row == 0 and width == lm.vocab_size


async def test_output_cache_serves_repeats_and_batch_sync_bypasses_it(engine):
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), cache_size=10)
    first = await lm.next_token_logprobs([3, 4])
    assert torch.equal(await lm.next_token_logprobs([3, 4]), first)
    assert torch.equal(lm.next_token_logprobs_sync([3, 4]), first)
    assert len(engine.requests) == 1
    lm.batch_next_token_logprobs_sync([[3, 4]])
    assert len(engine.requests) == 2
    lm.clear_cache()
    await lm.next_token_logprobs([3, 4])
    assert len(engine.requests) == 3


async def test_without_cache_every_call_reaches_the_engine(lm, engine):
    await lm.next_token_logprobs([3, 4])
    await lm.next_token_logprobs([3, 4])
    assert len(engine.requests) == 2


async def test_bad_input_is_rejected_before_the_engine(lm, engine):
    with pytest.raises(ValueError, match="empty"):
        await lm.next_token_logprobs([])
    with pytest.raises(ValueError, match=str(lm.vocab_size)):
        lm.next_token_logprobs_sync([1, lm.vocab_size])
    with pytest.raises(ValueError, match="-1"):
        lm.batch_next_token_logprobs_sync([[1], [-1]])
    with pytest.raises(TypeError, match="1.5"):
        await lm.sample([1, 1.5], 3, [0])
    with pytest.raises(ValueError, match="max_tokens"):
        await lm.sample([1], -1, [0])
    with pytest.raises(ValueError, match="temperature"):
        await lm.sample([1], 2, [0], temperature=0)
    assert engine.requests == []


async def test_an_engine_failure_reaches_every_caller_and_later_requests_are_served(lm, engine):
    engine.fail_with = RuntimeError("engine exploded")
    results = await asyncio.gather(
        *(lm.next_token_logprobs(p) for p in PROMPTS), return_exceptions=True
    )
    assert [str(r) for r in results] == ["engine exploded"] * len(PROMPTS)
    engine.fail_with = None
    torch.testing.assert_close(
        await lm.next_token_logprobs([1, 2, 3]), expected_logprobs([1, 2, 3], lm.vocab_size)
    )


async def test_an_unwritten_capture_row_is_an_error_for_the_batch(lm, engine):
    engine.skip_capture_rows = {1}
    results = await asyncio.gather(
        *(lm.next_token_logprobs(p) for p in PROMPTS[:2]), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) and "rows [1]" in str(r) for r in results)


async def test_sample_stops_at_max_tokens_and_strips_eos(lm, engine):
    tokens = await lm.sample([1, 2], max_tokens=5, eos_token_ids=[], seed=3)
    assert len(tokens) == 5
    eos = tokens[2]
    stopped = await lm.sample([1, 2], max_tokens=5, eos_token_ids=[eos], seed=3)
    assert stopped == tokens[: tokens.index(eos)]
    params = engine.requests[-1].params
    assert engine.requests[-1].kind == "one_shot"
    assert params.ignore_eos and params.stop_token_ids == [eos] and params.seed == 3
    assert await lm.sample([1, 2], max_tokens=0, eos_token_ids=[]) == []


async def test_concurrent_samples_share_one_engine_call_and_seeds_repeat(lm, engine):
    prompts = [[1, 2], [3], [4, 5, 6]]
    first = await lm.batch_sample(prompts, max_tokens=4, eos_token_ids=[], seed=10)
    assert list(lm.batcher.batch_sizes) == [3] and len(engine.requests) == 3
    assert await lm.batch_sample(prompts, max_tokens=4, eos_token_ids=[], seed=10) == first
    assert [len(t) for t in first] == [4, 4, 4]


async def test_unseeded_identical_samples_are_not_merged(lm, engine):
    await asyncio.gather(*(lm.sample([1, 2], 3, []) for _ in range(4)))
    assert list(lm.batcher.batch_sizes) == [4] and len(engine.requests) == 4


async def test_samples_and_logprobs_share_one_generate_call(lm, engine):
    tokens, logprobs = await asyncio.gather(
        lm.sample([9, 9], 2, [], seed=0), lm.next_token_logprobs([9, 8])
    )
    assert list(lm.batcher.batch_sizes) == [2] and len(tokens) == 2
    torch.testing.assert_close(logprobs, expected_logprobs([9, 8], lm.vocab_size))


def test_hash_to_int_is_deterministic_across_processes_and_in_range():
    names = [f"adapter-{i}" for i in range(2000)] + ["", "lora_1", "é"]
    values = [hash_to_int(n) for n in names]
    assert all(1 <= v <= 2**31 - 1 for v in values)
    assert len(set(values)) == len(values)
    code = "from genlm.backend.llm.vllm import hash_to_int; print(hash_to_int('lora_1'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert int(out.stdout) == hash_to_int("lora_1")


@pytest.fixture
def any_adapter_path(monkeypatch):
    """The stand-in engine has no model to check adapters against: any path registers
    (the checks run against the real engine in tests/test_vllm.py)."""
    monkeypatch.setattr(AsyncVirtualLM, "_check_adapter", lambda self, path: path)


@pytest.mark.usefixtures("any_adapter_path")
async def test_lora_requests_are_per_request_and_cached_per_adapter(engine):
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), cache_size=10)
    with pytest.raises(ValueError, match="'a'.*add_new_lora"):
        await lm.next_token_logprobs([1, 2], lora_name="a")
    assert engine.requests == []
    lm.add_new_lora("/adapters/a", "a")
    await asyncio.gather(
        lm.next_token_logprobs([1, 2]), lm.next_token_logprobs([1, 2], lora_name="a")
    )
    assert list(lm.batcher.batch_sizes) == [2]  # one step serves both adapters
    assert [r.context for r in engine.requests] == [(1, 2), (1, 2)]
    loras = {r.lora for r in engine.requests}
    assert loras == {None, FakeLoRARequest("a", hash_to_int("a"), "/adapters/a")}
    lm.set_lora(lora_name="a")
    await lm.next_token_logprobs([1, 2])  # the default is now "a": served from a's cache
    lm.clear_lora()
    await lm.next_token_logprobs([1, 2])  # the base model's cached row
    assert len(engine.requests) == 2
    lm.add_new_lora("/adapters/a2", "a")  # new weights, same name: a's rows dropped
    assert engine.removed_loras == [hash_to_int("a")] and engine.prefix_cache_resets == 1
    await lm.next_token_logprobs([1, 2], lora_name="a")
    assert engine.requests[-1].kind == "one_shot"  # adapter rows never use sessions
    assert engine.requests[-1].lora == FakeLoRARequest("a", hash_to_int("a"), "/adapters/a2")
    lm.remove_lora("a")
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.next_token_logprobs_sync([1, 2], lora_name="a")


@pytest.mark.usefixtures("any_adapter_path")
async def test_a_step_with_adapter_rows_closes_the_sessions_and_runs_every_row_once(engine):
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), batch_size=8, timeout=0.01)
    lm.add_new_lora("/adapters/a", "a")
    await step(lm, engine, [[1, 2], [3, 4]])
    assert len(engine.open_sessions) == 2
    before = len(engine.requests)
    rows = await asyncio.gather(
        lm.next_token_logprobs([1, 2, 5]), lm.next_token_logprobs([3, 4, 6], lora_name="a")
    )
    torch.testing.assert_close(rows[0], expected_logprobs([1, 2, 5], lm.vocab_size))
    assert [r.kind for r in engine.requests[before:]] == ["one_shot", "one_shot"]
    assert engine.open_sessions == set()  # closed before the adapter row ran
    assert await step(lm, engine, [[1, 2, 5, 7], [8, 9]]) == ["open", "open"]


async def test_cleanup_is_idempotent_and_later_calls_raise(lm, engine):
    assert lm.underlying_model is engine
    lm.cleanup()
    lm.cleanup()
    assert engine.shutdowns == 1
    with pytest.raises(RuntimeError, match="after cleanup"):
        await lm.next_token_logprobs([1])
    with pytest.raises(RuntimeError, match="after cleanup"):
        lm.next_token_logprobs_sync([1])
    with pytest.raises(RuntimeError, match="after cleanup"):
        lm.batch_next_token_logprobs_sync([[1]])
    with pytest.raises(RuntimeError, match="after cleanup"):
        await lm.sample([1], 2, [])
    with pytest.raises(RuntimeError, match="after cleanup"):
        lm.underlying_model  # noqa: B018


async def test_context_managers_clean_up(engine):
    with AsyncVirtualLM(engine, LogitsProcessorCapture()) as lm:
        lm.next_token_logprobs_sync([1])
    assert engine.shutdowns == 1
    async with AsyncVirtualLM(engine, LogitsProcessorCapture()) as lm:
        await lm.next_token_logprobs([1])
    assert engine.shutdowns == 2


def test_a_closed_lm_leaves_its_engine_to_the_garbage_collector(smollm2_tokenizer):
    """Closing drops the engine's handle from the registry, which would keep it alive."""
    engine = StandInEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), timeout=0.01)
    lm.next_token_logprobs_sync([1, 2])
    lm.close()
    collected = weakref.ref(engine)
    del lm, engine
    gc.collect()
    assert collected() is None


def test_engine_options_defaults_overrides_and_scale_out():
    opts = engine_options(None, LogitsProcessorCapture())
    assert opts == {
        "enable_prefix_caching": True,
        "disable_log_stats": True,
        "gpu_memory_utilization": 0.9,
        "logits_processors": [CAPTURE_PROCESSOR],
    }
    opts = engine_options(
        {
            "gpu_memory_utilization": 0.5,
            "tensor_parallel_size": 4,
            "pipeline_parallel_size": 2,
            "logits_processors": ["my.module:Proc"],
        },
        LogitsProcessorCapture(),
    )
    assert opts["gpu_memory_utilization"] == 0.5
    assert opts["tensor_parallel_size"] == 4 and opts["pipeline_parallel_size"] == 2
    assert opts["logits_processors"] == ["my.module:Proc", CAPTURE_PROCESSOR]
    assert engine_options({}, EngineLogprobsCapture())["max_logprobs"] == -1


def test_capture_files_are_reused_refilled_and_removed_after_a_failure_or_close(
    lm, engine, tmp_path
):
    lm.logprobs_capture = LogitsProcessorCapture(directory=str(tmp_path))
    lm.batch_next_token_logprobs_sync(PROMPTS)
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    extended = [p + [7] for p in PROMPTS]
    rows = lm.batch_next_token_logprobs_sync(extended)
    assert list(tmp_path.iterdir()) == files  # the same file, rows of this batch
    for prompt, row in zip(extended, rows, strict=True):
        torch.testing.assert_close(row, expected_logprobs(prompt, lm.vocab_size))
    # A row the engine skips is caught although the previous batch wrote that row, and
    # the failed batch's file is removed (its requests might still write to it).
    engine.skip_capture_rows = {1}
    with pytest.raises(RuntimeError, match=r"rows \[1\]"):
        lm.batch_next_token_logprobs_sync(PROMPTS)
    assert list(tmp_path.iterdir()) == []
    engine.skip_capture_rows = set()
    lm.batch_next_token_logprobs_sync(PROMPTS)
    assert len(list(tmp_path.iterdir())) == 1
    lm.close()
    assert list(tmp_path.iterdir()) == []


def room_for_rows(rows, width):
    """A ``posix_fallocate`` for a directory with room for a file of ``rows`` rows alone."""
    fallocate = os.posix_fallocate

    def reserve(fd, offset, length):
        if length > rows * width * 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fallocate(fd, offset, length)

    return reserve


@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="this OS has no posix_fallocate")
async def test_a_batch_whose_new_capture_file_finds_no_room_fails_its_callers_alone(
    lm, engine, tmp_path, monkeypatch
):
    """Files are made as batch sizes first occur: a batch of 4 needs a file of 4 rows where
    only 2 fit, and fails its callers before the engine sees it; the engine serves on."""
    lm.logprobs_capture = LogitsProcessorCapture(directory=str(tmp_path))
    monkeypatch.setattr(os, "posix_fallocate", room_for_rows(2, lm.vocab_size))
    await asyncio.gather(*(lm.next_token_logprobs(p) for p in PROMPTS[:2]))  # a file of 2
    computed = len(engine.requests)
    results = await asyncio.gather(
        *(lm.next_token_logprobs(p + [7]) for p in PROMPTS), return_exceptions=True
    )
    needed = f"{4 * lm.vocab_size * 4:,} bytes"
    assert all(
        isinstance(r, CaptureSpaceError) and str(tmp_path) in str(r) and needed in str(r)
        for r in results
    ), results
    assert len(engine.requests) == computed
    rows = await asyncio.gather(*(lm.next_token_logprobs(p + [7]) for p in PROMPTS[:2]))
    for prompt, row in zip(PROMPTS[:2], rows, strict=True):
        torch.testing.assert_close(row, expected_logprobs(prompt + [7], lm.vocab_size))
    assert len(list(tmp_path.iterdir())) == 1  # the file of 2, reused
    lm.close()


def test_module_imports_without_vllm_and_from_name_names_the_extra():
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None\n"  # behave as if vllm were not installed
        "from genlm.backend.llm.vllm import AsyncVirtualLM\n"
        "from genlm.backend.llm import load_model_by_name\n"
        "for load in (lambda: AsyncVirtualLM.from_name('m'),\n"
        "             lambda: load_model_by_name('m', backend='vllm')):\n"
        "    try:\n"
        "        load()\n"
        "    except ImportError as e:\n"
        '        assert "pip install -e \'" in str(e) and "[vllm]\'" in str(e), e\n'
        "    else:\n"
        "        raise SystemExit('no ImportError')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_without_vllm_on_an_older_python_the_error_names_the_python_vllm_needs(monkeypatch):
    """vLLM's tested releases need Python 3.11: below it the extra installs no vllm."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError) as error:
        AsyncVirtualLM.from_name("m")
    assert "Python 3.11" not in str(error.value) or sys.version_info < (3, 11)
    monkeypatch.setattr(sys, "version_info", (3, 10, 14))
    with pytest.raises(ImportError, match=r"\[vllm\]' on Python 3\.11 or newer"):
        AsyncVirtualLM.from_name("m")


@pytest.mark.parametrize("version", ["0.30.2", "0.11.0+cpu", "unknown"])
def test_a_vllm_older_than_the_floor_is_refused_naming_the_release_needed(monkeypatch, version):

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__=version))
    with pytest.raises(ImportError, match=rf"vllm>=0\.31 .*this is vllm {re.escape(version)}"):
        AsyncVirtualLM.from_name("m")


def test_from_name_rejects_an_unknown_capture():
    with pytest.raises(ValueError, match="processor"):
        AsyncVirtualLM.from_name("m", capture="telepathy")


def test_from_name_fails_at_construction_where_the_workers_rows_cannot_reach_us(fake_vllm):
    """The sampling worker on another machine (no shared /dev/shm): the probe request finds
    its row unwritten, and the engine allows no full-vocabulary logprobs, so from_name
    raises naming the options, and stops the engine; never a hang or a wrong row."""
    fake_vllm.rows_reach_us = False
    with pytest.raises(ValueError, match="do not reach") as error:
        AsyncVirtualLM.from_name("m")
    assert "capture='logprobs'" in str(error.value)
    assert "capture=LogitsProcessorCapture(directory=...)" in str(error.value)
    (engine,) = fake_vllm.built
    assert engine.shutdowns == 1 and len(engine.requests) == 1  # the probe only


async def test_from_name_switches_to_vllm_logprobs_where_rows_cannot_reach_us(fake_vllm, caplog):
    fake_vllm.rows_reach_us = False
    lm = AsyncVirtualLM.from_name("m", engine_opts={"max_logprobs": -1})
    assert isinstance(lm.logprobs_capture, EngineLogprobsCapture)
    assert "capturing with vLLM's logprobs=-1 instead" in caplog.text
    await serves_and_closes(lm)


async def test_from_name_takes_a_capture_with_a_shared_directory(fake_vllm, tmp_path):
    capture = LogitsProcessorCapture(directory=str(tmp_path))
    lm = AsyncVirtualLM.from_name("m", capture=capture)
    assert lm.logprobs_capture is capture
    (engine,) = fake_vllm.built
    assert all(
        r.params.extra_args[CAPTURE_KEY][0].startswith(str(tmp_path)) for r in engine.requests
    )
    await serves_and_closes(lm)


@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="this OS has no posix_fallocate")
@pytest.mark.parametrize("batch_size", [None, 3])
def test_from_name_refuses_a_capture_directory_without_room_before_the_engine_starts(
    fake_vllm, tmp_path, monkeypatch, batch_size
):
    """The file of a full batch (``batch_size`` rows, 20 by default, rounded up to a power
    of two, of the model's vocabulary) is made before the engine starts."""
    monkeypatch.setattr(os, "posix_fallocate", room_for_rows(0, 1))
    capture = LogitsProcessorCapture(directory=str(tmp_path))
    options = {} if batch_size is None else {"batch_size": batch_size}
    with pytest.raises(CaptureSpaceError) as error:
        AsyncVirtualLM.from_name("m", capture=capture, **options)
    rows, width, message = 32 if batch_size is None else 4, fake_vllm.vocab_size, str(error.value)
    assert f"({rows} rows of {width} float32 logits: {rows * width * 4:,} bytes" in message
    assert str(tmp_path) in message and "--shm-size" in message
    assert fake_vllm.built == [] and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux's /proc")
async def test_from_name_moves_a_full_default_directory_to_the_temp_dir_before_the_engine_starts(
    fake_vllm, tmp_path, monkeypatch, caplog
):
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(capture_module, "shared_memory_dir", lambda: str(shm))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    fallocate = os.posix_fallocate

    def shm_is_full(fd, offset, length):
        if os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == str(shm):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", shm_is_full)
    lm = AsyncVirtualLM.from_name("m")
    warnings = [r for r in caplog.records if r.name == capture_module.__name__]
    assert len(warnings) == 1 and f"go to {tmp} " in warnings[0].getMessage()
    (engine,) = fake_vllm.built
    (probe,) = engine.requests
    assert os.path.dirname(probe.params.extra_args[CAPTURE_KEY][0]) == str(tmp)
    await serves_and_closes(lm)
    assert list(shm.iterdir()) == []


async def test_a_context_asked_again_replaces_its_paused_session(lm, engine):
    await step(lm, engine, [[1, 2]])
    assert await step(lm, engine, [[1, 2]]) == ["open"]  # the same position again
    for _ in range(500):  # the replaced session closes in the background
        if len(engine.open_sessions) == 1:
            break
        await asyncio.sleep(0.01)
    assert len(engine.open_sessions) == 1


def held_steps(engine):
    """The engine's events as text: "(" pause, ")" resume, "c" chunk taken, "x" computed."""
    symbols = {"pause": "(", "resume": ")", "chunk": "c", "compute": "x"}
    return "".join(symbols[event] for event in engine.events)


async def test_a_step_holds_the_scheduler_until_all_its_chunks_are_in(smollm2_tokenizer):
    engine = HoldingStandInEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), batch_size=8, timeout=0.01)
    contexts = [[1, 2], [3, 4], [5, 6]]
    for token in range(3):
        assert await step(lm, engine, contexts) == (["open"] * 3 if token == 0 else ["extend"] * 3)
        contexts = [c + [token] for c in contexts]
    assert held_steps(engine) == "(ccc)xxx" * 3
    await step(lm, engine, [[9, 9]])  # a step of one request is not held
    assert held_steps(engine).endswith(")xxxcx")
    lm.close()


async def test_a_failing_held_step_still_resumes_the_engine(smollm2_tokenizer):
    engine = HoldingStandInEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), batch_size=8, timeout=0.01)
    engine.fail_with = RuntimeError("engine exploded")
    with pytest.raises(RuntimeError, match="exploded"):
        await asyncio.gather(lm.next_token_logprobs([1, 2]), lm.next_token_logprobs([3, 4]))
    assert held_steps(engine).startswith("(cc)") and engine.unpaused().is_set()
    engine.fail_with = None
    assert await step(lm, engine, [[1, 2, 5], [3, 4, 6]]) == ["open", "open"]
    lm.close()


async def test_an_engine_that_cannot_pause_is_no_longer_held(smollm2_tokenizer):
    engine = HoldingStandInEngine(
        smollm2_tokenizer,
        len(smollm2_tokenizer.get_vocab()),
        pause_error=TypeError("pause_generation() got an unexpected keyword argument 'mode'"),
    )
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), batch_size=8, timeout=0.01)
    contexts = [[1, 2], [3, 4]]
    for token in range(3):
        await step(lm, engine, contexts)
        contexts = [c + [token] for c in contexts]
    assert "(" not in held_steps(engine) and held_steps(engine).count(")") == 1
    lm.close()


def test_logging_is_left_to_callers_who_configure_it(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    assert not logging_configured({"dtype": "float32"})
    assert logging_configured({"logging_config": object()})
    assert logging_configured({"log_config_file": "logging.json"})
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    assert logging_configured({})
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING")
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "/etc/vllm-logging.json")
    assert logging_configured({})


async def test_a_failed_resume_fails_the_step_instead_of_hanging(smollm2_tokenizer):
    engine = HoldingStandInEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), batch_size=8, timeout=0.01)
    engine.resume_error = RuntimeError("resume lost")
    contexts = [[1, 2], [3, 4]]
    with pytest.raises(RuntimeError, match="resume lost"):
        await asyncio.wait_for(
            asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts)), timeout=10
        )
    assert "x" not in held_steps(engine)  # nothing ran while the engine was held
    engine.resume_error = None
    assert await step(lm, engine, [c + [5] for c in contexts]) == ["open", "open"]
    lm.close()


class OutputHandlerEngine(StandInEngine):
    """The stand-in with vLLM's output handler: results reach requests through one task,
    started (as ``AsyncLLM`` does) on the loop running where the engine is built, else on
    its first request's loop; ``handler_loop`` is that loop."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.output_handler = None
        self._jobs = None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._start_handler()

    def _start_handler(self):
        if self.output_handler is None:
            self._jobs = asyncio.Queue()
            self.output_handler = asyncio.ensure_future(self._handle())

    @property
    def handler_loop(self):
        return self.output_handler.get_loop()

    async def _handle(self):
        while True:
            args, answer = await self._jobs.get()
            answer.set_result(await StandInEngine._compute(self, *args))

    async def _compute(self, *args):
        self._start_handler()
        answer = asyncio.get_running_loop().create_future()
        self._jobs.put_nowait((args, answer))
        return await answer


class FakeEngineArgs(SimpleNamespace):
    """``vllm.AsyncEngineArgs``: the options, and vLLM's defaults of the fields that
    `AsyncVirtualLM.from_name` reads."""

    enable_log_requests = False
    disable_log_stats = False


class FakeV1Processor(abc.ABC):
    """Like vLLM's V1 ``LogitsProcessor``: the V1 runner loads its subclasses only."""

    @abc.abstractmethod
    def apply(self, logits): ...


class FakeV2Processor(abc.ABC):
    """Like ``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor`` (Model Runner V2)."""

    @abc.abstractmethod
    def apply(self, logits, ctx): ...


@pytest.fixture
def fake_vllm(monkeypatch, smollm2_tokenizer):
    """``import vllm`` gives a module whose engine is an `OutputHandlerEngine`, so
    `AsyncVirtualLM.from_name` runs on the stand-in; ``built`` lists the engines,
    ``rows_reach_us = False`` makes their capture write nothing, and ``runner`` ("V1" or
    "V2") is the model runner the engine's config picks, each loading the subclasses of its
    own processor base class (`FakeV1Processor`, `FakeV2Processor`); ``vocab_size`` is the
    model's (``ModelConfig.get_vocab_size``)."""
    built = []
    vocab_size = len(smollm2_tokenizer.get_vocab())
    state = SimpleNamespace(built=built, rows_reach_us=True, runner="V1", vocab_size=vocab_size)

    def engine_config(args):
        model_config = SimpleNamespace(
            logits_processors=getattr(args, "logits_processors", None),
            get_vocab_size=lambda: state.vocab_size,
        )
        return SimpleNamespace(
            args=args, use_v2_model_runner=state.runner == "V2", model_config=model_config
        )

    def from_vllm_config(config, enable_log_requests, disable_log_stats):
        engine = OutputHandlerEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()), 16)
        max_logprobs = getattr(config.args, "max_logprobs", 20)
        engine.vllm_config.model_config = SimpleNamespace(max_logprobs=max_logprobs)
        if not state.rows_reach_us:  # a sampling worker on another machine: no file to write
            engine._write_capture = lambda target, logits: None
        built.append(engine)
        return engine

    module = SimpleNamespace(
        __version__="0.32.0",
        AsyncEngineArgs=FakeEngineArgs,
        AsyncLLMEngine=SimpleNamespace(from_vllm_config=from_vllm_config),
    )
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(api_module, "engine_config", engine_config)
    bases = {
        "vllm.v1.sample.logits_processor": FakeV1Processor,
        "vllm.v1.worker.gpu.sample.logits_processor": FakeV2Processor,
    }
    for name, base in bases.items():
        monkeypatch.setitem(sys.modules, name, SimpleNamespace(LogitsProcessor=base))
    platforms = SimpleNamespace(current_platform=SimpleNamespace(is_cpu=lambda: False))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    processor_class.cache_clear()  # made on the stand-in's base classes
    yield state
    processor_class.cache_clear()


async def serves_and_closes(lm):
    """One batch and one sync request answered right, then a bounded close."""
    prompts = [[1, 2, 3], [4, 5]]
    rows = await asyncio.wait_for(
        asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts)), timeout=10
    )
    for prompt, row in zip(prompts, rows, strict=True):
        torch.testing.assert_close(row, expected_logprobs(prompt, lm.vocab_size))
    row = await asyncio.wait_for(asyncio.to_thread(lm.next_token_logprobs_sync, [6]), 10)
    torch.testing.assert_close(row, expected_logprobs([6], lm.vocab_size))
    await asyncio.wait_for(asyncio.to_thread(lm.close), timeout=10)


class V1OnlyProcessor(FakeV1Processor):
    def apply(self, logits):
        return logits


class V2OnlyProcessor(FakeV2Processor):
    def apply(self, logits, ctx):
        return logits


class OwnCapture:
    """A caller's own capture object, with its own logits processor."""

    def __init__(self, processor):
        self.engine_opts = {"logits_processors": [processor]}

    def batch(self, n, width):
        raise AssertionError("never used: refused before the engine starts")

    def close(self):
        pass


async def test_from_name_under_model_runner_v2_serves_with_the_default_capture(fake_vllm):
    fake_vllm.runner = "V2"
    await serves_and_closes(AsyncVirtualLM.from_name("m"))
    assert len(fake_vllm.built) == 1


@pytest.mark.parametrize(
    "runner, processor, switch",
    [("V2", V1OnlyProcessor, "VLLM_USE_V2_MODEL_RUNNER=0"), ("V1", V2OnlyProcessor, "=1")],
)
@pytest.mark.parametrize("named_by", ["capture", "engine_opts"])
def test_from_name_refuses_a_processor_the_engines_runner_cannot_run_before_it_starts(
    fake_vllm, runner, processor, switch, named_by
):
    """A processor of the caller's (a capture object's, or in engine_opts) that subclasses
    the other runner's base class: refused with the ways out, no engine built, no loop."""
    fake_vllm.runner = runner
    loops = engine_loops()
    options = (
        {"capture": OwnCapture(processor)}
        if named_by == "capture"
        else {"engine_opts": {"logits_processors": [processor]}}
    )
    with pytest.raises(ValueError) as error:
        AsyncVirtualLM.from_name("m", **options)
    message = str(error.value)
    runner_name = {"V1": "V1 model runner", "V2": "Model Runner V2"}[runner]
    assert processor.__name__ in message and runner_name in message
    assert "capture='processor'" in message and "capture='logprobs'" in message
    assert switch in message
    assert fake_vllm.built == [] and engine_loops() <= loops


@pytest.mark.parametrize(
    "name, message",
    [
        ("genlm_no_such_module:Processor", "cannot load the logits processor"),
        ("genlm.backend.llm.vllm.processor:NoSuchClass", "cannot load the logits processor"),
        ("genlm.backend.llm.vllm.processor", "named 'module:qualname'"),
        ("genlm.backend.llm.vllm.processor:CAPTURE_KEY", "cannot run on this vLLM engine"),
    ],
)
def test_from_name_refuses_a_processor_name_that_loads_no_class(fake_vllm, name, message):
    with pytest.raises(ValueError, match=message):
        AsyncVirtualLM.from_name("m", engine_opts={"logits_processors": [name]})
    assert fake_vllm.built == []


def test_an_engine_with_kv_blocks_but_no_block_size_is_refused(smollm2_tokenizer):
    """The KV budget of the sessions needs the engine's own block size; none is assumed."""
    engine = StandInEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()), 8, 16)
    engine.vllm_config.cache_config.block_size = None
    loops = engine_loops()
    with pytest.raises(ValueError, match="16 KV blocks but no block size"):
        AsyncVirtualLM(engine, LogitsProcessorCapture())
    assert engine_loops() <= loops
    assert EngineLimits(max_num_seqs=8).blocks(1000) == 0  # no blocks to budget


async def test_from_name_inside_a_running_loop_builds_the_engine_on_its_own_loop(fake_vllm):
    lm = AsyncVirtualLM.from_name("m")  # as in a notebook cell
    (engine,) = fake_vllm.built
    assert engine.handler_loop is not asyncio.get_running_loop()
    assert engine.handler_loop is lm._handle.loop.loop
    await serves_and_closes(lm)
    assert engine.shutdowns == 1 and not lm._handle.loop.alive


async def test_from_name_in_another_thread_and_outside_any_loop_serve_alike(fake_vllm):
    lm = await asyncio.to_thread(AsyncVirtualLM.from_name, "m")
    await serves_and_closes(lm)
    lm = await asyncio.to_thread(asyncio.run, _built_in_a_coroutine())
    await serves_and_closes(lm)
    assert [engine.shutdowns for engine in fake_vllm.built] == [1, 1]


async def _built_in_a_coroutine():
    return AsyncVirtualLM.from_name("m")


async def test_an_engine_the_caller_built_inside_a_running_loop_is_refused(smollm2_tokenizer):
    engine = OutputHandlerEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))
    loops = engine_loops()
    with pytest.raises(ValueError, match="AsyncVirtualLM.from_name"):
        AsyncVirtualLM(engine, LogitsProcessorCapture())
    assert engine_loops() <= loops  # refused before a loop starts: nothing left to stop
    engine.output_handler.cancel()


async def test_an_engine_the_caller_built_outside_any_loop_starts_its_handler_on_ours(
    smollm2_tokenizer,
):
    engine = await asyncio.to_thread(
        OutputHandlerEngine, smollm2_tokenizer, len(smollm2_tokenizer.get_vocab())
    )
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), batch_size=8, timeout=0.01)
    await serves_and_closes(lm)
    assert engine.handler_loop is lm._handle.loop.loop


class StallingStandInEngine(StandInEngine):
    """The stand-in where requests whose context is in ``stall_on`` never get an output
    (as when sessions wait on each other for KV blocks)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stall_on = set()
        self.errored = False
        self.dead_error = RuntimeError("EngineCore encountered an issue")

    async def _compute(self, kind, context, params, lora):
        if context in self.stall_on:
            self.requests.append(Request(kind, context, params, lora))
            await asyncio.Event().wait()
        return await super()._compute(kind, context, params, lora)


@pytest.fixture
def stalling(smollm2_tokenizer):
    engine = StallingStandInEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))
    yield engine
    stop_left_running(engine)


async def test_a_step_without_output_fails_its_callers_and_the_next_is_served(stalling):
    lm = AsyncVirtualLM(stalling, LogitsProcessorCapture(), timeout=0.01, stall_timeout=0.3)
    stalling.stall_on = {(1, 2)}
    started = asyncio.get_running_loop().time()
    results = await asyncio.wait_for(
        asyncio.gather(*(lm.next_token_logprobs(p) for p in ([1, 2], [3])), return_exceptions=True),
        timeout=10,
    )
    assert all(isinstance(r, StepStalledError) for r in results), results
    assert isinstance(results[0], RuntimeError)  # SPEC: every step error is a RuntimeError
    assert "0.3 s" in str(results[0]) and "stall_timeout" in str(results[0])
    assert asyncio.get_running_loop().time() - started < 5
    assert lm._handle.sessions.live == {}  # the failed step's sessions are closed
    stalling.stall_on = set()
    torch.testing.assert_close(
        await lm.next_token_logprobs([1, 2]), expected_logprobs([1, 2], lm.vocab_size)
    )
    lm.close()


async def test_an_assigned_stall_timeout_bounds_the_next_steps(stalling):
    lm = AsyncVirtualLM(stalling, LogitsProcessorCapture(), timeout=0.01, stall_timeout=600)
    lm.stall_timeout = 0.3
    assert lm.stall_timeout == 0.3
    stalling.stall_on = {(1, 2)}
    with pytest.raises(StepStalledError, match=r"in 0\.3 s"):
        await asyncio.wait_for(lm.next_token_logprobs([1, 2]), timeout=10)
    lm.close()


async def test_a_step_fails_at_once_when_the_engine_reports_itself_dead(stalling):
    lm = AsyncVirtualLM(stalling, LogitsProcessorCapture(), timeout=0.01, stall_timeout=60)
    stalling.stall_on = {(1, 2)}
    stalling.errored = True
    with pytest.raises(RuntimeError, match="EngineCore encountered an issue"):
        await asyncio.wait_for(lm.next_token_logprobs([1, 2]), timeout=10)
    lm.close()


async def test_close_ends_a_step_in_flight_in_bounded_time(stalling):
    lm = AsyncVirtualLM(stalling, LogitsProcessorCapture(), timeout=0.01, stall_timeout=600)
    stalling.stall_on = {(1, 2)}
    waiting = asyncio.ensure_future(lm.next_token_logprobs([1, 2]))
    while not stalling.requests:
        await asyncio.sleep(0.01)
    await asyncio.wait_for(asyncio.to_thread(lm.close), timeout=10)
    with pytest.raises(EngineLoopClosedError, match="closing"):
        await asyncio.wait_for(waiting, timeout=10)
    assert stalling.shutdowns == 1


class AbortingStandInEngine(StandInEngine):
    """The stand-in where something else (``AsyncLLM.abort``, ``pause_generation(mode=
    "abort")``) aborts the requests for the contexts in ``abort_on`` once they have computed,
    their capture rows written: the output says finish_reason "abort", with ``finished``
    (vLLM 0.32) or, with ``looks_like_a_chunk_end``, without, as if the abort ended a chunk.
    A session's later chunks are then never answered (its request is gone)."""

    def __init__(self, *args, looks_like_a_chunk_end=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.abort_on = set()
        self.looks_like_a_chunk_end = looks_like_a_chunk_end

    async def generate(self, prompt, params, request_id, lora_request=None):
        async for output in super().generate(prompt, params, request_id, lora_request):
            if tuple(output.prompt_token_ids) not in self.abort_on:
                yield output
                continue
            output.outputs[0].finish_reason = "abort"
            streaming = not isinstance(prompt, dict)
            output.finished = not (streaming and self.looks_like_a_chunk_end)
            yield output
            if not output.finished:
                async for _ in prompt:  # later chunks are taken, never answered
                    pass
            return


@pytest.mark.parametrize("looks_like_a_chunk_end", [False, True], ids=["finished", "chunk-end"])
async def test_an_aborted_request_fails_its_step_at_once_and_the_next_is_served(
    smollm2_tokenizer, looks_like_a_chunk_end
):
    """vLLM's streaming-input hazard: an abort in the middle of a step is not a chunk's
    end. Its row was written, so taken for one the step would pass and the next step's
    chunk would wait for ever (stall_timeout 600 s here); instead the step fails at once
    with RequestEndedError, and the next step opens a new session. An aborted sample
    would come back cut short: it fails too."""
    from genlm.backend.llm.vllm import RequestEndedError

    engine = AbortingStandInEngine(
        smollm2_tokenizer,
        len(smollm2_tokenizer.get_vocab()),
        looks_like_a_chunk_end=looks_like_a_chunk_end,
    )
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), timeout=0.01, stall_timeout=600)
    a, b = [1, 2], [3, 4]
    await step(lm, engine, [a, b])
    engine.abort_on = {(1, 2, 5)}
    results = await asyncio.wait_for(
        asyncio.gather(
            *(lm.next_token_logprobs(c) for c in (a + [5], b + [6])), return_exceptions=True
        ),
        timeout=10,
    )
    assert all(isinstance(r, RequestEndedError) for r in results), results
    assert "finish_reason 'abort'" in str(results[0])
    engine.abort_on = set()
    contexts = [a + [5, 7], b + [6, 8]]
    assert await asyncio.wait_for(step(lm, engine, contexts), timeout=10) == ["open", "open"]
    engine.abort_on = {(9, 9)}
    with pytest.raises(RequestEndedError, match="abort"):
        await asyncio.wait_for(lm.sample([9, 9], max_tokens=3, eos_token_ids=[]), timeout=10)
    await asyncio.wait_for(asyncio.to_thread(lm.close), timeout=10)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_stall_timeout_must_be_a_positive_finite_number(engine, bad):
    with pytest.raises(ValueError, match="stall_timeout must be a finite number of seconds > 0"):
        AsyncVirtualLM(engine, LogitsProcessorCapture(), stall_timeout=bad)


def engine_loops():
    """The threads of the engine loops now running (`EngineLoop`'s default name)."""
    return {thread for thread in threading.enumerate() if thread.name == "genlm-vllm-engine"}


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"cache_size": -1}, ValueError, "cache_size must be >= 0, got -1"),
        ({"cache_opts": {"bogus": 1}}, TypeError, "no option 'bogus'; it takes: .'move_to_cpu'"),
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
        ({"timeout": -1}, ValueError, "timeout must be a finite number of seconds >= 0"),
        ({"stall_timeout": 0}, ValueError, "stall_timeout must be .* > 0, got 0"),
    ],
    ids=lambda value: str(value)[:30],
)
def test_the_constructor_checks_every_option_before_it_starts_a_loop(
    engine, options, error, message
):
    loops = engine_loops()
    with pytest.raises(error, match=message):
        AsyncVirtualLM(engine, LogitsProcessorCapture(), **options)
    assert engine_loops() <= loops


def test_the_engine_loop_never_waits_on_a_stopped_loop_and_keeps_its_time_limit():
    loop = EngineLoop()
    with pytest.raises(TimeoutError, match="within 0.2 s"):
        loop.run(asyncio.sleep(30), timeout=0.2)
    assert loop.run(asyncio.sleep(0, result="answer"), timeout=5) == "answer"

    async def own_thread():
        return loop.run(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="own thread"):
        loop.run(own_thread())

    async def stop_under_the_caller():
        asyncio.get_running_loop().stop()
        await asyncio.sleep(30)

    with pytest.raises(EngineLoopClosedError, match="stopped"):
        loop.run(stop_under_the_caller())
    loop.close()
    with pytest.raises(EngineLoopClosedError, match="closed"):
        loop.run(asyncio.sleep(0))


GIB = 2**30


def test_model_shape_reads_the_kv_size_per_token_and_the_context(default_model_dir):
    from genlm.backend.llm.vllm.defaults import ModelShape, model_shape

    # SmolLM2-135M: 30 layers, 3 KV heads of 64, keys and values, float32; 8k positions.
    assert model_shape(default_model_dir) == ModelShape(2 * 30 * 3 * 64 * 4, 8192)
    assert model_shape(default_model_dir, "bfloat16").kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    gpt2_like = SimpleNamespace(
        num_attention_heads=12, hidden_size=768, num_hidden_layers=12, n_positions=1024
    )
    assert ModelShape.of(gpt2_like) == ModelShape(2 * 12 * 12 * 64 * 4, 1024)
    assert model_shape("/no/such/model") is None


def test_cpu_defaults_give_the_kv_cache_a_share_of_the_memory_available(monkeypatch):
    from genlm.backend.llm.vllm.defaults import ModelShape, cpu_engine_defaults

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    shape = ModelShape(kv_bytes_per_token=1024, context=8192)
    eager = {"enforce_eager": True}
    assert cpu_engine_defaults({}, shape, 16 * GIB) == {**eager, "kv_cache_memory_bytes": 4 * GIB}
    two_workers = {"tensor_parallel_size": 2}
    assert cpu_engine_defaults(two_workers, shape, 16 * GIB)["kv_cache_memory_bytes"] == 2 * GIB
    assert cpu_engine_defaults({}, None, 16 * GIB)["kv_cache_memory_bytes"] == 4 * GIB
    # 4 MiB of KV hold 4096 tokens of 1 KiB: less than the model's 8192, so the context shrinks.
    assert cpu_engine_defaults({}, shape, 16 * 2**20) == {
        **eager,
        "kv_cache_memory_bytes": 4 * 2**20,
        "max_model_len": 4096,
    }
    assert "max_model_len" not in cpu_engine_defaults({"max_model_len": 8192}, shape, 16 * 2**20)
    for compiled in ({"enforce_eager": False}, {"compilation_config": 3}):
        assert "enforce_eager" not in cpu_engine_defaults(compiled, shape, 16 * GIB)


@pytest.mark.parametrize(
    "opts", [{"kv_cache_memory_bytes": GIB}, {"gpu_memory_utilization": 0.5}], ids=str
)
def test_cpu_defaults_leave_memory_to_callers_who_size_it(monkeypatch, opts):
    from genlm.backend.llm.vllm.defaults import ModelShape, cpu_engine_defaults

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert cpu_engine_defaults(opts, ModelShape(1024, 8192), 16 * GIB) == {"enforce_eager": True}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert cpu_engine_defaults({}, ModelShape(1024, 8192), 16 * GIB) == {"enforce_eager": True}


def test_from_name_on_a_cpu_build_passes_the_cpu_defaults_under_the_callers(
    fake_vllm, monkeypatch, default_model_dir
):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(defaults, "is_cpu_build", lambda: True)
    monkeypatch.setattr(defaults, "available_memory", lambda: 16 * GIB)
    seen = []
    module = sys.modules["vllm"]
    module.AsyncEngineArgs = lambda **opts: seen.append(opts) or FakeEngineArgs(**opts)
    AsyncVirtualLM.from_name(default_model_dir).close()
    AsyncVirtualLM.from_name(default_model_dir, engine_opts={"max_model_len": 512}).close()
    assert seen[0]["kv_cache_memory_bytes"] == 4 * GIB and "max_model_len" not in seen[0]
    assert seen[0]["enforce_eager"] is True
    assert seen[1]["kv_cache_memory_bytes"] == 4 * GIB and seen[1]["max_model_len"] == 512


def test_an_lm_left_open_is_closed_at_interpreter_exit(default_model_dir):
    code = (
        "from transformers import AutoTokenizer\n"
        "from genlm.backend.llm.vllm import AsyncVirtualLM, LogitsProcessorCapture\n"
        "class Engine:\n"
        f"    tokenizer = AutoTokenizer.from_pretrained({default_model_dir!r})\n"
        "    def get_tokenizer(self):\n"
        "        return self.tokenizer\n"
        "    def shutdown(self, timeout=None):\n"
        "        print('engine shut down', flush=True)\n"
        "lm = AsyncVirtualLM(Engine(), LogitsProcessorCapture())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "engine shut down\n"


def with_max_model_len(engine, max_model_len):
    """Give the stand-in a ``vllm_config`` like vLLM's, with ``max_model_len``."""
    engine.vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=16),
        cache_config=SimpleNamespace(num_gpu_blocks=None, block_size=4),
    )
    return engine


async def test_a_context_past_the_engine_length_fails_its_caller_alone(engine):
    """max_model_len 8: contexts of up to 7 tokens (vLLM counts the drawn token); an
    8-token one fails its caller with the documented ValueError, as a new request or as
    a session's continuation, and the engine never sees it."""
    lm = AsyncVirtualLM(with_max_model_len(engine, 8), LogitsProcessorCapture(), timeout=0.01)
    assert lm.max_context_length == 7
    seven = [1, 2, 3, 4, 5, 6, 7]
    results = await asyncio.gather(
        lm.next_token_logprobs(seven),
        lm.next_token_logprobs(seven + [8]),  # continues seven's session, once opened
        lm.next_token_logprobs([9] * 20),
        return_exceptions=True,
    )
    torch.testing.assert_close(results[0], expected_logprobs(seven, lm.vocab_size))
    for error in results[1:]:
        assert isinstance(error, ValueError) and "context length of 7 tokens" in str(error)
    with pytest.raises(ValueError, match="context length of 7"):
        await lm.next_token_logprobs(seven + [8])
    assert max(len(r.context) for r in engine.requests) == 7
    lm.close()


async def test_sample_stops_at_the_engine_length(engine):
    lm = AsyncVirtualLM(with_max_model_len(engine, 8), LogitsProcessorCapture(), timeout=0.01)
    tokens = await lm.sample([1, 2, 3], max_tokens=20, eos_token_ids=[], seed=1)
    assert len(tokens) == 5  # the last one drawn after a context of 7 tokens
    assert engine.requests[-1].params.max_tokens == 5
    assert await lm.sample([1] * 7, max_tokens=20, eos_token_ids=[], seed=1) != []
    with pytest.raises(ValueError, match="context length of 7"):
        await lm.sample([1] * 8, max_tokens=20, eos_token_ids=[])
    lm.close()


async def test_sample_temperature_is_kept_within_what_vllm_accepts(lm, engine):
    with pytest.raises(ValueError, match=r"at most 2 on vLLM .*\[0, 2\].*1e\+300"):
        await lm.sample([1], 2, [0], temperature=1e300)
    with pytest.raises(ValueError, match="at most 2 on vLLM"):
        await lm.batch_sample([[1], [2]], 2, [0], temperature=2.5)
    assert engine.requests == []
    assert len(await lm.sample([1], 2, [], temperature=2.0, seed=1)) == 2


class ChunkRecordingEngine(StandInEngine):
    """The stand-in recording the ``logprobs`` parameter of every chunk of each session."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunk_logprobs = {}

    async def generate(self, prompt, params, request_id, lora_request=None):
        if not isinstance(prompt, dict):
            prompt = self._recorded(prompt, self.chunk_logprobs.setdefault(request_id, []))
        async for output in super().generate(prompt, params, request_id, lora_request):
            yield output

    async def _recorded(self, chunks, seen):
        async for chunk in chunks:
            seen.append(chunk.sampling_params.logprobs)
            yield chunk


async def test_lms_with_other_captures_never_continue_each_others_sessions(smollm2_tokenizer):
    """Two LMs on one engine, one capturing with the logits processor and one with
    ``logprobs=-1``, stepping the same six particles in turn: every session's chunks carry
    one capture's parameters, and each LM goes on extending its own sessions."""
    engine = ChunkRecordingEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))
    processor = AsyncVirtualLM(engine, LogitsProcessorCapture(), timeout=0.01)
    logprobs = AsyncVirtualLM(engine, EngineLogprobsCapture(), timeout=0.01)
    contexts = [[1, 2, i] for i in range(6)]
    for length in range(3):
        for lm in (processor, logprobs):
            await step(lm, engine, [c + [7] * length for c in contexts])
    assert len(engine.chunk_logprobs) == 12  # six sessions per LM
    for seen in engine.chunk_logprobs.values():
        assert len(seen) == 3 and len(set(seen)) == 1
    assert [r.kind for r in engine.requests[-6:]] == ["extend"] * 6
    processor.close()


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"stall_timeout": -1}, ValueError, "stall_timeout must be .* > 0, got -1"),
        ({"cache_opts": 3}, TypeError, "cache_opts must be a dict .* got int: 3"),
        ({"cache_opts": {"bogus": 1}}, TypeError, "no option 'bogus'; it takes: .'move_to_cpu'"),
        ({"cache_opts": {"move_to_cpu": "yes"}}, TypeError, "move_to_cpu must be a bool"),
        ({"capture": None}, ValueError, r"capture must be one of .* got None"),
        ({"capture": 42}, ValueError, r"capture must be one of .* got 42"),
        ({"engine_opts": [1]}, TypeError, r"engine_opts must be a dict .* got list"),
        ({"max_kv_bytes": None}, TypeError, "takes no option 'max_kv_bytes'"),
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
    ],
    ids=lambda value: str(value)[:30],
)
def test_from_name_checks_its_options_before_it_starts_an_engine(
    fake_vllm, options, error, message
):
    started = time.monotonic()
    with pytest.raises(error, match=message):
        AsyncVirtualLM.from_name("m", **options)
    assert fake_vllm.built == []
    assert time.monotonic() - started < 1  # no model read, no engine: milliseconds


def test_option_errors_come_before_the_vllm_import(monkeypatch):
    """Where vllm is missing the option is still named (checked before the import)."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ValueError, match="stall_timeout"):
        AsyncVirtualLM.from_name("m", stall_timeout=float("nan"))
    with pytest.raises(ImportError, match=r"needs vllm: pip install -e .*\[vllm\]"):
        AsyncVirtualLM.from_name("m")


class NeverShutsDownEngine(StandInEngine):
    """The stand-in whose ``shutdown`` never returns (it blocks the engine's loop)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def shutdown(self, timeout=None):
        self.shutdowns += 1
        self.release.wait()


def test_close_is_bounded_when_the_engines_shutdown_never_returns(
    smollm2_tokenizer, monkeypatch, caplog
):
    monkeypatch.setattr(vllm_loop, "ENGINE_SHUTDOWN_TIMEOUT", 0.5)
    monkeypatch.setattr(vllm_loop, "SHUTDOWN_GRACE", 0.5)
    engine = NeverShutsDownEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), timeout=0.01)
    torch.testing.assert_close(
        lm.next_token_logprobs_sync([1, 2]), expected_logprobs([1, 2], lm.vocab_size)
    )
    loop = lm._handle.loop
    started = time.monotonic()
    lm.close()
    assert time.monotonic() - started < 0.5 + 0.5 + 5  # the bound, and slack for the machine
    assert engine.shutdowns == 1 and not loop.alive
    assert "shutdown did not return" in caplog.text
    with pytest.raises(RuntimeError, match="after cleanup"):
        lm.next_token_logprobs_sync([1, 2])
    engine.release.set()  # the loop's thread then ends
    loop._thread.join(5)
    assert not loop._thread.is_alive()


# -- prefix handles: a particle's session found from its handle, closed once nobody holds it --


def no_context_keys_for_handles(monkeypatch):
    """Fail a step that builds a session key of a handle's context (a tuple of its ids):
    a handle's session is found from the handle."""
    from genlm.backend.llm.handle import PrefixHandle
    from genlm.backend.llm.vllm.sessions import StepRequest

    key = StepRequest.key

    def checked(self, context):
        assert not isinstance(self.token_ids, PrefixHandle), "a handle's context was keyed"
        return key(self, context)

    monkeypatch.setattr(StepRequest, "key", checked)


async def closed_sessions(lm, engine, open_now):
    """Wait (at most 5 s) until the engine holds ``open_now`` sessions; their number."""
    for _ in range(500):
        if len(engine.open_sessions) == open_now:
            break
        await asyncio.sleep(0.01)
    return len(engine.open_sessions)


async def test_a_handle_continues_the_session_its_parent_went_through(lm, engine, monkeypatch):
    no_context_keys_for_handles(monkeypatch)
    prompt = lm.handle([1, 2, 3])
    assert await step(lm, engine, [prompt]) == ["open"]
    child = prompt + [4]
    assert await step(lm, engine, [child]) == ["extend"]
    # forks: one continues the session, the other opens one (as with lists)
    forks = [child + [5], child + [6]]
    assert await step(lm, engine, forks) == ["extend", "open"]
    assert await step(lm, engine, [f + [7] for f in forks]) == ["extend", "extend"]
    # a handle two tokens past its session's context, or a list of the same ids: new sessions
    assert await step(lm, engine, [forks[0] + [7, 8], [1, 2, 3, 4, 5, 7]]) == ["open", "open"]
    sessions = lm._handle.sessions
    assert all(s.context is None for s in sessions.live.values() if s.link is not None)


async def test_a_session_no_handle_can_continue_is_closed(lm, engine):
    sessions = lm._handle.sessions
    parent = lm.handle([1, 2, 3])
    await step(lm, engine, [parent])
    child = parent + [4]
    del parent  # its child holds the link: the session stays
    gc.collect()
    assert await closed_sessions(lm, engine, 1) == 1
    assert await step(lm, engine, [child]) == ["extend"]
    sibling = lm.handle([9, 9])
    await step(lm, engine, [sibling])
    assert len(engine.open_sessions) == 2
    del child  # nobody can continue its session: closed, without a call
    assert await closed_sessions(lm, engine, 1) == 1
    assert sessions.counts["unlinked"] == 1 and len(sessions.live) == 1
    assert await step(lm, engine, [sibling + [1]]) == ["extend"]


async def test_handles_made_shared_and_dropped_leave_no_session_behind(lm, engine):
    """Particles resampled and extended for many steps, then dropped: the engine's
    sessions and the live table are back to none."""
    rng = random.Random(0)
    particles = [lm.handle([1, 2, 3])] * 8
    for _ in range(12):
        particles = [particles[rng.randrange(8)] for _ in range(8)]
        particles = [p + [rng.randrange(lm.vocab_size)] for p in particles]
        await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
    counts = lm._handle.sessions.counts
    # forks opened sessions; the dead particles' were closed: never two steps' worth open
    assert counts["opened"] > 3 * 8 and counts["unlinked"] > 2 * 8
    assert engine.max_open <= 2 * 8
    del particles
    gc.collect()
    assert await closed_sessions(lm, engine, 0) == 0
    assert lm._handle.sessions.live == {}

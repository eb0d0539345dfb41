"""AsyncVirtualLM around a stand-in vLLM engine: everything but the engine, without vllm.

The stand-in mimics ``AsyncLLM.generate`` (one-shot requests and streaming-input
sessions fed chunk by chunk) and the engine-side logits processor's file protocol,
including what makes the mapping hard: requests finish in a shuffled order and a
chunked prefill first writes a wrong row that a later write replaces. Expected
log-probabilities come from the stand-in's own logits function, not from the backend.
"""

import asyncio
import hashlib
import os
import random
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from genlm.backend.llm import vllm as vllm_backend
from genlm.backend.llm.vllm import (
    CAPTURE_KEY,
    CAPTURE_PROCESSOR,
    AsyncVirtualLM,
    EngineLogprobsCapture,
    LogitsProcessorCapture,
    engine_options,
    hash_to_int,
    logging_configured,
)
from genlm.backend.llm.vllm_sessions import EngineLimits, close_engine_loop


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


@pytest.fixture(autouse=True)
def fake_vllm_api(monkeypatch):
    api = SimpleNamespace(
        SamplingParams=FakeSamplingParams,
        LoRARequest=FakeLoRARequest,
        StreamingInput=FakeStreamingInput,
        DELTA="delta",
    )
    monkeypatch.setattr(vllm_backend, "vllm_api", lambda: api)


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

    def shutdown(self):
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


@pytest.fixture
def engine(smollm2_tokenizer):
    engine = StandInEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))
    yield engine
    close_engine_loop(engine)


@pytest.fixture
def lm(engine):
    return AsyncVirtualLM(engine, LogitsProcessorCapture(), batch_size=8, timeout=0.01)


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
    monkeypatch.setattr(AsyncVirtualLM, "_check_adapter", lambda self, path: None)


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


def test_capture_files_are_removed_after_each_batch(lm, tmp_path):
    lm.logprobs_capture = LogitsProcessorCapture(directory=str(tmp_path))
    lm.batch_next_token_logprobs_sync(PROMPTS)
    assert list(tmp_path.iterdir()) == []


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
        "        assert 'genlm-backend[vllm]' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('no ImportError')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("version", ["0.30.2", "0.11.0+cpu", "unknown"])
def test_a_vllm_older_than_the_floor_is_refused_naming_the_release_needed(monkeypatch, version):

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__=version))
    with pytest.raises(ImportError, match=rf"vllm>=0\.31 .*this is vllm {re.escape(version)}"):
        AsyncVirtualLM.from_name("m")


def test_from_name_rejects_an_unknown_capture():
    with pytest.raises(ValueError, match="processor"):
        AsyncVirtualLM.from_name("m", capture="telepathy")


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
    close_engine_loop(engine)


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
    close_engine_loop(engine)


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
    close_engine_loop(engine)


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
    close_engine_loop(engine)

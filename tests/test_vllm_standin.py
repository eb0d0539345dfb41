"""AsyncVirtualLM around a stand-in vLLM engine: everything but the engine, without vllm.

The stand-in mimics ``vllm.LLM.generate`` and the engine-side logits processor's
file protocol, including what makes the mapping hard: rows are written in a shuffled
order and a chunked prefill first writes a wrong row that a later write replaces.
Expected log-probabilities come from the stand-in's own logits function, not from
the backend.
"""

import asyncio
import hashlib
import os
import random
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
    shutdown_engine,
)


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


@dataclass(frozen=True)
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@pytest.fixture(autouse=True)
def fake_vllm_api(monkeypatch):
    monkeypatch.setattr(vllm_backend, "vllm_api", lambda: (FakeSamplingParams, FakeLoRARequest))


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


class StandInEngine:
    """Enough of ``vllm.LLM`` for AsyncVirtualLM, plus a record of every call."""

    def __init__(self, tokenizer, vocab_size):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.calls = []
        self.threads = []
        self.shutdowns = 0
        self.fail_with = None
        self.skip_capture_rows = set()
        self.rng = random.Random(0)

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self):
        self.shutdowns += 1

    def generate(self, prompts, params, use_tqdm=True, lora_request=None):
        self.threads.append(threading.get_ident())
        token_lists = [tuple(p["prompt_token_ids"]) for p in prompts]
        self.calls.append((token_lists, params, lora_request))
        if self.fail_with is not None:
            raise self.fail_with
        order = list(range(len(prompts)))
        self.rng.shuffle(order)  # vLLM may schedule requests in any order
        outputs = [None] * len(prompts)
        for i in order:
            outputs[i] = self._run(token_lists[i], params[i])
        return outputs

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


@pytest.fixture
def engine(smollm2_tokenizer):
    return StandInEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))


@pytest.fixture
def lm(engine):
    return AsyncVirtualLM(engine, LogitsProcessorCapture(), batch_size=8, timeout=0.01)


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]


async def test_batched_logprobs_map_to_their_requests_despite_reordering(lm, engine):
    results = await asyncio.gather(*(lm.next_token_logprobs(p) for p in PROMPTS))
    assert len(engine.calls) == 1
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
    _, params, _ = engine.calls[0]
    assert all(p.logprobs == -1 and p.flat_logprobs for p in params)


async def test_identical_prompts_are_computed_once(lm, engine):
    a, b, c = await asyncio.gather(
        lm.next_token_logprobs([7, 8]),
        lm.next_token_logprobs([7, 8]),
        lm.next_token_logprobs((7, 9)),
    )
    assert torch.equal(a, b)
    assert sorted(engine.calls[0][0]) == [(7, 8), (7, 9)]


async def test_generate_runs_off_the_event_loop_thread(lm, engine):
    await lm.next_token_logprobs([1, 2])
    assert engine.threads and threading.get_ident() not in engine.threads


async def test_logprob_requests_are_greedy_single_token_and_tagged(lm, engine):
    await lm.next_token_logprobs([1, 2])
    (params,) = engine.calls[0][1]
    assert params.max_tokens == 1 and params.temperature == 0.0 and not params.detokenize
    path, row, width = params.extra_args[CAPTURE_KEY]
    assert row == 0 and width == lm.vocab_size


async def test_output_cache_serves_repeats_and_batch_sync_bypasses_it(engine):
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), cache_size=10)
    first = await lm.next_token_logprobs([3, 4])
    assert torch.equal(await lm.next_token_logprobs([3, 4]), first)
    assert torch.equal(lm.next_token_logprobs_sync([3, 4]), first)
    assert len(engine.calls) == 1
    lm.batch_next_token_logprobs_sync([[3, 4]])
    assert len(engine.calls) == 2
    lm.clear_cache()
    await lm.next_token_logprobs([3, 4])
    assert len(engine.calls) == 3


async def test_without_cache_every_call_reaches_the_engine(lm, engine):
    await lm.next_token_logprobs([3, 4])
    await lm.next_token_logprobs([3, 4])
    assert len(engine.calls) == 2


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
    assert engine.calls == []


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
    params = engine.calls[-1][1][0]
    assert params.ignore_eos and params.stop_token_ids == [eos] and params.seed == 3
    assert await lm.sample([1, 2], max_tokens=0, eos_token_ids=[]) == []


async def test_concurrent_samples_share_one_engine_call_and_seeds_repeat(lm, engine):
    prompts = [[1, 2], [3], [4, 5, 6]]
    first = await lm.batch_sample(prompts, max_tokens=4, eos_token_ids=[], seed=10)
    assert len(engine.calls) == 1 and len(engine.calls[0][0]) == 3
    assert await lm.batch_sample(prompts, max_tokens=4, eos_token_ids=[], seed=10) == first
    assert [len(t) for t in first] == [4, 4, 4]


async def test_unseeded_identical_samples_are_not_merged(lm, engine):
    await asyncio.gather(*(lm.sample([1, 2], 3, []) for _ in range(4)))
    assert [len(prompts) for prompts, _, _ in engine.calls] == [4]


async def test_samples_and_logprobs_share_one_generate_call(lm, engine):
    tokens, logprobs = await asyncio.gather(
        lm.sample([9, 9], 2, [], seed=0), lm.next_token_logprobs([9, 8])
    )
    assert len(engine.calls) == 1 and len(tokens) == 2
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


async def test_lora_requests_are_per_request_and_cached_per_adapter(engine):
    lm = AsyncVirtualLM(engine, LogitsProcessorCapture(), cache_size=10)
    with pytest.raises(ValueError, match="'a'.*add_new_lora"):
        await lm.next_token_logprobs([1, 2], lora_name="a")
    assert engine.calls == []
    lm.add_new_lora("/adapters/a", "a")
    await asyncio.gather(
        lm.next_token_logprobs([1, 2]), lm.next_token_logprobs([1, 2], lora_name="a")
    )
    ((prompts, _, loras),) = engine.calls  # one generate call serves both adapters
    assert prompts == [(1, 2), (1, 2)]
    assert loras == [None, FakeLoRARequest("a", hash_to_int("a"), "/adapters/a")]
    lm.set_lora(lora_name="a")
    await lm.next_token_logprobs([1, 2])  # the default is now "a": served from a's cache
    lm.clear_lora()
    await lm.next_token_logprobs([1, 2])  # the base model's cached row
    assert len(engine.calls) == 1
    lm.add_new_lora("/adapters/a2", "a")  # new weights under the same name: a's rows dropped
    await lm.next_token_logprobs([1, 2], lora_name="a")
    assert engine.calls[-1][2] == [FakeLoRARequest("a", hash_to_int("a"), "/adapters/a2")]
    lm.remove_lora("a")
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.next_token_logprobs_sync([1, 2], lora_name="a")


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


def test_shutdown_engine_reaches_the_engine_core_of_a_vllm_llm():
    core = SimpleNamespace(stopped=0)
    core.shutdown = lambda: setattr(core, "stopped", core.stopped + 1)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core))
    shutdown_engine(llm)
    assert core.stopped == 1


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


def test_from_name_rejects_an_unknown_capture():
    with pytest.raises(ValueError, match="processor"):
        AsyncVirtualLM.from_name("m", capture="telepathy")

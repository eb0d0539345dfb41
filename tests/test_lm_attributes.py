"""What every backend has besides its calls (SPEC §3, AsyncLM): ``device``, where its rows
are, and ``batch_size`` / ``timeout``, readable and assignable with effect on the next
batches, checked as its constructor checks them (the reference's LMs let clients such as
LLaMPPL tune the batching this way).

Every backend kind here: the mock, a tiny random Llama on transformers and on mlx-lm, and
the SGLang and vLLM backends around the stand-in engines of their own suites.
"""

import asyncio
import math

import pytest
import torch

from genlm.backend.llm import MockAsyncLM

KINDS = ["mock", "hf", pytest.param("mlx", marks=pytest.mark.mlx), "sgl", "vllm"]


def vllm_stand_in(monkeypatch, tokenizer, request):
    """`AsyncVirtualLM`'s class, and its stand-in engine, with vLLM's API faked as the
    stand-in suite fakes it; the engine's loop is stopped at teardown if left running."""
    from test_vllm_standin import StandInEngine, stop_left_running, use_fake_vllm_api

    from genlm.backend.llm.vllm import AsyncVirtualLM, LogitsProcessorCapture

    use_fake_vllm_api(monkeypatch)
    engine = StandInEngine(tokenizer, len(tokenizer.get_vocab()))
    request.addfinalizer(lambda: stop_left_running(engine))
    return lambda **options: AsyncVirtualLM(engine, LogitsProcessorCapture(), **options)


@pytest.fixture(params=KINDS)
def make(request, monkeypatch, smollm2_tokenizer):
    """A constructor of the backend ``request.param`` taking only its options."""
    tokenizer = smollm2_tokenizer
    kind = request.param
    if kind == "mock":
        return lambda **options: MockAsyncLM(tokenizer, **options)
    if kind == "hf":
        from small_models import tiny_llama

        from genlm.backend.llm.hf import AsyncTransformer

        model = tiny_llama(len(tokenizer), 16, 2, 1)
        return lambda **options: AsyncTransformer(model, tokenizer, **options)
    if kind == "mlx":
        pytest.importorskip("mlx_lm")
        from test_mlx import tiny_llama

        from genlm.backend.llm.mlx import AsyncMlxLM

        model = tiny_llama(len(tokenizer), ["full_attention"])
        return lambda **options: AsyncMlxLM(model, tokenizer, **options)
    if kind == "sgl":
        from test_sgl import StandInSGLEngine

        from genlm.backend.llm.sgl import AsyncSGLTransformer

        engine = StandInSGLEngine(tokenizer, len(tokenizer.get_vocab()))
        return lambda **options: AsyncSGLTransformer(engine, **options)
    return vllm_stand_in(monkeypatch, tokenizer, request)


async def test_device_is_where_the_rows_are(make):
    with make() as lm:
        assert isinstance(lm.device, torch.device)
        assert lm.device == torch.device("cpu")  # every backend's rows, on this machine
        rows = [await lm.next_token_logprobs([1, 2]), lm.next_token_logprobs_sync([3])]
        rows += list(await lm.batch_next_token_logprobs([[4], [5, 6]]))
        assert {row.device for row in rows} == {lm.device}


async def batch_sizes_of(lm, first, n):
    """The sizes of the batches that ``n`` concurrent requests (distinct new prefixes
    from ``first`` on) form."""
    before = lm.batcher.num_batches
    await asyncio.gather(*(lm.next_token_logprobs([first + i, 7]) for i in range(n)))
    return list(lm.batcher.batch_sizes)[before:]


async def test_an_assigned_batch_size_is_what_the_next_batches_fire_at(make):
    with make(batch_size=20, timeout=None) as lm:
        assert lm.batch_size == 20 and lm.timeout is None
        assert await batch_sizes_of(lm, 10, 7) == [7]
        lm.batch_size = 3
        assert lm.batch_size == 3
        assert await batch_sizes_of(lm, 20, 7) == [3, 3, 1]
        lm.batch_size = 7
        assert await batch_sizes_of(lm, 30, 7) == [7]


async def test_an_assigned_timeout_is_read_back_and_used_by_the_batcher(make):
    with make(timeout=0.5) as lm:
        assert lm.timeout == 0.5
        lm.timeout = 0.25
        assert lm.timeout == lm.batcher.timeout == 0.25
        lm.timeout = None
        assert lm.timeout is None and lm.batcher.timeout is None
        lm.timeout = 1  # an int number of seconds, as the constructor takes it
        assert lm.timeout == 1.0
        await lm.next_token_logprobs([1])  # still serves


BAD_OPTIONS = [
    ("batch_size", 0),
    ("batch_size", -3),
    ("batch_size", 2.0),
    ("batch_size", "4"),
    ("batch_size", True),
    ("batch_size", None),
    ("timeout", -0.5),
    ("timeout", math.nan),
    ("timeout", math.inf),
    ("timeout", "1"),
    ("timeout", True),
]


@pytest.mark.parametrize("name, bad", BAD_OPTIONS, ids=repr)
def test_a_bad_assignment_is_refused_with_the_constructors_error(make, name, bad):
    with pytest.raises((TypeError, ValueError)) as by_constructor:
        make(**{name: bad})
    with make(batch_size=4, timeout=0.125) as lm:
        with pytest.raises(type(by_constructor.value)) as by_assignment:
            setattr(lm, name, bad)
        assert str(by_assignment.value) == str(by_constructor.value)
        assert (lm.batch_size, lm.timeout) == (4, 0.125)  # unchanged


RUNNER_OPTIONS = [
    pytest.param("hf", "max_batch_tokens", 4, 0, id="hf-max_batch_tokens"),
    pytest.param("hf", "lora_batching", "grouped", "one", id="hf-lora_batching"),
    pytest.param(
        "mlx", "prefill_step_size", 4, 0, id="mlx-prefill_step_size", marks=pytest.mark.mlx
    ),
]


@pytest.mark.parametrize("kind, name, good, bad", RUNNER_OPTIONS)
def test_a_forward_option_assigned_reaches_the_runner(smollm2_tokenizer, kind, name, good, bad):
    """A backend's forward options are its runner's: assigning one on the LM is checked as
    the constructor checks it and changes the next forwards (rows still exact)."""
    tokenizer = smollm2_tokenizer
    if kind == "hf":
        from small_models import tiny_llama

        from genlm.backend.llm.hf import AsyncTransformer

        lm = AsyncTransformer(tiny_llama(len(tokenizer), 16, 2, 1), tokenizer)
        reference = lm.next_token_logprobs_uncached
    else:
        pytest.importorskip("mlx_lm")
        from test_mlx import tiny_llama

        from genlm.backend.llm.mlx import AsyncMlxLM

        lm = AsyncMlxLM(tiny_llama(len(tokenizer), ["full_attention"]), tokenizer)
        reference = None
    with lm:
        with pytest.raises((TypeError, ValueError)) as by_constructor:
            type(lm).check_constructor_options({name: bad})
        with pytest.raises(type(by_constructor.value)) as by_assignment:
            setattr(lm, name, bad)
        assert str(by_assignment.value) == str(by_constructor.value)
        setattr(lm, name, good)
        assert getattr(lm, name) == getattr(lm.runner, name) == good
        prompt = list(range(5, 25))
        row = lm.next_token_logprobs_sync(prompt)
        if reference is not None:
            assert (row - reference(prompt)).abs().max() <= 1e-4

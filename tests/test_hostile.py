"""Random hostile input at every public entry point (hypothesis).

Each property: a call either raises a clear error type (``ValueError``, ``TypeError``,
``RuntimeError``, plus ``OSError``/``ImportError`` where a loader reaches the disk or
an optional package), or returns an answer checked against an independent
computation; and no call hangs (each runs on a worker thread with a time limit).
Acceptance is predicted independently too: valid input must be accepted, invalid
input refused.
"""

import asyncio
import copy
import math
import numbers
import pickle
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genlm.backend.batching import AutoBatcher
from genlm.backend.cache import OutputCache
from genlm.backend.llm import MockAsyncLM, load_model_by_name
from genlm.backend.tokenization import Token, decode_vocab
from genlm.backend.trie import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    TokenCharacterTrie,
)

CLEAR_ERRORS = (ValueError, TypeError, RuntimeError)
TIME_LIMIT = 30.0  # seconds: any call slower than this counts as a hang (calls take ms)
FAST = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hostile")


def outcome(fn, errors=CLEAR_ERRORS):
    """``("ok", fn())`` or ``("error", exception)`` for an expected error type; fails the
    test on a hang or on any other exception."""

    def guarded():
        try:
            return "ok", fn()
        except errors as error:
            assert str(error), f"{type(error).__name__} without a message"
            return "error", error

    try:
        return _worker.submit(guarded).result(TIME_LIMIT)
    except FutureTimeout:
        pytest.fail(f"call hung for more than {TIME_LIMIT} s")


def run_async(coro_fn, errors=CLEAR_ERRORS):
    """`outcome` of an async call, each in a fresh event loop (successive loops must work)."""
    return outcome(lambda: asyncio.run(asyncio.wait_for(coro_fn(), TIME_LIMIT)), errors)


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.complex_numbers(max_magnitude=10),
    st.text(max_size=3),
    st.binary(max_size=3),
)
JUNK = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=4),
    st.tuples(SCALARS, SCALARS),
    st.sets(st.integers(0, 10), max_size=3),
    st.dictionaries(st.integers(0, 10), st.integers(0, 10), max_size=3),
    st.just(object()),
)


# -- LM entry points (mock) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def lm(smollm2_tokenizer):
    lm = MockAsyncLM(smollm2_tokenizer)
    lm.add_new_lora("/any/path", "a")
    yield lm
    lm.close()


def valid_prefix(x, vocab_size):
    """``x`` as a list of token ids if it is a valid prefix, else None (judged here)."""
    if isinstance(x, torch.Tensor | np.ndarray):
        if x.ndim != 1 or x.dtype in (torch.bool, np.bool_):
            return None
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
            return None
        if isinstance(x, np.ndarray) and x.dtype.kind not in "iu":
            return None
        x = x.tolist()
    if not isinstance(x, list | tuple) or not x:
        return None
    ok = all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab_size
        for t in x
    )
    return [int(t) for t in x] if ok else None


def prefixes(vocab_size):
    ids = st.integers(0, vocab_size - 1)
    return st.one_of(
        st.lists(ids, min_size=1, max_size=5),
        st.tuples(ids, ids),
        st.lists(st.integers(-(2**40), 2**40), max_size=4),
        st.lists(st.one_of(ids, st.lists(ids, max_size=2), JUNK), min_size=1, max_size=4),
        st.builds(np.array, st.lists(st.integers(-2, vocab_size + 2), max_size=4)),
        st.builds(torch.tensor, st.lists(st.integers(-2, vocab_size + 2), min_size=1, max_size=4)),
        st.builds(np.array, st.lists(st.floats(0, 10), min_size=1, max_size=3)),
        JUNK,
    )


LORA_NAMES = st.one_of(st.none(), st.just("a"), st.text(max_size=3), st.integers(), st.binary())


def reference_logprobs(lm, ids, lora):
    """The canonical answer: the plain-list prefix through the blocking path."""
    return lm.next_token_logprobs_sync(ids, lora_name=lora)


def check_logprobs(result, lm, ids, lora):
    assert result.shape == (lm.vocab_size,)
    assert abs(float(torch.logsumexp(result.double(), 0))) < 1e-4  # a float32 row, normalized
    torch.testing.assert_close(result, reference_logprobs(lm, ids, lora))


@FAST
@given(data=st.data())
def test_lm_next_token_logprobs(lm, data):
    x = data.draw(prefixes(lm.vocab_size), label="token_ids")
    lora = data.draw(LORA_NAMES, label="lora_name")
    ids = valid_prefix(x, lm.vocab_size)
    accepted = ids is not None and lora in (None, "a")
    for kind, value in (
        run_async(lambda: lm.next_token_logprobs(x, lora_name=lora)),
        outcome(lambda: lm.next_token_logprobs_sync(x, lora_name=lora)),
    ):
        assert (kind == "ok") == accepted, (x, lora, value)
        if accepted:
            check_logprobs(value, lm, ids, lora)


@FAST
@given(data=st.data())
def test_lm_batch_next_token_logprobs(lm, data):
    items = data.draw(st.lists(prefixes(lm.vocab_size), max_size=3), label="token_ids_list")
    container = data.draw(st.sampled_from([list, tuple, set, iter, "junk"]), label="container")
    lora = data.draw(st.sampled_from([None, "a", "b", 3]), label="lora_name")
    if container == "junk":
        batch = data.draw(JUNK)
    elif container in (set, iter):
        batch = container(tuple(map(repr, items)))  # unordered or one-shot: refused
    else:
        batch = container(items)
    id_lists = [valid_prefix(x, lm.vocab_size) for x in items]
    accepted = (
        container in (list, tuple) and lora in (None, "a") and all(i is not None for i in id_lists)
    )
    for kind, value in (
        run_async(lambda: lm.batch_next_token_logprobs(batch, lora_name=lora)),
        outcome(lambda: lm.batch_next_token_logprobs_sync(batch, lora_name=lora)),
    ):
        if container == "junk":
            continue  # a junk value may happen to be a valid batch; it must just not hang
        assert (kind == "ok") == accepted, (batch, lora, value)
        if accepted:
            assert value.shape == (len(id_lists), lm.vocab_size)
            for row, ids in zip(value, id_lists, strict=True):
                torch.testing.assert_close(row, reference_logprobs(lm, ids, lora))


def valid_sampling(max_tokens, temperature, seed, eos):
    def is_int(v):
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    return (
        is_int(max_tokens)
        and max_tokens >= 0
        and isinstance(temperature, int | float)
        and not isinstance(temperature, bool)
        and math.isfinite(temperature)
        and temperature > 0
        and (seed is None or (is_int(seed) and 0 <= seed < 2**63))
        and isinstance(eos, list | tuple)
        and all(is_int(e) for e in eos)
    )


@FAST
@given(
    prompt=st.one_of(st.lists(st.integers(0, 50), min_size=1, max_size=3), JUNK),
    max_tokens=st.one_of(st.integers(-2, 4), SCALARS.filter(lambda v: not isinstance(v, int))),
    temperature=st.one_of(st.floats(0.1, 3), SCALARS),
    seed=st.one_of(st.none(), st.integers(0, 100), SCALARS),
    eos=st.one_of(st.lists(st.integers(0, 100), max_size=3), JUNK),
)
def test_lm_sample(lm, prompt, max_tokens, temperature, seed, eos):
    accepted = valid_prefix(prompt, lm.vocab_size) is not None and valid_sampling(
        max_tokens, temperature, seed, eos
    )
    kind, value = run_async(lambda: lm.sample(prompt, max_tokens, eos, temperature, seed))
    assert (kind == "ok") == accepted, value
    if accepted:
        assert len(value) <= max_tokens
        assert all(isinstance(t, int) and 0 <= t < lm.vocab_size for t in value)
        assert not set(value) & set(eos)
        if seed is not None:  # the same seed, the same tokens
            assert run_async(lambda: lm.sample(prompt, max_tokens, eos, temperature, seed)) == (
                "ok",
                value,
            )


# -- tries ----------------------------------------------------------------------------------

VOCAB = [Token(i, b) for i, b in enumerate([b"a", b"ab", b"abc", b"b", b"ab"])]
REAL = st.one_of(st.booleans(), st.integers(-10, 10), st.floats(-1e6, 1e6))
WEIGHT_ITEMS = st.one_of(REAL, st.none(), st.text(max_size=1), st.complex_numbers(max_magnitude=5))


@st.composite
def weights(draw):
    items = draw(
        st.one_of(
            st.lists(REAL, min_size=len(VOCAB), max_size=len(VOCAB)),
            st.lists(WEIGHT_ITEMS, max_size=len(VOCAB) + 1),
        )
    )
    form = draw(st.sampled_from(["list", "numpy", "torch"]))
    if form == "list":
        return items
    try:
        array = np.array(items)
        return array if form == "numpy" else torch.from_numpy(array)
    except (TypeError, ValueError):
        return items


def valid_weights(ws):
    values = ws.tolist() if isinstance(ws, torch.Tensor | np.ndarray) else ws
    return (
        isinstance(values, list)
        and len(values) == len(VOCAB)
        and all(isinstance(v, bool | int | float) for v in values)
    )


def brute_force_sums(trie, ws):
    values = [float(v) for v in (ws.tolist() if hasattr(ws, "tolist") else ws)]
    return np.array(
        [
            sum(v for token, v in zip(VOCAB, values, strict=True) if token.startswith(bytes(p)))
            if node not in trie.leaf2word
            else values[trie.leaf2word[node][1]]
            for node, p in sorted(trie.node2prefix.items())
        ]
    )


@pytest.fixture(scope="module")
def tries():
    sequential = TokenCharacterTrie(VOCAB)
    parallel = ParallelTokenCharacterTrie(VOCAB, device="cpu")
    ones = np.ones(len(VOCAB))
    for trie in (sequential, parallel):  # compile the kernels outside the time limits
        trie.weight_sum(ones)
        trie.weight_max(ones)
        trie.batch_weight_sum([ones] * 9)
    return sequential, parallel, sequential


@FAST
@given(ws=weights(), which=st.sampled_from(["sequential", "parallel"]))
def test_trie_weight_sum(tries, ws, which):
    trie = tries[0] if which == "sequential" else tries[1]
    kind, value = outcome(lambda: trie.weight_sum(ws))
    assert (kind == "ok") == valid_weights(ws), (ws, value)
    if kind == "ok":
        # float32 trie sums vs a float64 brute force over 5 weights of magnitude up to 1e6:
        # float32 keeps ~7 digits (rtol 1e-5); atol for sums that cancel to near 0
        np.testing.assert_allclose(value, brute_force_sums(tries[2], ws), rtol=1e-5, atol=1e-3)
        batched = trie.batch_weight_sum([ws, ws])
        np.testing.assert_allclose(batched, [value, value], rtol=1e-5, atol=1e-3)


@FAST
@given(bad=weights(), good=st.lists(REAL, min_size=len(VOCAB), max_size=len(VOCAB)))
def test_async_trie_fails_only_the_bad_caller(tries, bad, good):
    trie = AsyncTokenCharacterTrie(tries[0])

    async def both():
        return await asyncio.gather(
            trie.weight_sum(good), trie.weight_max(bad), return_exceptions=True
        )

    kind, (good_result, bad_result) = run_async(both)
    assert kind == "ok"
    np.testing.assert_allclose(good_result, brute_force_sums(tries[2], good), rtol=1e-5, atol=1e-3)
    if valid_weights(bad):
        np.testing.assert_allclose(bad_result, tries[0].weight_max(bad), rtol=1e-6, atol=1e-30)
    else:
        assert isinstance(bad_result, ValueError | TypeError), bad_result
    trie.close()


# -- Token, decode_vocab ---------------------------------------------------------------------


@FAST
@given(
    token_id=st.one_of(st.integers(-5, 2**40), st.builds(np.int64, st.integers(0, 99)), SCALARS),
    data=st.one_of(st.binary(max_size=4), st.builds(bytearray, st.binary(max_size=3)), SCALARS),
)
def test_token_construction(token_id, data):
    kind, token = outcome(lambda: Token(token_id, data))
    accepted = (
        isinstance(token_id, numbers.Integral)
        and not isinstance(token_id, bool)
        and token_id >= 0
        and isinstance(data, bytes | bytearray)
    )
    assert (kind == "ok") == accepted, token
    if accepted:
        assert token.token_id == int(token_id) and type(token.token_id) is int
        assert token.byte_string == bytes(data) and len(token) == len(data)
        clone = copy.deepcopy(token)
        assert clone == token and clone is not token
        assert pickle.loads(pickle.dumps(token)) == token
        with pytest.raises(AttributeError):
            token.token_id = 0


@settings(FAST, max_examples=20)
@given(tokenizer=JUNK)
def test_decode_vocab_refuses_what_is_not_a_tokenizer(tokenizer):
    kind, value = outcome(lambda: decode_vocab(tokenizer))
    assert kind == "error", value


@settings(FAST, max_examples=15)
@given(fallback=st.one_of(st.text(max_size=8), JUNK))
def test_decode_vocab_refuses_unknown_fallbacks(smollm2_tokenizer, fallback):
    if fallback in ("tokenizer", "latin1", "replace"):
        return
    kind, value = outcome(lambda: decode_vocab(smollm2_tokenizer, fallback))
    assert kind == "error" and isinstance(value, ValueError), value


# -- OutputCache, AutoBatcher --------------------------------------------------------------


@FAST
@given(
    maxsize=st.one_of(st.integers(-2, 4), SCALARS),
    move_to_cpu=st.one_of(st.booleans(), SCALARS),
    ops=st.lists(st.tuples(st.sampled_from(["set", "get"]), st.integers(0, 5)), max_size=12),
)
def test_output_cache_is_an_lru_map(maxsize, move_to_cpu, ops):
    kind, cache = outcome(lambda: OutputCache(maxsize, move_to_cpu))
    valid_size = isinstance(maxsize, int) and not isinstance(maxsize, bool) and maxsize >= 0
    assert (kind == "ok") == (valid_size and isinstance(move_to_cpu, bool)), cache
    if kind != "ok":
        return
    model = OrderedDict()  # the reference LRU map
    for op, key in ops:
        if op == "set":
            cache[(key,)] = torch.tensor([key])
            if maxsize:
                model[(key,)] = key
                model.move_to_end((key,))
                while len(model) > maxsize:
                    model.popitem(last=False)
        elif (key,) in model:
            assert int(cache[[key]]) == key
            model.move_to_end((key,))
        else:
            assert (key,) not in cache
    assert len(cache) == len(model)


@FAST
@given(
    batch_size=st.one_of(st.integers(-1, 5), SCALARS),
    timeout=st.one_of(st.floats(0, 1e9), st.none(), SCALARS),
    keys=st.lists(st.integers(-5, 5), max_size=12),
)
def test_autobatcher_answers_every_key_or_refuses_its_settings(batch_size, timeout, keys):
    kind, batcher = outcome(
        lambda: AutoBatcher(lambda ks: [k * k for k in ks], batch_size, timeout)
    )
    valid_size = (
        isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1
    )
    valid_timeout = timeout is None or (
        isinstance(timeout, int | float)
        and not isinstance(timeout, bool)
        and math.isfinite(timeout)
        and timeout >= 0
    )
    assert (kind == "ok") == (valid_size and valid_timeout), batcher
    if kind != "ok":
        return

    async def submit_all():
        return await asyncio.gather(*(batcher.submit(k) for k in keys))

    assert run_async(submit_all) == ("ok", [k * k for k in keys])
    assert all(size <= batch_size for size in batcher.batch_sizes)
    batcher.pause()


# -- load_model_by_name ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_locations(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-models")
    (root / "empty").mkdir()
    (root / "junk.gguf").write_bytes(b"GGUF" + bytes(64))
    (root / "text.gguf").write_text("hello")
    (root / "weights.bin").write_bytes(b"\0")
    return [str(root / name) for name in ("empty", "junk.gguf", "text.gguf", "weights.bin")] + [
        str(root / "missing"),
        str(root / "missing.gguf"),
        str(root / "a" / "b" / "c"),
    ]


@settings(FAST, max_examples=25)
@given(data=st.data())
def test_load_model_by_name_fails_clearly(bad_locations, data):
    name = data.draw(st.one_of(st.sampled_from(bad_locations), JUNK), label="name")
    backend = data.draw(st.sampled_from(["mock", "hf", "bogus", None, 3]), label="backend")
    kind, value = outcome(
        lambda: load_model_by_name(name, backend=backend),
        errors=(*CLEAR_ERRORS, OSError, ImportError),
    )
    assert kind == "error", value

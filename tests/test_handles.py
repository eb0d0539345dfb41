"""Prefix handles (SPEC §3, "Prefix handles"): `PrefixHandle` reads as its ids, is a value
of its LM, and serves every call that takes token ids on every backend with the rows the
list form gives; bad handles fail before any work.

Rows are compared between two LMs of one backend fed the same requests, one with lists and
one with handles (bitwise on the mock; within 1e-6 on the others), or with the stand-in
engines' own rows. What a handle reads (``len``, ``h[i]``, slices, ``iter``) is compared
with the tuple of its ids, built apart.
"""

import asyncio
import copy
import gc
import pickle
import random
import warnings
import weakref

import pytest
import torch

from genlm.backend.llm import AsyncLM, MockAsyncLM, PrefixHandle
from genlm.backend.llm.handle import CHUNK

VOCAB_SIZE = 49152  # SmolLM2's tokenizer


@pytest.fixture(scope="module")
def mock(smollm2_tokenizer):
    with MockAsyncLM(smollm2_tokenizer) as lm:
        yield lm


# -- what a handle reads --------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 7])
def test_a_handle_reads_as_the_tuple_of_its_ids(mock, length):
    rng = random.Random(length)
    ids = [rng.randrange(VOCAB_SIZE) for _ in range(length)]
    handle = mock.handle(ids)
    extended = []
    for _ in range(2 * CHUNK + 3):  # its extensions too, across chunk boundaries
        new = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(3))]
        handle, ids = handle.extend(new), ids + new
        extended.append((handle, tuple(ids)))
    for handle, expected in extended:
        assert handle.ids == expected and type(handle.ids) is tuple
        assert len(handle) == len(expected) and list(handle) == list(expected)
        assert list(reversed(handle)) == list(reversed(expected))
        n = len(expected)
        for i in [0, 1, n // 2, n - 2, n - 1, -1, -n]:
            if -n <= i < n:
                assert handle[i] == expected[i]
        for a, b in [(0, n), (n - 1, n), (n // 3, n - 1), (-5, None), (None, 3), (4, 2)]:
            assert handle[a:b] == list(expected[a:b])
        assert handle[::3] == list(expected[::3])
        assert handle.index(expected[-1]) == expected.index(expected[-1])
        assert (expected[0] in handle) and (VOCAB_SIZE not in handle)
    with pytest.raises(IndexError, match="out of range"):
        handle[len(handle)]


def test_extending_leaves_the_handle_as_it_was(mock):
    parent = mock.handle([1, 2, 3])
    first, second = parent + [4], parent.extend((5, 6))
    assert parent.ids == (1, 2, 3) and first.ids == (1, 2, 3, 4) and second.ids == (1, 2, 3, 5, 6)
    assert parent.extend([]) is parent
    assert (parent + torch.tensor([7])).ids == (1, 2, 3, 7)  # ids of a tensor, as a request's
    with pytest.raises(AttributeError):
        parent.lora_name = "a"
    with pytest.raises(TypeError, match="lm.handle"):
        PrefixHandle()


def test_handles_are_values_of_their_lm(mock, smollm2_tokenizer):
    a = mock.handle([1, 2, 3]) + [4]
    b = mock.handle([1, 2]) + [3, 4]  # another path to the same ids
    assert a == b and hash(a) == hash(b) and not (a != b)
    children = [a + [5], a + [5]]
    assert children[0] == children[1] and len({*children}) == 1
    assert a != a + [5] and a != mock.handle([1, 2, 3, 5])
    assert a != (1, 2, 3, 4) and a != [1, 2, 3, 4] and (1, 2, 3, 4) != a
    with MockAsyncLM(smollm2_tokenizer) as other:
        assert a != other.handle([1, 2, 3, 4])
    mock.add_new_lora("any/path", "adapter")
    try:
        bound = mock.handle([1, 2, 3, 4], lora_name="adapter")
        assert bound != a and bound.lora_name == "adapter" and a.lora_name is None
        assert mock.handle(a, lora_name="adapter") == bound  # rebound: a new handle
    finally:
        mock.remove_lora("adapter")
    assert copy.copy(a) is a and copy.deepcopy(a) is a
    assert copy.deepcopy({"particle": [a]})["particle"][0] is a  # resampling shares it


@pytest.mark.parametrize("dump", [pickle.dumps, lambda h: pickle.dumps([h], protocol=2)])
def test_pickling_a_handle_names_its_ids(mock, dump):
    with pytest.raises(TypeError, match=r"cannot be pickled.*h\.ids"):
        dump(mock.handle([1, 2, 3]))


def test_a_handle_repr_is_one_line_of_its_length_and_last_ids(mock):
    handle = mock.handle(list(range(1000)))
    assert repr(handle) == "PrefixHandle(<1000 ids: ..., 996, 997, 998, 999>, lora_name=None)"
    assert repr(mock.handle([7])) == "PrefixHandle(<1 ids: 7>, lora_name=None)"


# -- errors, before any work ----------------------------------------------------------------


class CountingMock(MockAsyncLM):
    """The mock, counting the rows it computes (any work on a request)."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.computed = 0

    def _logprobs(self, query):
        self.computed += 1
        return super()._logprobs(query)


class ShortContextMock(CountingMock):
    @property
    def max_context_length(self):
        return 8


@pytest.fixture
def counting(smollm2_tokenizer):
    with CountingMock(smollm2_tokenizer) as lm:
        yield lm


def calls_with(lm, handle, **kwargs):
    """Every call that takes token ids, with ``handle`` where the ids go (`AsyncLM.handle`
    too, which binds a handle bound to no adapter instead: `test_handles_are_values_of_their_lm`)."""
    return [
        lambda: lm.next_token_logprobs_sync(handle, **kwargs),
        lambda: asyncio.run(lm.next_token_logprobs(handle, **kwargs)),
        lambda: lm.batch_next_token_logprobs_sync([[1, 2], handle], **kwargs),
        lambda: asyncio.run(lm.batch_next_token_logprobs([handle], **kwargs)),
        lambda: asyncio.run(lm.sample(handle, 3, [0], **kwargs)),
        lambda: asyncio.run(lm.batch_sample([handle], 3, [0], **kwargs)),
        *([lambda: lm.handle(handle, **kwargs)] if handle.lora_name or not kwargs else []),
    ]


def test_a_handle_of_another_lm_is_refused_naming_both(counting, smollm2_tokenizer):
    with MockAsyncLM(smollm2_tokenizer) as other:
        foreign = other.handle([1, 2, 3])
        for call in calls_with(counting, foreign):
            with pytest.raises(ValueError, match=r"made by another LM \(MockAsyncLM object at"):
                call()
    assert counting.computed == 0


def test_a_closed_lms_handle_fails_as_every_call_after_close(smollm2_tokenizer):
    lm = CountingMock(smollm2_tokenizer)
    handle = lm.handle([1, 2, 3])
    lm.close()
    with pytest.raises(RuntimeError) as closed:
        lm.next_token_logprobs_sync([1, 2, 3])
    for call in [*calls_with(lm, handle), lambda: handle + [4], lambda: lm.handle([1])]:
        with pytest.raises(RuntimeError) as raised:
            call()
        assert str(raised.value) == str(closed.value)
    assert lm.computed == 0


def test_a_handle_whose_lm_is_gone_cannot_be_extended(smollm2_tokenizer):
    lm = MockAsyncLM(smollm2_tokenizer)
    handle = lm.handle([1, 2, 3])
    lm.close()
    del lm
    gc.collect()
    with pytest.raises(RuntimeError, match="that made this handle is gone"):
        handle + [4]


def test_a_lora_name_other_than_the_handles_is_refused(counting):
    counting.add_new_lora("any/path", "adapter")
    plain = counting.handle([1, 2, 3])
    for call in calls_with(counting, plain, lora_name="adapter"):
        with pytest.raises(ValueError, match=r"lora_name='adapter' contradicts the adapter of"):
            call()
    bound = counting.handle([1, 2, 3], lora_name="adapter")
    for call in calls_with(counting, bound, lora_name="other"):
        with pytest.raises(ValueError, match=r"Unknown LoRA adapter 'other'|contradicts"):
            call()
    with pytest.raises(ValueError, match="Unknown LoRA adapter 'missing'"):
        counting.handle([1], lora_name="missing")
    assert counting.computed == 0
    # the handle's own name, or None, is its adapter
    expected = counting.next_token_logprobs_sync([1, 2, 3], lora_name="adapter")
    assert torch.equal(counting.next_token_logprobs_sync(bound, lora_name="adapter"), expected)
    assert torch.equal(counting.next_token_logprobs_sync(bound), expected)


@pytest.mark.parametrize(
    "new, error, message",
    [
        ([True], TypeError, r"token id True at position 5 \(extending a handle of 5 ids\) is not"),
        ([7, 2.0], TypeError, r"token id 2.0 at position 6 \(extending a handle of 5 ids\) is not"),
        ([-1], ValueError, r"token id -1 at position 5 \(extending a handle of 5 ids\) is out"),
        ([3, 4, VOCAB_SIZE], ValueError, r"49152 at position 7 \(extending a handle of 5 ids\)"),
        (["7"], TypeError, r"token id '7' at position 5 \(extending a handle of 5 ids\)"),
        ("abc", TypeError, "not a string"),
        ({1, 2}, TypeError, "ordered sequence"),
    ],
)
def test_bad_new_ids_name_their_position_and_the_handles_length(counting, new, error, message):
    handle = counting.handle([1, 2, 3, 4, 5])
    with pytest.raises(error, match=message):
        handle.extend(new)
    with pytest.raises(error, match=message):
        handle + new
    assert counting.computed == 0


def test_a_handle_of_another_handle_is_refused_as_new_ids(counting):
    handle = counting.handle([1, 2])
    with pytest.raises(TypeError, match="not a PrefixHandle"):
        handle + handle
    with pytest.raises(TypeError, match=r"got PrefixHandle; for one handle, pass \[h\]"):
        counting.batch_next_token_logprobs_sync(handle)


@pytest.mark.parametrize(
    "ids, error, message",
    [
        ([], ValueError, "token_ids is empty"),
        ([1, -2], ValueError, "token id -2 at position 1 is outside"),
        ([1, 2.5], TypeError, "token id 2.5 at position 1 is not an integer"),
        ("12", TypeError, "not a string"),
    ],
)
def test_a_handle_is_checked_as_a_request(counting, ids, error, message):
    with pytest.raises(error, match=message):
        counting.handle(ids)
    assert counting.computed == 0


def test_a_context_past_the_models_length_is_refused(smollm2_tokenizer):
    with ShortContextMock(smollm2_tokenizer) as lm:
        with pytest.raises(ValueError, match="context length of 8 tokens"):
            lm.handle(list(range(9)))
        handle = lm.handle(list(range(6)))
        with pytest.raises(ValueError, match="a handle of 6 tokens by 3 gives 9 tokens.*of 8"):
            handle + [1, 2, 3]
        assert (handle + [1, 2]).ids == (0, 1, 2, 3, 4, 5, 1, 2)
        assert lm.computed == 0
        # sampling stops at the context length, as with a list
        tokens = asyncio.run(lm.sample(handle, 10, [], seed=1))
        assert tokens == asyncio.run(lm.sample(list(range(6)), 10, [], seed=1))
        assert len(tokens) == 3


# -- a subclass a user wrote for lists ------------------------------------------------------


class ListLM(AsyncLM):
    """An LM a user wrote before handles: it records what its methods get."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.seen = []
        self.kinds = []

    def _row(self, token_ids, lora_name):
        self.seen.append((list(token_ids), lora_name))
        self.kinds.append(type(token_ids))
        row = torch.full((self.vocab_size,), -1e9)
        row[sum(token_ids) % self.vocab_size] = 0.0
        return row

    async def next_token_logprobs(self, token_ids, *, lora_name=None):
        return self._row(token_ids, lora_name)

    def next_token_logprobs_sync(self, token_ids, lora_name=None):
        return self._row(token_ids, lora_name)

    def batch_next_token_logprobs_sync(self, token_ids_list, *, lora_name=None):
        assert all(type(ids) is list for ids in token_ids_list)
        return torch.stack([self._row(ids, lora_name) for ids in token_ids_list])

    def _load_lora(self, lora_path, lora_name):
        pass


async def test_a_subclass_written_for_lists_gets_the_ids_of_a_handle(smollm2_tokenizer):
    lm = ListLM(smollm2_tokenizer)
    handle = lm.handle([1, 2, 3]) + [4]
    await lm.next_token_logprobs(handle)
    lm.next_token_logprobs_sync(token_ids=handle)
    lm.batch_next_token_logprobs_sync([handle, [5]])
    await lm.batch_next_token_logprobs([handle, [5]])  # the base's, over its own method
    assert lm.seen == [([1, 2, 3, 4], None)] * 2 + [([1, 2, 3, 4], None), ([5], None)] * 2
    assert lm.kinds[:3] == [list] * 3 and PrefixHandle not in lm.kinds
    lm.seen.clear()
    tokens = await lm.sample(handle, 3, [])  # each step's context as a list
    assert [ids for ids, _ in lm.seen] == [
        [1, 2, 3, 4],
        [1, 2, 3, 4, tokens[0]],
        [1, 2, 3, 4, *tokens[:2]],
    ]
    lm.add_new_lora("any/path", "adapter")
    lm.seen.clear()
    bound = lm.handle([1, 2], lora_name="adapter")
    await lm.next_token_logprobs(bound)
    lm.batch_next_token_logprobs_sync([bound])
    assert lm.seen == [([1, 2], "adapter")] * 2
    with pytest.raises(ValueError, match="takes one lora_name per batch"):
        lm.batch_next_token_logprobs_sync([bound, [5]])
    with pytest.raises(ValueError, match="contradicts"):
        lm.next_token_logprobs_sync(handle, lora_name="adapter")
    with MockAsyncLM(smollm2_tokenizer) as other:
        with pytest.raises(ValueError, match="made by another LM"):
            lm.next_token_logprobs_sync(other.handle([1]))


# -- rows equal to the list form, on every backend -------------------------------------------


def particle_requests(seed, particles, prompt_length, steps):
    """A run's requests, the same for both forms: each step every particle asks for its
    row, then particles are resampled (shared) and each extended by a token (forks of
    one parent included). Tokens and ancestors are drawn apart from the rows."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB_SIZE) for _ in range(prompt_length)]
    plan = []
    for _ in range(steps):
        ancestors = [rng.randrange(particles) for _ in range(particles)]
        tokens = [rng.randrange(VOCAB_SIZE) for _ in range(particles)]
        plan.append((ancestors, tokens))
    return prompt, plan


async def run_particles(lm, form, prompt, plan, particles):
    """The rows of every step: each particle an asyncio task awaiting its own request
    (``form``: "lists" or "handles"); then a batch call mixing both kinds, and samples."""
    start = lm.handle(prompt) if form == "handles" else list(prompt)
    contexts = [start] * particles
    rows = []
    for ancestors, tokens in plan:
        step = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        rows.append(torch.stack(step))
        contexts = [contexts[a] + [t] for a, t in zip(ancestors, tokens, strict=True)]
    mixed = [contexts[0], list(contexts[1]), *contexts[2:]]
    rows.append(await lm.batch_next_token_logprobs(mixed))
    rows.append(lm.batch_next_token_logprobs_sync(mixed))
    rows.append(lm.next_token_logprobs_sync(contexts[-1])[None])
    samples = await lm.batch_sample(contexts[:2], 4, [0], seed=3)
    samples.append(await lm.sample(contexts[2], 4, [0], seed=5))
    return rows, samples


def mock_lm(tokenizer, monkeypatch):
    return MockAsyncLM(tokenizer, batch_size=64)


HF_MODELS = {}


def hf_lm(tokenizer, monkeypatch, kv_reuse=True):
    from small_models import tiny_llama

    from genlm.backend.llm.hf import AsyncTransformer, forward

    if not kv_reuse:
        monkeypatch.setattr(forward, "kv_layout", lambda *args: (None, "test"))
    if "llama" not in HF_MODELS:
        HF_MODELS["llama"] = tiny_llama(len(tokenizer), std=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # KV reuse is off (without_kv_reuse)
        return AsyncTransformer(HF_MODELS["llama"], tokenizer, batch_size=64)


def mlx_lm(tokenizer, monkeypatch, kv_reuse=True):
    pytest.importorskip("mlx_lm")
    from test_mlx import tiny_llama

    from genlm.backend.llm.mlx import AsyncMlxLM

    layers = ["full_attention"] * 2 if kv_reuse else ["sliding_attention", "full_attention"]
    model = tiny_llama(len(tokenizer), layers, None if kv_reuse else 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # KV reuse is off (without_kv_reuse)
        return AsyncMlxLM(model, tokenizer, batch_size=64)


def vllm_lm(tokenizer, monkeypatch):
    from test_vllm_standin import StandInEngine, use_fake_vllm_api

    from genlm.backend.llm.vllm import AsyncVirtualLM, LogitsProcessorCapture

    use_fake_vllm_api(monkeypatch)
    engine = StandInEngine(tokenizer, len(tokenizer.get_vocab()))
    return AsyncVirtualLM(engine, LogitsProcessorCapture(), batch_size=64, timeout=0.01)


def sgl_lm(tokenizer, monkeypatch):
    from test_sgl import StandInSGLEngine

    from genlm.backend.llm.sgl import AsyncSGLTransformer

    return AsyncSGLTransformer(StandInSGLEngine(tokenizer, len(tokenizer.get_vocab())))


BACKENDS = {
    "mock": mock_lm,
    "hf": hf_lm,
    "hf-without-kv-reuse": lambda t, m: hf_lm(t, m, kv_reuse=False),
    "mlx": mlx_lm,
    "mlx-without-kv-reuse": lambda t, m: mlx_lm(t, m, kv_reuse=False),
    "vllm-stand-in": vllm_lm,
    "sgl-stand-in": sgl_lm,
}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_rows_with_handles_are_the_rows_with_lists(backend, smollm2_tokenizer, monkeypatch):
    make = BACKENDS[backend]
    # past two chunk boundaries; past one on the stand-in engines (a row costs ~0.1 s there)
    particles, steps = (6, 2 * CHUNK + 2) if "stand-in" not in backend else (3, 6)
    prompt, plan = particle_requests(0, particles, CHUNK - 3, steps)
    results = {}
    for form in ("lists", "handles"):
        lm = make(smollm2_tokenizer, monkeypatch)
        try:
            results[form] = asyncio.run(run_particles(lm, form, prompt, plan, particles))
        finally:
            lm.close()
    (list_rows, list_samples), (handle_rows, handle_samples) = results["lists"], results["handles"]
    assert handle_samples == list_samples
    for expected, got in zip(list_rows, handle_rows, strict=True):
        if backend == "mock":
            assert torch.equal(got, expected)
        else:
            assert (got - expected).abs().max().item() <= 1e-6


def test_cache_calls_take_handles(smollm2_tokenizer, monkeypatch):
    lm = hf_lm(smollm2_tokenizer, monkeypatch)
    try:
        ids = list(range(100, 140))
        handle = lm.handle(ids[:20]) + ids[20:]
        lm.cache_kv(handle)
        walked, listed = lm.walk_cache(handle), lm.walk_cache(ids)
        assert walked.node is listed.node and walked.next_token_index == 39
        assert torch.equal(walked.past, listed.past)
        row = lm.next_token_logprobs_uncached(handle)
        assert torch.equal(row, lm.next_token_logprobs_uncached(ids))
        assert lm.add_query(handle) == 0
        (queued,) = lm.batch_evaluate_queries()
        assert (queued - row).abs().max().item() <= 1e-4
    finally:
        lm.close()


@pytest.mark.mlx
def test_mlx_cache_calls_take_handles(smollm2_tokenizer, monkeypatch):
    lm = mlx_lm(smollm2_tokenizer, monkeypatch)
    try:
        ids = list(range(100, 140))
        handle = lm.handle(ids[:20]) + ids[20:]
        lm.cache_kv(handle)
        walked, listed = lm.walk_cache(handle), lm.walk_cache(ids)
        assert walked.node is listed.node and walked.next_token_index == 39
    finally:
        lm.close()


# -- nothing left behind -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["mock", "hf", "vllm-stand-in", "sgl-stand-in"])
def test_a_handle_is_freed_once_dropped_after_its_requests(backend, smollm2_tokenizer, monkeypatch):
    """Nothing refers to a handle once its requests are answered: dropped, it is freed at
    once (no reference cycle waits for the collector)."""
    lm = BACKENDS[backend](smollm2_tokenizer, monkeypatch)
    try:
        handle = lm.handle(list(range(1, 50)))
        child = handle + [7]

        async def requests(handle, child):
            await lm.next_token_logprobs(handle)
            await asyncio.gather(lm.next_token_logprobs(child), lm.next_token_logprobs(child))
            await lm.sample(child, 3, [], seed=1)

        asyncio.run(requests(handle, child))
        lm.next_token_logprobs_sync(child)
        lm.batch_next_token_logprobs_sync([child])
        refs = [weakref.ref(handle), weakref.ref(child)]
        del handle, child
        assert [ref() for ref in refs] == [None, None]
        assert not lm._prefixes._current and not lm._prefixes._previous
    finally:
        lm.close()


def test_a_handle_refers_to_its_lm_weakly(smollm2_tokenizer):
    lm = MockAsyncLM(smollm2_tokenizer)
    handle = lm.handle([1, 2])
    ref = weakref.ref(lm)
    lm.close()
    del lm
    gc.collect()
    assert ref() is None and len(handle) == 2

"""A failed or hostile call changes nothing, and arguments are taken as given at the call.

Each case sends what a user sent once (an edited row, an extended ``byte_vocab``, a generator
of eos ids, a temperature of 1e-300, a seed past 2**63, a prompt at the context limit,
weights changed before the batch runs) and checks the result against an independent
computation, or the error.
"""

import asyncio

import numpy as np
import pytest
import torch
from held_memory import assert_rows_hold_only_themselves

from genlm.backend import AsyncTokenCharacterTrie, Token
from genlm.backend.llm import MockAsyncLM
from genlm.backend.llm.engine import EngineLM
from genlm.backend.llm.hf import AsyncTransformer


@pytest.fixture(scope="module")
def mock(smollm2_tokenizer):
    with MockAsyncLM(smollm2_tokenizer) as lm:
        yield lm


@pytest.fixture(scope="module")
def hf_lm(hf_model, smollm2_tokenizer):
    with AsyncTransformer(hf_model, smollm2_tokenizer) as lm:
        yield lm


def plain(hf_model, ids):
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)


# -- a returned row is the caller's own ------------------------------------------------------


def edit_in_place(row):
    row /= 0.5  # allowed: the caller's copy


async def test_mock_rows_edited_in_place_leave_its_tables_alone(smollm2_tokenizer):
    with MockAsyncLM(smollm2_tokenizer) as lm, MockAsyncLM(smollm2_tokenizer) as fresh:
        edit_in_place(await lm.next_token_logprobs([5, 6]))
        edit_in_place(lm.next_token_logprobs_sync([5, 6]))
        edit_in_place(lm.batch_next_token_logprobs_sync([[5, 6]]))
        expected = fresh.next_token_logprobs_sync([5, 6])
        assert torch.equal(await lm.next_token_logprobs([5, 6]), expected)
        assert torch.equal(lm.batch_next_token_logprobs_sync([[5, 6]])[0], expected)


class EchoEngineLM(EngineLM):
    """An `EngineLM` whose engine answers a fixed normalized row per prefix."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, 10, None, 8, 0.01, "genlm-echo")

    def _compute_batch(self, keys):
        return [self.expected(key.token_ids) for key in keys]

    def expected(self, ids):
        generator = torch.Generator().manual_seed(sum(ids))
        return torch.log_softmax(torch.randn(self.vocab_size, generator=generator), -1)

    def _stop_engine(self):
        pass


async def test_output_cache_hits_edited_in_place_leave_the_cache_alone(smollm2_tokenizer):
    with EchoEngineLM(smollm2_tokenizer) as lm:
        edit_in_place(await lm.next_token_logprobs([3, 4]))  # fills the cache
        for row in (await lm.next_token_logprobs([3, 4]), lm.next_token_logprobs_sync([3, 4])):
            edit_in_place(row)  # cache hits
        assert torch.equal(lm.next_token_logprobs_sync([3, 4]), lm.expected([3, 4]))


async def test_mock_and_engine_rows_hold_only_themselves(smollm2_tokenizer):
    """A row a caller keeps holds its own floats: not a batch's (an engine LM's rows are
    views of one ``[B, V]`` tensor as computed), nor a duplicate caller's."""

    class BatchEngineLM(EchoEngineLM):
        def _compute_batch(self, keys):
            return torch.stack([self.expected(key.token_ids) for key in keys])

    prompts = [[5, 6], [7], [5, 6], [8, 9, 10]]
    with MockAsyncLM(smollm2_tokenizer) as mock, BatchEngineLM(smollm2_tokenizer) as engine:
        for lm in (mock, engine):
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
            rows.append(lm.next_token_logprobs_sync([11]))
            assert_rows_hold_only_themselves(rows, lm.vocab_size)
            assert torch.equal(rows[0], rows[2]) and rows[0] is not rows[2]


@pytest.mark.slow
async def test_hf_rows_edited_in_place_leave_the_cache_alone(hf_lm, hf_model, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Rows stay as computed")
    edit_in_place(hf_lm.next_token_logprobs_sync(ids))
    edit_in_place(await hf_lm.next_token_logprobs(ids))  # a cache hit
    assert (hf_lm.next_token_logprobs_sync(ids) - plain(hf_model, ids)).abs().max() <= 1e-4


@pytest.mark.mlx
def test_mlx_rows_edited_in_place_leave_the_cache_alone_and_context_is_enforced(
    default_model_dir,
):
    mlx_lm = pytest.importorskip("mlx_lm")
    from genlm.backend.llm.mlx import AsyncMlxLM

    model, tokenizer = mlx_lm.load(default_model_dir)
    with AsyncMlxLM(model, tokenizer) as lm:
        ids = lm.tokenizer.encode("Rows stay as computed")
        first = lm.next_token_logprobs_sync(ids).clone()
        edit_in_place(lm.next_token_logprobs_sync(ids))
        assert torch.equal(lm.next_token_logprobs_sync(ids), first)
        limit = model.args.max_position_embeddings
        assert lm.max_context_length == limit
        with pytest.raises(ValueError, match=f"context length of {limit}"):
            lm.next_token_logprobs_sync([1] * (limit + 1))


# -- byte_vocab extended by a caller -----------------------------------------------------------


@pytest.mark.slow
async def test_appending_to_byte_vocab_changes_neither_validation_nor_rows(
    hf_model, smollm2_tokenizer
):
    with AsyncTransformer(hf_model, smollm2_tokenizer) as lm:
        size = lm.vocab_size
        lm.byte_vocab.append(Token(size, b"<eos>"))  # as clients do for a trie's EOS symbol
        assert lm.vocab_size == size
        good = smollm2_tokenizer.encode("Still right")
        batches = len(lm.batcher.batch_sizes)
        results = await asyncio.gather(
            lm.next_token_logprobs(good), lm.next_token_logprobs([1, size]), return_exceptions=True
        )
        assert isinstance(results[1], ValueError) and str(size) in str(results[1])
        assert (results[0] - plain(hf_model, good)).abs().max() <= 1e-4
        assert list(lm.batcher.batch_sizes)[batches:] == [1]  # the bad id never reached a batch


# -- sampling arguments -----------------------------------------------------------------------


async def test_eos_ids_from_a_generator_stop_every_prompt(mock):
    prompts = [[1, 2], [3, 4], [5, 6]]
    free = await mock.batch_sample(prompts, 4, [], seed=11)
    eos = free[2][0]  # the first token the last prompt draws
    expected = await mock.batch_sample(prompts, 4, [eos], seed=11)
    assert expected[2] == []
    assert await mock.batch_sample(prompts, 4, (t for t in [eos]), seed=11) == expected


@pytest.mark.parametrize("eos", [[49152], [-1], [5, 10**9]])
async def test_eos_ids_outside_the_vocabulary_are_refused(mock, eos):
    bad = [e for e in eos if not 0 <= e < mock.vocab_size][0]
    for call in (
        mock.sample([1, 2], 3, eos),
        mock.batch_sample([[1, 2]], 3, eos),
    ):
        with pytest.raises(ValueError, match=f"eos token id {bad} "):
            await call


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-300, 5e-324])
async def test_a_tiny_temperature_draws_the_greedy_token(hf_lm, hf_model, temperature):
    prompt = hf_lm.tokenizer.encode("The capital of France is")
    tokens = await hf_lm.sample(prompt, 3, [], temperature=temperature, seed=0)
    context = list(prompt)
    for token in tokens:
        assert token == int(plain(hf_model, context).argmax())
        context.append(token)
    assert len(tokens) == 3


@pytest.mark.parametrize(
    "seed, error",
    [
        (2**63, ValueError),
        (2**64, ValueError),
        (-1, ValueError),
        (1.5, TypeError),
        ("3", TypeError),
    ],
)
async def test_seeds_outside_the_generators_range_are_refused(mock, seed, error):
    with pytest.raises(error, match="seed"):
        await mock.sample([1, 2], 3, [], seed=seed)
    with pytest.raises(ValueError, match=r"seed \+ i"):
        await mock.batch_sample([[1], [2], [3]], 3, [], seed=2**63 - 2)
    assert len(await mock.batch_sample([[1], [2]], 2, [], seed=2**63 - 2)) == 2


class ShortContextMock(MockAsyncLM):
    max_context_length = 6


async def test_sampling_stops_at_the_context_length_and_keeps_what_it_has(smollm2_tokenizer):
    with ShortContextMock(smollm2_tokenizer) as lm:
        # Prefixes of 4, 5 and 6 tokens are allowed: three tokens, then the limit.
        assert len(await lm.sample([1, 2, 3, 4], 10, [], seed=1)) == 3
        done = await lm.batch_sample([[1] * 6, [1, 2]], 10, [], seed=1)
        assert [len(tokens) for tokens in done] == [1, 5]
        with pytest.raises(ValueError, match="context length of 6"):
            await lm.batch_sample([[1, 2], [1] * 7], 10, [])


@pytest.mark.slow
async def test_hf_sampling_stops_at_the_context_length(hf_lm, monkeypatch):
    monkeypatch.setattr(AsyncTransformer, "max_context_length", property(lambda self: 8))
    prompt = hf_lm.tokenizer.encode("One two three four five")
    tokens = await hf_lm.sample(prompt, 20, [], seed=3)
    assert len(tokens) == 8 - len(prompt) + 1


# -- the async trie takes weights as given at the call ------------------------------------------


@pytest.mark.parametrize("form", ["numpy", "torch"])
async def test_async_trie_weights_changed_before_the_batch_runs_do_not_count(form):
    vocab = [Token(i, b) for i, b in enumerate([b"a", b"ab", b"b"])]
    with_weights = np.array([0.5, 0.25, 0.25])
    async with AsyncTokenCharacterTrie.from_vocab(vocab) as trie:
        ws = with_weights.copy() if form == "numpy" else torch.tensor(with_weights)
        pending = asyncio.ensure_future(trie.weight_sum(ws))
        await asyncio.sleep(0)  # the call has been made; its batch has not run yet
        ws[:] = 100.0
        result = await pending
    # brute force: the root holds everything, node "a" holds tokens 0 and 1
    assert result[trie.trie.root] == pytest.approx(1.0)
    node_a = trie.trie.children[trie.trie.root][b"a"[0]]
    assert result[node_a] == pytest.approx(0.75)


# -- loading: errors that name what is wrong, before the work ---------------------------------


@pytest.mark.slow
def test_a_tokenizer_of_another_model_is_refused(hf_model):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # every byte: a complete tokenizer
    vocab = {symbol: i for i, symbol in enumerate(alphabet + [f"<t{i}>" for i in range(28)])}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    small = PreTrainedTokenizerFast(tokenizer_object=raw)
    with pytest.raises(ValueError, match="284 tokens but the model's output layer 49152"):
        AsyncTransformer(hf_model, small)


def test_decode_vocab_of_a_raw_tokenizers_object_says_what_to_pass(smollm2_tokenizer):
    from genlm.backend import decode_vocab

    with pytest.raises(TypeError, match="PreTrainedTokenizerFast"):
        decode_vocab(smollm2_tokenizer.backend_tokenizer)


@pytest.fixture
def model_copy(default_model_dir, tmp_path):
    """A copy of the default model's directory, to break."""
    import shutil

    target = tmp_path / "model"
    shutil.copytree(default_model_dir, target)
    return target


def test_a_home_relative_path_is_expanded(model_copy, monkeypatch):
    monkeypatch.setenv("HOME", str(model_copy.parent))
    with MockAsyncLM.from_name("~/model") as lm:
        assert lm.vocab_size == 49152
    with AsyncTransformer.from_name("~/model", hf_opts={"dtype": "float32"}) as lm:
        assert lm.vocab_size == 49152


def test_a_directory_without_config_or_tokenizer_names_the_missing_file(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        AsyncTransformer.from_name(str(model_copy))
    MockAsyncLM.from_name(str(model_copy)).close()  # the tokenizer alone is enough there
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_copy / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="has no tokenizer files"):
        MockAsyncLM.from_name(str(model_copy))


def test_truncated_weights_name_the_model_path(model_copy):
    weights = next(model_copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=str(model_copy)) as caught:
        AsyncTransformer.from_name(str(model_copy))
    assert caught.value.__cause__ is None  # one error, no chained loader traceback


def test_a_hub_id_offline_says_what_to_pass_instead(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="default_model_path"):
        AsyncTransformer.from_name("someone/not-downloaded")


@pytest.mark.parametrize(
    "kwargs, error, needle",
    [
        ({"hf_opts": "float16"}, TypeError, "hf_opts"),
        ({"bitsandbytes_opts": "8bit"}, TypeError, "bitsandbytes_opts"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": "8"}, TypeError, "batch_size"),
        ({"timeout": -1}, ValueError, "timeout"),
        ({"max_kv_bytes": 1.5}, TypeError, "max_kv_bytes"),
        ({"cache_sizes": 3}, TypeError, "cache_sizes"),
    ],
)
def test_from_name_checks_its_options_before_loading(monkeypatch, kwargs, error, needle):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded a model before checking the options")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_loading)
    with pytest.raises(error, match=needle):
        AsyncTransformer.from_name("someone/any", **kwargs)


class MiscountingLM(MockAsyncLM):
    """A backend that answers one row too many or too few per batch."""

    def __init__(self, tokenizer, extra):
        super().__init__(tokenizer)
        self.extra = extra

    def _compute_batch(self, keys):
        rows = super()._compute_batch(keys)
        return rows + rows[:1] if self.extra > 0 else rows[:-1]


@pytest.mark.parametrize("extra", [1, -1])
@pytest.mark.parametrize("distinct", [True, False])
def test_a_backend_answering_too_many_or_too_few_rows_raises(smollm2_tokenizer, extra, distinct):
    """One answer per distinct request, or an error: none dropped, none taken from a
    neighbour (with and without a request asked twice in the batch)."""
    prompts = [[5, 6], [7, 8], [9]] + ([] if distinct else [[5, 6]])
    with MiscountingLM(smollm2_tokenizer, extra) as lm:
        with pytest.raises(ValueError, match="MiscountingLM gave [24] answers to 3 distinct"):
            lm.batch_next_token_logprobs_sync(prompts)

"""The released client libraries on our backends: genlm-control 0.4.1, genlm-bytes 0.2.0 and
LLaMPPL 0.2.3.

scripts/setup.sh installs them into .venv with pip's ordinary dependency resolution, next to
this repository's editable package (pins in scripts/client-requirements.txt and
locks/main.txt), so they import ``genlm.backend`` as a user's installation does; the first
test checks that it is this repository's. The set-up installs them on Python >= 3.11 (the
first two need it): on 3.10 the module is skipped. Every client answer is checked against
an independent computation: a plain transformers forward of the whole prefix for HF, the
mock's synchronous (unbatched) path for the mock.
"""

import asyncio
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from genlm.backend.llm import AsyncTransformer, MockAsyncLM

if sys.version_info < (3, 11):
    pytest.skip("genlm-control and genlm-bytes need Python >= 3.11", allow_module_level=True)

from genlm.bytes import BeamParams, ByteBeamState  # noqa: E402
from genlm.control import (  # noqa: E402
    EOS,
    SMC,
    BoolFSA,
    PromptedLLM,
    direct_token_sampler,
    eager_token_sampler,
)
from llamppl import CachedCausalLM, LMContext, Model, smc_standard, smc_steer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Our HF backend's rows as a client sees them vs a plain transformers forward (as TOL in
# tests/test_hf.py: the order of float32 sums).
TOL = 1e-4
PROMPT = "The capital of France is"
CONTEXT = " Paris, the city of"


@pytest.fixture(params=["mock", pytest.param("hf", marks=pytest.mark.slow)])
def lm(request, smollm2_tokenizer):
    if request.param == "mock":
        return MockAsyncLM(smollm2_tokenizer)
    return AsyncTransformer(request.getfixturevalue("hf_model"), smollm2_tokenizer)


def reference(lm, ids, lora_name=None):
    """Next-token log-probabilities after ``ids`` without our batcher or caches."""
    if isinstance(lm, AsyncTransformer):
        with torch.inference_mode():
            logits = lm.model(input_ids=torch.tensor([list(ids)])).logits[0, -1]
        return torch.log_softmax(logits[: len(lm.byte_vocab)].float(), -1)
    return lm.next_token_logprobs_sync(ids, lora_name=lora_name)


def reference_steps(lm, ids):
    """``reference`` after each prefix ``ids[:1]``, ..., ``ids``: one uncached forward for HF."""
    if isinstance(lm, AsyncTransformer):
        with torch.inference_mode():
            logits = lm.model(input_ids=torch.tensor([list(ids)])).logits[0]
        return torch.log_softmax(logits[:, : len(lm.byte_vocab)].float(), -1)
    return torch.stack([reference(lm, ids[:i]) for i in range(1, len(ids) + 1)])


def prompted(lm, **kwargs):
    llm = PromptedLLM(lm, **kwargs)
    llm.set_prompt_from_str(PROMPT)
    return llm


def token_ids(context):
    return [token.token_id for token in context]


def expected_weights(llm, logprobs):
    """genlm-control's definition: the non-EOS tokens of ``llm.vocab``, then EOS's log-probability."""
    eos = logprobs[llm.model.tokenizer.eos_token_id].reshape(1)
    return torch.cat([logprobs[token_ids(llm.vocab)], eos])


def assert_close(got, expected, tol=TOL):
    diff = (got - expected).abs().max().item()
    assert diff <= tol, f"max abs diff {diff}"


def test_clients_import_this_repository_backend():
    """pip kept the editable package when it resolved the clients' requirement on it."""
    import importlib.metadata
    import inspect
    import sysconfig

    import genlm
    import genlm.backend

    assert Path(genlm.backend.__file__).resolve().is_relative_to(REPO / "genlm")
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    for client in (PromptedLLM, CachedCausalLM):
        assert Path(inspect.getfile(client)).resolve().is_relative_to(site_packages)
    assert not [p for p in genlm.__path__ if (Path(p) / "__init__.py").exists()]
    pyproject = (REPO / "pyproject.toml").read_text()
    version = re.search(r'^version = "(.+)"$', pyproject, re.MULTILINE)[1]
    assert importlib.metadata.version("genlm-backend") == version


async def test_logw_next_matches_reference(lm):
    llm = prompted(lm)
    context = llm.tokenize(CONTEXT)
    got = await llm.logw_next(context)
    assert got.weights.shape == (len(llm.vocab) + 1,)
    expected = expected_weights(llm, reference(lm, llm.prompt_ids + token_ids(context)))
    assert_close(got.weights, expected)
    assert got[EOS] == pytest.approx(expected[-1].item(), abs=TOL)


async def test_batch_logw_next_matches_reference(lm):
    llm = prompted(lm)
    context = llm.tokenize(CONTEXT)
    contexts = [[], context[:1], context]
    got = await llm.batch_logw_next(contexts)
    assert got.weights.shape == (len(contexts), len(llm.vocab) + 1)
    for row, ctx in zip(got.weights, contexts, strict=True):
        assert_close(row, expected_weights(llm, reference(lm, llm.prompt_ids + token_ids(ctx))))


async def test_log_probability_and_complete_match_reference(lm):
    llm = prompted(lm)
    ids = token_ids(llm.tokenize(CONTEXT))
    steps = reference_steps(lm, llm.prompt_ids + ids)[len(llm.prompt_ids) - 1 :]
    expected = sum(steps[i, token].item() for i, token in enumerate(ids))
    eos = steps[-1, lm.tokenizer.eos_token_id].item()
    context = llm.decode_tokens(ids)
    # sums of ~8 logprobs, each within TOL, taken by the client in float64: 1e-3 covers it
    assert await llm.log_probability(context) == pytest.approx(expected, abs=1e-3)
    assert await llm.complete(context) == pytest.approx(expected + eos, abs=1e-3)


async def test_smc_particles_finish_with_the_lm_weights(lm):
    """Without resampling, a particle's weight is log P(EOS | its tokens) when EOS was forced
    at the token budget, and 0 when it sampled EOS itself (direct sampling is exact)."""
    llm = prompted(lm)
    smc = SMC(direct_token_sampler(llm))
    max_tokens = 4
    try:
        sequences = await smc(n_particles=4, ess_threshold=0.0, max_tokens=max_tokens)
    finally:
        await smc.cleanup()
    assert sequences.size == 4
    vocab = set(llm.vocab)
    for context, log_weight in zip(sequences.contexts, sequences.log_weights, strict=True):
        assert context[-1] is EOS and 1 <= len(context) <= max_tokens
        assert all(token in vocab for token in context[:-1])
        expected = 0.0
        if len(context) == max_tokens:
            logprobs = reference(lm, llm.prompt_ids + token_ids(context[:-1]))
            expected = logprobs[lm.tokenizer.eos_token_id].item()
        assert log_weight == pytest.approx(expected, abs=1e-3)


async def test_prompted_llm_forwards_under_its_lora_adapter(smollm2_tokenizer):
    lm = MockAsyncLM(smollm2_tokenizer)
    lm.add_new_lora("x", "a")
    base, adapted = prompted(lm), prompted(lm, lora_name="a")
    context = base.tokenize(CONTEXT)
    ids = base.prompt_ids + token_ids(context)
    got_base, got_adapted = await asyncio.gather(
        base.logw_next(context), adapted.logw_next(context)
    )
    assert (got_base.weights - got_adapted.weights).abs().max().item() > 1e-2
    assert_close(got_base.weights, expected_weights(base, reference(lm, ids)))
    assert_close(got_adapted.weights, expected_weights(adapted, reference(lm, ids, "a")))
    batch = await adapted.spawn().batch_logw_next([[], context])
    assert_close(batch.weights[1], got_adapted.weights)


@pytest.mark.filterwarnings("ignore:Common vocabulary:RuntimeWarning")  # the regex's few tokens
async def test_eager_smc_under_a_regex_runs_on_our_character_trie(smollm2_tokenizer):
    """genlm-control's set samplers walk our ParallelTokenCharacterTrie over its vocabulary
    plus an EOS object: every finished particle must spell a match of the constraint."""
    pattern = r" 1[0-9][0-9][0-9]"
    llm = prompted(MockAsyncLM(smollm2_tokenizer))
    smc = SMC(eager_token_sampler(llm, BoolFSA.from_regex(pattern)))
    try:
        sequences = await smc(n_particles=3, ess_threshold=0.5, max_tokens=6)
    finally:
        await smc.cleanup()
    for context, log_weight in zip(sequences.contexts, sequences.log_weights, strict=True):
        assert context[-1] is EOS and np.isfinite(log_weight)
        assert re.fullmatch(pattern.encode(), b"".join(context[:-1]))


@pytest.mark.slow
# peft 0.21's get_peft_model reads a property transformers 5.23 deprecated
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
async def test_prompted_llm_forwards_under_a_peft_adapter_on_hf(
    random_lora, smollm2_tokenizer, tmp_path
):
    """Base and adapter rows in one batch, each against peft's own forward with the adapter
    enabled or disabled."""
    pytest.importorskip("peft")
    adapted = random_lora(tmp_path / "lora")
    ids = smollm2_tokenizer.encode(PROMPT) + smollm2_tokenizer.encode(CONTEXT)
    with torch.inference_mode():
        with_lora = adapted(input_ids=torch.tensor([ids])).logits[0, -1].log_softmax(-1)
        with adapted.disable_adapter():
            base = adapted(input_ids=torch.tensor([ids])).logits[0, -1].log_softmax(-1)

    lm = AsyncTransformer(adapted.unload(), smollm2_tokenizer)  # the base model, LoRA removed
    lm.add_new_lora(tmp_path / "lora", lora_name="mine")
    base_llm, lora_llm = prompted(lm), prompted(lm, lora_name="mine")
    context = base_llm.tokenize(CONTEXT)
    assert base_llm.prompt_ids + token_ids(context) == ids
    got_base, got_lora = await asyncio.gather(
        base_llm.logw_next(context), lora_llm.logw_next(context)
    )
    assert (got_base.weights - got_lora.weights).abs().max().item() > 1e-2
    assert_close(got_base.weights, expected_weights(base_llm, base))
    assert_close(got_lora.weights, expected_weights(lora_llm, with_lora))


async def test_prompted_llm_with_an_unknown_adapter_gets_our_error(smollm2_tokenizer):
    lm = MockAsyncLM(smollm2_tokenizer)
    with pytest.raises(ValueError, match="'missing'.*add_new_lora"):
        await prompted(lm, lora_name="missing").logw_next([])
    assert (await prompted(lm).logw_next([])).weights.isfinite().any()  # the batcher still serves


def byte_mass(probs, byte_vocab, partial):
    """Probability of the tokens whose bytes start with ``partial``, by brute force."""
    mask = [token.byte_string.startswith(partial) for token in byte_vocab]
    return probs[torch.tensor(mask)].sum().item()


# genlm-bytes builds its sparse trie matrices without torch's invariant checks
@pytest.mark.filterwarnings("ignore:Sparse:UserWarning")
async def test_byte_beam_matches_reference(lm):
    """The first byte's distribution sums the next-token probabilities by first byte; after a
    prefill, each candidate's weight is log P(its committed tokens) + log P(a next token whose
    bytes start with its partial bytes)."""
    text = b"Hello, wor"
    beam = await ByteBeamState.initial(lm, BeamParams(K=4))
    try:
        first = (await beam.logp_next()).ps
        beam = await beam.prefill(text)
        after = (await beam.logp_next()).ps
    finally:
        await beam.cleanup()

    bos = lm.tokenizer.bos_token_id
    probs = reference(lm, [bos]).exp().double().numpy()
    first_bytes = [token.byte_string[0] for token in lm.byte_vocab]
    expected = np.bincount(first_bytes, weights=probs, minlength=258)
    # byte masses: sums of up to 49k float32 probabilities (the client's trie) vs a float64
    # bincount of the reference row, itself within TOL in log space (~1e-4 relative)
    np.testing.assert_allclose(np.exp(first), expected, rtol=1e-3, atol=1e-7)

    assert np.exp(after).sum() == pytest.approx(1.0, abs=1e-6)  # normalized in float64
    assert len(beam) >= 2  # more than one tokenization of the text survives
    for state in beam:
        ids, partial = state.lm_state.context, bytes(state.partial)
        assert ids[0] == bos
        assert b"".join(lm.byte_vocab[t].byte_string for t in ids[1:]) + partial == text
        steps = reference_steps(lm, ids)
        committed = sum(steps[i - 1, ids[i]].item() for i in range(1, len(ids)))
        expected = committed + np.log(byte_mass(steps[-1].exp(), lm.byte_vocab, partial))
        # a beam weight: a sum of a few logprobs within TOL plus a log byte mass (float32)
        assert state.weight == pytest.approx(expected, rel=1e-4, abs=1e-3)


# -- LLaMPPL 0.2.3 ------------------------------------------------------------------------------
# Its CachedCausalLM wraps our LMs (it builds AsyncTransformer, AsyncVirtualLM, MockAsyncLM or
# AsyncMlxLM by from_name and reads their tokenizer and vocabularies); its LMContext asks for
# next_token_logprobs (batched: numpy rows) and next_token_logprobs_sync, and draws with numpy's
# global generator.


class NoLetter(Model):
    """LLaMPPL's README model: tokens without a given letter, conditioned on one per step
    (``observe`` of the mask), then drawn from the masked distribution; ends at EOS or after
    ``max_tokens``. Records each step's prefix and the weight its ``observe`` added."""

    def __init__(self, lm, prompt, letter, max_tokens):
        super().__init__()
        self.context = LMContext(lm, prompt)
        self.eos = lm.tokenizer.eos_token_id
        self.forbidden = {i for i, v in enumerate(lm.str_vocab) if letter in v}
        self.max_tokens = max_tokens
        self.observed = []

    async def step(self):
        prefix, before = list(self.context.tokens), self.weight
        await self.observe(self.context.mask_dist(self.forbidden), False)
        self.observed.append((prefix, self.weight - before))
        token = await self.sample(self.context.next_token())
        if token.token_id == self.eos or self.context.token_count >= self.max_tokens:
            self.finish()

    def immutable_properties(self):
        return {"forbidden"}


def check_no_letter_particles(lm, model, particles, max_tokens):
    """Each particle drew only tokens without the letter, and each ``observe`` added log P(a
    token without it | the step's prefix) by the reference rows (one forward per particle)."""
    keep = torch.ones(lm.vocab_size, dtype=torch.bool)
    keep[sorted(model.forbidden)] = False
    for particle in particles:
        tokens = [int(t) for t in particle.context.tokens]
        start = particle.context.prompt_token_count
        assert particle.finished and 1 <= len(tokens) - start <= max_tokens
        assert not set(tokens[start:]) & model.forbidden
        assert [prefix for prefix, _ in particle.observed] == [
            tokens[: start + i] for i in range(len(particle.observed))
        ]
        steps = reference_steps(lm, tokens).double()
        for prefix, added in particle.observed:
            expected = torch.logsumexp(steps[len(prefix) - 1][keep], 0).item()
            assert added == pytest.approx(expected, abs=TOL)


async def test_llamppl_rows_are_our_rows(lm):
    llm = CachedCausalLM(lm)
    ids = lm.tokenizer.encode(PROMPT)
    if isinstance(lm, AsyncTransformer):
        llm.cache_kv(ids[:-1])  # pins the prompt's KV, as LLaMPPL's examples do
    batched, unbatched = await llm.next_token_logprobs(ids), llm.next_token_logprobs_unbatched(ids)
    for got in (batched, unbatched):
        assert isinstance(got, np.ndarray) and got.shape == (lm.vocab_size,)
        assert_close(torch.from_numpy(got), reference(lm, ids))
    llm.clear_kv_cache()
    llm.clear_cache()
    llm.reset_async_queries()
    assert_close(torch.from_numpy(await llm.next_token_logprobs(ids)), reference(lm, ids))


async def test_llamppl_smc_standard_weights_are_the_lms_masses(lm):
    """Without resampling (an ESS threshold no run falls under), a particle's weight is the
    sum of what its steps' ``observe`` added."""
    np.random.seed(0)
    model = NoLetter(CachedCausalLM(lm), PROMPT, "e", max_tokens=4)
    particles = await smc_standard(model, 4, ess_threshold=1e-300)
    check_no_letter_particles(lm, model, particles, 4)
    for particle in particles:
        assert particle.weight == pytest.approx(sum(a for _, a in particle.observed), abs=1e-4)


async def test_llamppl_smc_steer_draws_and_weighs_by_the_lm(lm):
    np.random.seed(1)
    model = NoLetter(CachedCausalLM(lm), PROMPT, "a", max_tokens=3)
    particles = await smc_steer(model, 3, 2)
    assert len(particles) == 3 and all(np.isfinite(p.weight) for p in particles)
    check_no_letter_particles(lm, model, particles, 3)


async def test_llamppl_runs_the_same_whatever_the_batch_size(default_model_dir):
    """The same SMC run (numpy seeded alike) with every request a batch of its own, after
    ``batch_size`` is assigned as the reference's LMs allow: the same tokens and weights;
    the particles' requests were batched together before."""
    llm = CachedCausalLM.from_pretrained(default_model_dir, backend="mock", batch_size=32)
    assert isinstance(llm.model, MockAsyncLM) and llm.model.batch_size == 32

    async def run():
        np.random.seed(2)
        particles = await smc_standard(NoLetter(llm, PROMPT, "e", 5), 6, ess_threshold=0.5)
        return [(list(map(int, p.context.tokens)), p.weight) for p in particles]

    batched = await run()
    assert max(llm.model.batcher.batch_sizes) > 1
    llm.model.batch_size = 1
    before = llm.model.batcher.num_batches
    assert await run() == batched
    assert set(list(llm.model.batcher.batch_sizes)[before - llm.model.batcher.num_batches :]) == {1}

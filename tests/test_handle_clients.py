"""The released clients on prefix handles (issue 47): the change a client makes, for real.

LLaMPPL 0.2.3's ``LMContext`` keeps its tokens in a list, appends a token per step and
deep-copies the list on resampling. `LLAMPPL_ON_HANDLES` is the change that puts a handle
there instead, three lines of its source, applied at run time by `patched` (each line
found once in the installed source and replaced; nothing else of LLaMPPL is copied): its
SMC programs then run on handles (a deep copy of a handle is the handle) with the same
particles, weights and rows as on lists. genlm-bytes 0.2.0 builds ``context + [token]``
already: given a handle as its initial context it runs unchanged, with the same beams.
"""

import inspect
import sys
import textwrap

import numpy as np
import pytest

if sys.version_info < (3, 11):
    pytest.skip("genlm-bytes needs Python >= 3.11", allow_module_level=True)

import test_clients as clients
from genlm.bytes import BeamParams, ByteBeamState
from genlm.bytes.byte_lm.lm_state import StatefulTokenizedLM
from llamppl import CachedCausalLM, smc_standard, smc_steer
from llamppl.distributions.lmcontext import LMContext, LMNextToken

from genlm.backend.llm import MockAsyncLM, PrefixHandle

# The client's change: (function, [(line, its replacement)]).
LLAMPPL_ON_HANDLES = [
    (
        LMContext._init_common,
        [
            (
                "self.tokens = lm.tokenizer.encode(prompt)",
                "self.tokens = lm.model.handle(lm.tokenizer.encode(prompt))",
            )
        ],  # noqa: E501
    ),
    (
        LMNextToken.log_prob,
        [("self.ctx.tokens.append(x)", "self.ctx.tokens = self.ctx.tokens + [x]")],
    ),  # noqa: E501
    (
        LMNextToken.sample,
        [("self.ctx.tokens.append(token_id)", "self.ctx.tokens = self.ctx.tokens + [token_id]")],  # noqa: E501
    ),
]


def patched(function, replacements):
    """``function`` compiled again from its installed source with each line of
    ``replacements`` replaced (each found exactly once), in its own module's globals."""
    source = textwrap.dedent(inspect.getsource(function))
    for line, replacement in replacements:
        assert source.count(line) == 1, f"{function.__qualname__}: {line!r}"
        source = source.replace(line, replacement)
    namespace = {}
    code = compile(source, inspect.getsourcefile(function), "exec")
    exec(code, function.__globals__, namespace)  # noqa: S102 (the installed source, one line changed)
    return namespace[function.__name__]


@pytest.fixture
def llamppl_on_handles(monkeypatch):
    for function, replacements in LLAMPPL_ON_HANDLES:
        owner = LMContext if function.__qualname__.startswith("LMContext.") else LMNextToken
        monkeypatch.setattr(owner, function.__name__, patched(function, replacements))


@pytest.fixture
def mock(smollm2_tokenizer):
    with MockAsyncLM(smollm2_tokenizer) as lm:
        yield lm


def requests_of(lm, monkeypatch):
    """The kinds of token ids ``lm`` is asked for (a handle or a list)."""
    kinds = []
    query = type(lm)._query

    def recorded(self, token_ids, lora_name=None):
        kinds.append(PrefixHandle if isinstance(token_ids, PrefixHandle) else type(token_ids))
        return query(self, token_ids, lora_name)

    monkeypatch.setattr(type(lm), "_query", recorded)
    return kinds


async def run_smc(lm, smc, *args):
    np.random.seed(3)
    model = clients.NoLetter(CachedCausalLM(lm), clients.PROMPT, "e", 6)
    particles = await smc(model, *args)
    return [
        (
            list(map(int, p.context.tokens)),
            p.weight,
            [(list(map(int, a)), b) for a, b in p.observed],
        )
        for p in particles
    ]


@pytest.mark.parametrize("smc, args", [(smc_standard, (8, 0.5)), (smc_steer, (4, 3))])
async def test_llamppl_runs_the_same_smc_on_handles(
    smc, args, smollm2_tokenizer, monkeypatch, request
):
    with MockAsyncLM(smollm2_tokenizer) as lm:
        on_lists = await run_smc(lm, smc, *args)
    request.getfixturevalue("llamppl_on_handles")
    with MockAsyncLM(smollm2_tokenizer) as lm:
        kinds = requests_of(lm, monkeypatch)
        on_handles = await run_smc(lm, smc, *args)
    assert on_handles == on_lists
    assert kinds and set(kinds) == {PrefixHandle}  # every request of the run was a handle


@pytest.mark.usefixtures("llamppl_on_handles")
async def test_llamppl_client_tests_pass_on_handles(mock):
    """The client suite's LLaMPPL checks (each particle's tokens, weights and every
    ``observe`` against the reference rows), with LLaMPPL on handles."""
    await clients.test_llamppl_smc_standard_weights_are_the_lms_masses(mock)
    await clients.test_llamppl_smc_steer_draws_and_weighs_by_the_lm(mock)
    np.random.seed(0)
    model = clients.NoLetter(CachedCausalLM(mock), clients.PROMPT, "e", 3)
    assert isinstance(model.context.tokens, PrefixHandle)
    copied = (await smc_standard(model, 2, ess_threshold=1.0))[0].context  # resampled
    assert isinstance(copied.tokens, PrefixHandle)


async def beam_run(lm):
    """A byte beam after a prefill, and after a few more bytes: its weights, contexts and
    next-byte distributions."""
    text = b"Hello, wor"
    beam = await ByteBeamState.initial(lm, BeamParams(K=4))
    try:
        first = (await beam.logp_next()).ps
        beam = await beam.prefill(text)
        after = (await beam.logp_next()).ps
        beam = await (beam.prune() << ord("l"))
        states = [(state.weight, list(state.lm_state.context), state.partial) for state in beam]
        contexts = [state.lm_state.context for state in beam]
    finally:
        await beam.cleanup()
    return first, after, states, contexts


async def test_genlm_bytes_runs_unchanged_from_a_handle(mock, monkeypatch):
    first, after, states, _ = await beam_run(mock)
    initial = StatefulTokenizedLM.initial.__func__

    def from_a_handle(cls, model, initial_context=None, max_context_length=None):
        context = model.handle([model.tokenizer.bos_token_id])
        return initial(cls, model, context, max_context_length)

    monkeypatch.setattr(StatefulTokenizedLM, "initial", classmethod(from_a_handle))
    kinds = requests_of(mock, monkeypatch)
    on_handles = await beam_run(mock)
    np.testing.assert_array_equal(on_handles[0], first)
    np.testing.assert_array_equal(on_handles[1], after)
    assert on_handles[2] == states
    assert all(isinstance(context, PrefixHandle) for context in on_handles[3])
    assert kinds and set(kinds) == {PrefixHandle}

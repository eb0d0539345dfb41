"""A decode step of particles holding `PrefixHandle` s does host work that does not grow with
their context (issue 47), and handles leave nothing behind.

Python calls (``sys.setprofile``: every Python and C function call, on the caller's thread
and the batcher's worker) and the peak of the bytes Python allocates (``tracemalloc``) are
taken over one decode step of 128 particles, each extending its own handle by a token: on
the mock and on `AsyncTransformer` (a tiny random Llama), at contexts of 64 and 4,096
tokens. The counts must be equal, and the peaks within what a few ints take (ints above
256 are objects); on HF the peaks are taken outside its runner's forward, whose step inputs
address the shared prefix's KV (an array of the context's length per step). No timing.
"""

import asyncio
import collections
import gc
import random
import sys
import tracemalloc

import pytest

from genlm.backend.llm import MockAsyncLM

PARTICLES = 128
STEPS = 4  # the last one is measured; steps stay within one block of 16 tokens


def measured_step(lm, prompt_length, resample=False):
    """Calls by name and peak bytes of the last of `STEPS` decode steps after the prompt:
    a ``batch_next_token_logprobs_sync`` of every particle's handle extended by a token
    (with ``resample``, particles first drawn from the step before's, so that children of
    one handle fork)."""
    draws = random.Random(0)  # the same draws at every context length
    prompt = [random.Random(prompt_length).randrange(lm.vocab_size) for _ in range(prompt_length)]
    start = lm.handle(prompt)
    lm.next_token_logprobs_sync(start)
    contexts = [start] * PARTICLES
    calls: collections.Counter = collections.Counter()

    def count(frame, event, arg):
        if event == "call":
            calls[frame.f_code.co_name] += 1
        elif event == "c_call":
            calls["C " + getattr(arg, "__name__", "?")] += 1

    outside = RunnerExcluded(lm)
    for step in range(STEPS):
        if resample:
            contexts = [contexts[draws.randrange(PARTICLES)] for _ in range(PARTICLES)]
        contexts = [c + [draws.randrange(lm.vocab_size)] for c in contexts]
        if step < STEPS - 1:
            lm.batch_next_token_logprobs_sync(contexts)
            continue
        gc.collect()
        lm.batcher.run_sync(sys.setprofile, count)  # the worker's calls too
        tracemalloc.start()
        sys.setprofile(count)
        try:
            lm.batch_next_token_logprobs_sync(contexts)
        finally:
            sys.setprofile(None)
            outside.peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            lm.batcher.run_sync(sys.setprofile, None)
    return calls, max(outside.peaks)


class RunnerExcluded:
    """The peaks of traced memory outside a `PrefixCachedLM`'s runner (its forward): the
    peak up to each ``run``, then forgotten from its start to its end (what it returns, a
    torch tensor, is not traced); none for an LM without a runner (the mock)."""

    def __init__(self, lm):
        self.peaks = []
        runner = getattr(lm, "runner", None)
        if runner is None:
            return
        run = runner.run

        def excluded(rows):
            if not tracemalloc.is_tracing():
                return run(rows)
            self.peaks.append(tracemalloc.get_traced_memory()[1])
            try:
                return run(rows)
            finally:
                tracemalloc.reset_peak()

        runner.run = excluded


def mock_lm(tokenizer):
    return MockAsyncLM(tokenizer, batch_size=PARTICLES)


def hf_lm(tokenizer):
    from small_models import tiny_llama

    from genlm.backend.llm.hf import AsyncTransformer

    model = tiny_llama(len(tokenizer), max_positions=4096 + 32)
    return AsyncTransformer(model, tokenizer, batch_size=PARTICLES)


def compare(make, tokenizer, resample=False):
    """(calls at 64 tokens, at 4,096), (peak bytes at 64, at 4,096)."""
    measured = []
    for length in (64, 4096):
        with make(tokenizer) as lm:
            measured.append(measured_step(lm, length, resample))
    (short, short_peak), (long, long_peak) = measured
    return (short, long), (short_peak, long_peak)


def grown(short, long):
    return {
        name: (short[name], long[name]) for name in {*short, *long} if short[name] != long[name]
    }


@pytest.mark.parametrize("make", [mock_lm, hf_lm], ids=["mock", "hf"])
def test_a_step_with_handles_makes_the_same_calls_at_4096_tokens_of_context_as_at_64(
    make, smollm2_tokenizer
):
    (short, long), _ = compare(make, smollm2_tokenizer)
    assert sum(short.values()) > 1000  # the step was counted
    assert not grown(short, long)
    assert long["validate_token_ids"] == 0  # nothing validated again


# Ints above 256 are objects of their own (a node's depth, a handle's length): a few per
# particle at 4,096 tokens that are shared small ints at 64.
INT_BYTES = 4 * 32 * PARTICLES


@pytest.mark.parametrize("make", [mock_lm, hf_lm], ids=["mock", "hf"])
def test_a_step_with_handles_allocates_as_much_at_4096_tokens_of_context_as_at_64(
    make, smollm2_tokenizer
):
    """On HF, outside its runner's forward (`RunnerExcluded`: its step inputs hold the
    shared prefix's KV slots, an array of the context's length per step)."""
    _, (short, long) = compare(make, smollm2_tokenizer)
    assert abs(long - short) <= INT_BYTES, (short, long)


@pytest.mark.parametrize("make", [mock_lm, hf_lm], ids=["mock", "hf"])
def test_forks_of_one_handle_make_as_many_calls_at_4096_tokens_as_at_64(make, smollm2_tokenizer):
    """With resampling (several children of one handle, their KV copied on write), the calls
    are the same but for a few of the pool's (its blocks are handed out in another order)."""
    (short, long), _ = compare(make, smollm2_tokenizer, resample=True)
    changed = grown(short, long)
    excess = sum(abs(b - a) for a, b in changed.values())
    assert excess <= 20, changed


# -- nothing left behind -----------------------------------------------------------------------


async def each_awaits_its_row(lm, particles):
    await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))


def test_100000_handles_leave_nothing_behind(smollm2_tokenizer):
    """100,000 handles made, extended, shared (resampled), sent as requests and dropped:
    once collected, the index of validated prefixes is as it was and Python holds no more
    memory than before (within the batcher's bounded statistics)."""
    rng = random.Random(0)
    with MockAsyncLM(smollm2_tokenizer, batch_size=256) as lm:
        index = lm._prefixes
        lm.next_token_logprobs_sync([1, 2, 3])  # the LM's first-call allocations
        asyncio.run(lm.next_token_logprobs(lm.handle([1, 2, 3]) + [4]))
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        entries = (dict(index._current), dict(index._previous))
        made = 0
        particles = [lm.handle([rng.randrange(lm.vocab_size) for _ in range(300)])] * 100
        while made < 100_000:
            particles = [particles[rng.randrange(100)] for _ in range(100)]  # shared
            particles = [p + [rng.randrange(lm.vocab_size)] for p in particles]
            made += len(particles)
            lm.batch_next_token_logprobs_sync(particles)
            if made % 10_000 == 0:
                asyncio.run(each_awaits_its_row(lm, particles))
        del particles
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert (dict(index._current), dict(index._previous)) == entries
        assert after - before <= 64 * 1024, (before, after)

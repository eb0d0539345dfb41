"""TokenSampler: tokens follow the rows' distributions, one batch a step, one host copy a batch."""

import asyncio
import math
from collections import Counter

import numpy as np
import pytest
import torch
from op_count import OpCounter

from genlm.backend.sampling import TokenSampler, check_sampling_args, sample_rows

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03, 0.0], dtype=torch.float64)
LOGPROBS = PROBS.log().float()  # the last token is impossible (-inf)


def chi_square(tokens, probs):
    """Pearson's statistic of ``tokens`` against ``probs`` over the possible tokens."""
    counts = Counter(tokens)
    assert set(counts) <= {i for i, p in enumerate(probs) if p > 0}
    n = len(tokens)
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)


# 6 possible tokens, 5 degrees of freedom: P(chi2 > 30) < 2e-5.
CHI2_LIMIT = 30.0


async def sample_many(sampler, rows, steps):
    """``steps`` rounds of concurrent ``sample`` calls, one per row: the README's pattern."""
    tokens = []
    for _ in range(steps):
        tokens += await asyncio.gather(*(sampler.sample(row) for row in rows))
    return tokens


async def test_tokens_follow_the_rows_distribution():
    with TokenSampler(seed=0) as sampler:
        tokens = await sample_many(sampler, [LOGPROBS] * 500, 40)
        assert list(sampler.batcher.batch_sizes) == [500] * 40
    assert chi_square(tokens, PROBS.tolist()) < CHI2_LIMIT


@pytest.mark.parametrize("temperature", [0.5, 2.0])
async def test_tokens_follow_the_tempered_distribution(temperature):
    tempered = torch.softmax(PROBS.log() / temperature, 0).tolist()
    with TokenSampler(seed=1, temperature=temperature) as sampler:
        tokens = await sample_many(sampler, [LOGPROBS] * 500, 40)
    assert chi_square(tokens, tempered) < CHI2_LIMIT


async def test_a_tiny_temperature_gives_the_greedy_token():
    with TokenSampler(seed=2, temperature=5e-324) as sampler:
        rows = [LOGPROBS, LOGPROBS.flip(0)]
        assert await sample_many(sampler, rows, 50) == [0, 6] * 50


async def test_same_seed_same_tokens_and_rows_are_sampled_independently():
    rows = [LOGPROBS] * 64
    with TokenSampler(seed=7) as a, TokenSampler(seed=7) as b, TokenSampler(seed=8) as c:
        first, again, other = [await sample_many(s, rows, 5) for s in (a, b, c)]
    assert first == again
    assert first != other
    assert len(set(first[:64])) > 1  # equal rows in one batch get their own draws


async def test_rows_on_different_vocabularies_share_a_batch():
    short = torch.tensor([0.0, -math.inf])
    with TokenSampler(seed=3) as sampler:
        tokens = await asyncio.gather(sampler.sample(short), sampler.sample(LOGPROBS))
    assert tokens[0] == 0 and 0 <= tokens[1] < 6


def test_a_batch_is_the_same_ops_at_any_size_with_no_scalar_sync():
    """Per-row ``.item()`` shows as one ``_local_scalar_dense`` per row (a host sync each
    on a GPU); a batch has none, and the same ops for 2 rows as for 64."""
    counts = []
    for rows in (2, 64):
        batch = [torch.randn(1000) for _ in range(rows)]
        with OpCounter() as counted:
            tokens = sample_rows(batch, 1.0, torch.Generator().manual_seed(0))
        assert len(tokens) == rows
        assert counted.counts["aten._local_scalar_dense.default"] == 0
        counts.append(counted.counts)
        with OpCounter() as per_row:
            [torch.multinomial(row.exp(), 1).item() for row in batch]
        assert (
            per_row.counts["aten._local_scalar_dense.default"] == rows
        )  # what the README loop did
    assert counts[0] == counts[1]


def test_sample_rows_matches_an_independent_gumbel_max():
    batch = [torch.randn(50, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    tokens = sample_rows(batch, 0.7, torch.Generator().manual_seed(4))
    uniform = torch.rand(8, 50, generator=torch.Generator().manual_seed(4)).double()
    scores = torch.stack(batch).double() / 0.7 - (-uniform.log()).log()
    assert tokens == scores.argmax(1).tolist()


async def test_bad_rows_fail_their_caller_alone():
    with TokenSampler(seed=5) as sampler:
        for bad, error, match in [
            ([0.0, 1.0], TypeError, "floating-point torch tensor, got list"),
            (torch.tensor([1, 2]), TypeError, "got torch.int64"),
            (torch.zeros(2, 3), ValueError, r"one non-empty row, got shape \(2, 3\)"),
            (torch.zeros(0), ValueError, r"got shape \(0,\)"),
        ]:
            with pytest.raises(error, match=match):
                sampler.sample(bad)
        nan = torch.tensor([0.0, math.nan, -1.0])
        inf = torch.tensor([0.0, math.inf])
        impossible = torch.full((3,), -math.inf)
        results = await asyncio.gather(
            *(sampler.sample(row) for row in (nan, LOGPROBS, inf, impossible)),
            return_exceptions=True,
        )
    assert 0 <= results[1] < 6
    for failed in (results[0], results[2], results[3]):
        assert isinstance(failed, ValueError) and "finite largest entry" in str(failed)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"seed": -1}, ValueError, r"seed must be in \[0, 2\*\*63\)"),
        ({"seed": 2**63}, ValueError, r"seed must be in \[0, 2\*\*63\)"),
        ({"seed": 1.5}, TypeError, "seed must be an int or None"),
        ({"temperature": 0}, ValueError, "temperature must be a finite number > 0"),
        ({"temperature": math.nan}, ValueError, "temperature must be a finite number > 0"),
        ({"temperature": "1"}, TypeError, "temperature must be a real number"),
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        TokenSampler(**kwargs)


def test_numpy_rows_are_not_tensors():
    with TokenSampler() as sampler, pytest.raises(TypeError, match="got float32"):
        sampler.sample(np.zeros(3, np.float32))


# Temperatures: every real number (Python's or numpy's) that is finite and > 0, nothing else.
GOOD_TEMPERATURES = [0.5, 2, np.float32(0.7), np.float64(0.7), np.float16(1.5), np.int64(3)]
BAD_TEMPERATURES = [
    (True, TypeError),
    (np.bool_(True), TypeError),
    (np.complex64(1), TypeError),
    ("1", TypeError),
    (torch.tensor(1.0), TypeError),
    (0, ValueError),
    (-1.0, ValueError),
    (np.float32("nan"), ValueError),
    (np.float64("inf"), ValueError),
    (10**400, ValueError),  # an int beyond float's range: not an OverflowError
]


@pytest.mark.parametrize("temperature", GOOD_TEMPERATURES, ids=repr)
async def test_any_real_temperature_is_accepted_and_drawn_with_as_its_float(temperature):
    """As by `AsyncLM.sample`; a numpy float32 draws what the same float does."""
    check_sampling_args(1, temperature)
    rows = [LOGPROBS] * 64
    with TokenSampler(seed=4, temperature=temperature) as given:
        with TokenSampler(seed=4, temperature=float(temperature)) as as_float:
            assert given.temperature == float(temperature)
            drawn = await asyncio.gather(*(given.sample(row) for row in rows))
            assert drawn == await asyncio.gather(*(as_float.sample(row) for row in rows))


@pytest.mark.parametrize("temperature, error", BAD_TEMPERATURES, ids=repr)
def test_a_bad_temperature_is_refused_as_sample_refuses_it(temperature, error):
    with pytest.raises(error, match="temperature must be a") as by_sample:
        check_sampling_args(1, temperature)
    with pytest.raises(error) as by_sampler:
        TokenSampler(temperature=temperature)
    assert str(by_sampler.value) == str(by_sample.value)


async def test_a_row_is_read_when_its_batch_runs_not_when_sample_is_called():
    """As documented: ``sample`` keeps the row, not a copy (no kernel per particle on a GPU),
    so the draw follows the row as it is when the batch runs."""
    row = torch.tensor([0.0, -math.inf, -math.inf])
    with TokenSampler(seed=0) as sampler:
        pending = asyncio.ensure_future(sampler.sample(row))
        row.copy_(torch.tensor([-math.inf, 0.0, -math.inf]))  # the batch has not run yet
        assert await pending == 1

"""`prove_fast_path`: at construction, the LM's steps proven on the model in hand.

The family rules (`genlm.backend.llm.hf.families`) and `use_cascade` judge a model by its
config and modules. What they cannot see (a decoder layer that drops attention's keyword
arguments, remote code, a new transformers release) can still make the steps' rows wrong.
So a few short forwards (`PROBE_FORWARDS`) run through the path the LM's steps take
(`TransformerRunner.run` over a scratch `PrefixKVStore` on the LM's own pool, freed after)
and through the model's own uncached forward (`ModelForward.uncached_rows`). Where the rows
differ by more than rounding allows (`Tolerance`), the LM steps down, with one warning
naming the reason: no cascade attention, then each request's whole prefix. The verdict is
kept per model object and path (`VERDICTS`): the LMs built over one model probe it once.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from genlm.backend.kv.store import PrefixKVStore
from genlm.backend.llm.hf.step import CASCADE_MIN_SHARED

if TYPE_CHECKING:
    from genlm.backend.llm.hf.runner import TransformerRunner

# The prompt two probe contexts share: the cascade's shared minimum and a few tokens more,
# then each context's own tokens.
SHARED_TOKENS = CASCADE_MIN_SHARED + 4
OWN_TOKENS = 4
CONTEXT_TOKENS = SHARED_TOKENS + OWN_TOKENS
# Forwards of a probe that finds the steps right: three steps (the prompt's prefill, then
# two steps of two rows each) and two references (one context alone, both batched).
PROBE_FORWARDS = 3 + 2


@dataclass(frozen=True)
class ProbeRows:
    """Two contexts sharing a prompt (``first``, ``second``), and the probe's three steps
    over their prefixes, as (context, length) pairs: the prompt alone (a prefill), then
    two steps of rows sharing the prompt's first `CASCADE_MIN_SHARED` tokens (cascade
    attention reads them once, where the LM runs it) from different cached lengths
    (left-padded), by one new token, then by three."""

    first: tuple[int, ...]
    second: tuple[int, ...]

    @classmethod
    def draw(cls, vocab_size: int) -> ProbeRows:
        """Random tokens (seeded) of the tokenizer's vocabulary."""
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab_size, (SHARED_TOKENS + 2 * OWN_TOKENS,), generator=generator)
        prompt, own = ids[:SHARED_TOKENS].tolist(), ids[SHARED_TOKENS:].tolist()
        return cls(tuple(prompt + own[:OWN_TOKENS]), tuple(prompt + own[OWN_TOKENS:]))

    @property
    def steps(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Each step's rows: (context: 0 first, 1 second; the row's prefix length). The
        store starts each row from the deepest KV it holds on its path: the second step's
        rows from 68 and 66 tokens (a prefix of the cached prompt), the third's from 68
        and 69."""
        return (
            ((0, SHARED_TOKENS),),
            ((1, SHARED_TOKENS + 1), (0, SHARED_TOKENS - 1)),
            ((0, SHARED_TOKENS + 3), (1, SHARED_TOKENS + 4)),
        )


@dataclass(frozen=True)
class Tolerance:
    """How far the steps' rows may lie from the model's uncached forward (the largest
    difference of logprobs over the vocabulary, `row_difference`): `NOISE_FACTOR` times
    the model's own batch noise (the same context batched and alone: on a GPU its kernels
    differ with the batch), at least `EPSILONS` rounding steps of the dtype at the rows'
    largest magnitude (on a CPU half-precision batches round alike, while our steps'
    attention rounds differently: on SmolLM2 the probe's rows differ by 0.35 in bfloat16,
    within 1.22, and 0.039 in float16, within 0.15), and at least `MINIMUM` (4.4e-5 in
    float32). The faults the probe is for differ by far more in every dtype: a cascade
    that ignores the shared prompt by 13.5, positions off by one by 2.5."""

    NOISE_FACTOR = 4
    EPSILONS = 5
    MINIMUM = 1e-3

    value: float

    @classmethod
    def measure(cls, dtype: torch.dtype, alone: torch.Tensor, batched: torch.Tensor) -> Tolerance:
        """From rows of the model's forward ``alone`` and the same rows ``batched``."""
        noise = max(map(row_difference, batched, alone))
        scale = float(alone[alone.isfinite()].abs().max())
        rounding = cls.EPSILONS * torch.finfo(dtype).eps * scale
        return cls(max(cls.NOISE_FACTOR * noise, rounding, cls.MINIMUM))


def row_difference(row: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest difference between two rows of logprobs (equal infinities agree; a NaN
    lies infinitely far)."""
    difference = torch.where(row == reference, 0.0, (row - reference).abs())
    return float(difference.nan_to_num(nan=float("inf")).max())


@dataclass(frozen=True)
class Verdict:
    """What a probe found wrong: with cascade attention (``cascade``), and without KV
    reuse's steps (``steps``; then each request runs its whole prefix); None: right."""

    cascade: str | None = None
    steps: str | None = None


# Each model object's verdicts, by path: (KV layout, cascade, most tokens per forward,
# attention implementation). A model no LM serves is collected with its verdicts.
VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[object, ...], Verdict]] = (
    weakref.WeakKeyDictionary()
)


def prove_fast_path(runner: TransformerRunner) -> None:
    """Check the runner's steps against the model's uncached forward (once per model
    object and path), stepping down where they differ (`ModelForward.step_down`), with
    one warning: without cascade attention where its rows are right so, else without KV
    reuse (the store's `NoKVPool` then warns). Nothing is run without KV reuse, nor for a
    model whose context is shorter than the probe's. Before the LM's store is made: the
    probe's own store lets go of the pool's memory."""
    forward = runner.forward
    model, pool = forward.model, runner.pool
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if pool is None or (context is not None and context < CONTEXT_TOKENS):
        return
    path = (pool.layout, runner.cascade, runner.max_batch_tokens, forward.attention)
    verdicts = VERDICTS.setdefault(model, {})
    verdict = verdicts.get(path)
    if verdict is None:
        verdict = verdicts[path] = probe(runner)
    if verdict.steps is not None:
        forward.step_down(
            kv_reuse=False, reason=f"the probe of its paged step found {verdict.steps}"
        )
        runner.pool, runner.cascade = None, False
    elif verdict.cascade is not None:
        forward.step_down(kv_reuse=True)
        runner.cascade = False
        warnings.warn(
            f"cascade attention is off for this model (with it, {verdict.cascade}): its "
            "steps run without it",
            stacklevel=4,
        )


def probe(runner: TransformerRunner) -> Verdict:
    """Run the probe: its steps with the runner's path (and without cascade attention,
    where they are wrong with it), against the model's uncached forward."""
    forward = runner.forward
    assert runner.pool is not None  # probed with KV reuse
    rows = ProbeRows.draw(forward.vocab_size)
    last = CONTEXT_TOKENS + 1 - min(length for step in rows.steps for _, length in step)
    alone = forward.uncached_rows([rows.first], None, last)[0]
    batched = forward.uncached_rows([rows.first, rows.second], None, last)
    tolerance = Tolerance.measure(runner.pool.layout.dtype, alone, batched[0])
    references = (alone, batched[1])
    fault = step_fault(runner, rows, references, tolerance)
    if fault is None or not runner.cascade:
        return Verdict(steps=fault)
    runner.cascade = False
    without = step_fault(runner, rows, references, tolerance)
    runner.cascade = True
    if without is None:
        return Verdict(cascade=fault)
    return Verdict(fault, f"with cascade attention, {fault}; without, {without}")


def step_fault(
    runner: TransformerRunner,
    rows: ProbeRows,
    references: Sequence[torch.Tensor],
    tolerance: Tolerance,
) -> str | None:
    """What is wrong with the rows of the runner's steps over ``rows`` (a scratch store on
    its pool, freed after), against ``references`` (each context's logprobs after its
    last positions): too far from them, or an error; None where they are right."""
    pool = runner.pool
    assert pool is not None  # probed with KV reuse
    contexts = (rows.first, rows.second)
    store = PrefixKVStore(pool)
    worst = 0.0
    try:
        for step in rows.steps:
            plan = store.plan([(contexts[i][:length], None) for i, length in step], 0)
            try:
                out = runner.run(plan.rows)
            except Exception as error:
                store.release(plan)
                return f"its steps fail: {type(error).__name__}: {error}"
            store.commit(plan, list(out.unbind()))
            for row, (i, length) in zip(out, step, strict=True):
                reference = references[i][length - CONTEXT_TOKENS - 1]
                worst = max(worst, row_difference(row, reference))
    finally:
        store.free()
        if runner.forward.head is not None:
            runner.forward.head.free()
    if worst <= tolerance.value:
        return None
    return (
        f"its rows differ from its uncached forward by {worst:.3g}, beyond the "
        f"{tolerance.value:.3g} its dtype's rounding and batch noise allow"
    )

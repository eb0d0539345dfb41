"""`prove_fast_path`: at construction, the LM's steps proven on the model in hand.

The family rules (`genlm.backend.llm.hf.families`) and `use_cascade` judge a model by its
config and modules. What they cannot see (a decoder layer that drops attention's keyword
arguments, remote code, a new transformers release) can still make the steps' rows wrong.
So a few short forwards (`PROBE_FORWARDS`) run through the path the LM's steps take
(`TransformerRunner.run` over a scratch `PrefixKVStore` on the LM's own pool, freed after)
and through the model's own uncached forward (`ModelForward.uncached_rows`). Where the rows
differ by more than rounding allows (`Tolerance`), the LM steps down, with one warning
naming the reason: no cascade attention, then each request's whole prefix.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from genlm.backend.kv.store import PrefixKVStore
from genlm.backend.llm.hf.step import CASCADE_MIN_SHARED

if TYPE_CHECKING:
    from genlm.backend.llm.hf.runner import TransformerRunner

# The probe's prompt: the cascade's shared minimum and one more block.
PROMPT_TOKENS = CASCADE_MIN_SHARED + 16
NEW_TOKENS = 3  # a multi-token extension's
# Forwards of a probe that finds the steps right: its two steps (a prefill, then one
# forward per number of new tokens) and the references (one per row, and one batch).
PROBE_FORWARDS = 1 + 2 + 5 + 1


@dataclass(frozen=True)
class ProbeRows:
    """The probe's contexts: a prompt, run alone (a prefill), then one step of rows
    extending it from different cached lengths (all past the cascade's shared minimum), by
    one new token and by `NEW_TOKENS`: the rows of a step are left-padded, and share the
    prompt's first blocks (read once, where the LM runs cascade attention)."""

    prompt: tuple[int, ...]
    extensions: tuple[tuple[int, ...], ...]

    @classmethod
    def draw(cls, vocab_size: int) -> ProbeRows:
        """Random tokens (seeded) of the tokenizer's vocabulary."""
        generator = torch.Generator().manual_seed(0)
        more = 2 + 2 * NEW_TOKENS
        ids = torch.randint(0, vocab_size, (PROMPT_TOKENS + more,), generator=generator)
        prompt, new = tuple(ids[:PROMPT_TOKENS].tolist()), tuple(ids[PROMPT_TOKENS:].tolist())
        one, two, three, four = (
            new[:1],
            new[1:2],
            new[2 : 2 + NEW_TOKENS],
            new[2 + NEW_TOKENS :],
        )
        return cls(
            prompt,
            (
                prompt + one,
                prompt[: CASCADE_MIN_SHARED + 8] + two,
                prompt + three,
                # as long as the first: with it, a batch of the model's own
                prompt[: PROMPT_TOKENS + 1 - NEW_TOKENS] + four,
            ),
        )

    @property
    def contexts(self) -> tuple[tuple[int, ...], ...]:
        return (self.prompt, *self.extensions)

    @property
    def same_length(self) -> tuple[int, int]:
        """Two contexts of one length (positions in `contexts`)."""
        return 1, 4


@dataclass(frozen=True)
class Tolerance:
    """How far the steps' rows may lie from the model's uncached forward (the largest
    difference of logprobs over the vocabulary, `row_difference`): `NOISE_FACTOR` times
    the model's own batch noise (the same rows batched and alone: on a GPU its kernels
    differ with the batch), and at least `EPSILONS` rounding steps of the dtype at the
    rows' largest magnitude (on a CPU half-precision batches round alike, and our steps'
    attention rounds differently: measured 0.30 in bfloat16 on SmolLM2, 0.05 in float16),
    and at least `MINIMUM` (float32 rows differ by up to 3e-5 on SmolLM2). A fault the
    probe is for differs by far more: a cascade that ignores the shared prompt by 7 or
    more, positions off by one by 0.7 to 2.3, in any dtype."""

    NOISE_FACTOR = 4
    EPSILONS = 5
    MINIMUM = 1e-3

    value: float
    noise: float

    @classmethod
    def measure(
        cls, dtype: torch.dtype, references: Sequence[torch.Tensor], batched: Sequence[torch.Tensor]
    ) -> Tolerance:
        """From ``references`` (rows alone) and the same rows ``batched``."""
        noise = max(row_difference(b, r) for b, r in zip(batched, references, strict=True))
        scale = max(float(row[row.isfinite()].abs().max()) for row in references)
        rounding = cls.EPSILONS * torch.finfo(dtype).eps * scale
        return cls(max(cls.NOISE_FACTOR * noise, rounding, cls.MINIMUM), noise)


def row_difference(row: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest difference between two rows of logprobs (equal infinities agree; a NaN
    lies infinitely far)."""
    difference = torch.where(row == reference, 0.0, (row - reference).abs())
    return float(difference.nan_to_num(nan=float("inf")).max())


def prove_fast_path(runner: TransformerRunner) -> None:
    """Check the runner's steps against the model's uncached forward, stepping down where
    they differ (`ModelForward.step_down`), with one warning: without cascade attention if
    its rows are right so, else without KV reuse (the store's `NoKVPool` then warns).
    Nothing is run without KV reuse, nor for a model whose context is shorter than the
    probe."""
    forward = runner.forward
    context = getattr(forward.model.config.get_text_config(), "max_position_embeddings", None)
    if runner.pool is None or (context is not None and context < PROMPT_TOKENS + NEW_TOKENS):
        return
    rows = ProbeRows.draw(forward.vocab_size)
    references = [forward.uncached(ids, None) for ids in rows.contexts]
    same = [rows.contexts[i] for i in rows.same_length]
    batched = forward.uncached_rows(same, None).unbind()
    alone = [references[i] for i in rows.same_length]
    tolerance = Tolerance.measure(runner.pool.layout.dtype, alone, batched)
    fault = step_fault(runner, rows, references, tolerance)
    if fault is None:
        return
    if runner.cascade:
        forward.step_down(kv_reuse=True)
        runner.cascade = False
        without = step_fault(runner, rows, references, tolerance)
        if without is None:
            warnings.warn(
                f"cascade attention is off for this model (with it, {fault}): its steps run "
                "without it",
                stacklevel=4,
            )
            return
        fault = f"with cascade attention, {fault}; without, {without}"
    forward.step_down(kv_reuse=False, reason=f"the probe of its paged step found {fault}")
    runner.pool = None


def step_fault(
    runner: TransformerRunner,
    rows: ProbeRows,
    references: Sequence[torch.Tensor],
    tolerance: Tolerance,
) -> str | None:
    """What is wrong with the rows of the runner's steps over ``rows`` (a scratch store on
    its pool, freed after), against ``references``: too far from them, or an error; None
    where they are right."""
    pool = runner.pool
    assert pool is not None  # probed with KV reuse
    store = PrefixKVStore(pool)
    worst, done = 0.0, 0
    try:
        for contexts in ((rows.prompt,), rows.extensions):
            plan = store.plan([(ids, None) for ids in contexts], 0)
            try:
                out = runner.run(plan.rows)
            except Exception as error:
                store.release(plan)
                return f"its steps fail: {type(error).__name__}: {error}"
            store.commit(plan, list(out.unbind()))
            for row, reference in zip(out, references[done : done + len(out)], strict=True):
                worst = max(worst, row_difference(row, reference))
            done += len(out)
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

"""The README's autobatched sequential importance sampler, which the command line runs
(``python -m genlm.backend sis``).

Every particle is an asyncio task awaiting ``next_token_logprobs``; the library batches
their requests. Particles propose from the model at ``temperature`` and are weighted by
p/q towards the model itself, so at temperature 1 all weights are equal and other
temperatures show the reweighting at work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Particle:
    """One sample: its generated token ids and log importance weight."""

    token_ids: list[int] = field(default_factory=list)
    log_weight: float = 0.0
    finished: bool = False


async def run_sis(
    llm,
    prompt_ids: Sequence[int],
    n_particles: int,
    max_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    on_token=None,
) -> list[Particle]:
    """Sequential importance sampling with proposal ``p^(1/temperature)`` and target ``p``."""
    from genlm.backend.sampling import TokenSampler

    eos = {llm.tokenizer.eos_token_id} - {None}
    limit = llm.max_context_length
    sampler = TokenSampler(seed, temperature)  # the particles' draws: one kernel a step

    async def particle() -> Particle:
        state = Particle()
        for _ in range(max_tokens):
            prefix = list(prompt_ids) + state.token_ids
            if limit is not None and len(prefix) > limit:
                break  # the model's context is full: keep what was sampled
            logps = await llm.next_token_logprobs(prefix)
            proposal = proposal_logprobs(logps, temperature)
            token = await sampler.sample(logps)
            state.log_weight += float(logps[token] - proposal[token])
            if on_token is not None:
                on_token()
            if token in eos:
                state.finished = True
                break
            state.token_ids.append(token)
        return state

    with sampler:
        return list(await asyncio.gather(*(particle() for _ in range(n_particles))))


def proposal_logprobs(logps, temperature: float):
    """``log_softmax(logps / temperature)``, in float64 and from the top logprob, so that
    every finite temperature > 0 works (a tiny one puts all the mass on the top token, as
    the library's ``sample`` does; dividing float32 logprobs by it would give NaNs)."""
    import torch

    scores = logps.double()
    return torch.log_softmax((scores - scores.max()) / temperature, dim=-1)

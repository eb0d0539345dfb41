"""`TokenSampler`: the particles' next tokens, sampled together.

In the README's loop each particle samples its token from its own row of log-probabilities;
done one row at a time (``torch.multinomial(...).item()``) that is one kernel and one
device-to-host sync per particle per step, which on a GPU costs more than the step's
forward. A `TokenSampler` collects the concurrent ``await sampler.sample(row)`` calls the
way the LMs collect requests (the package's one `AutoBatcher`) and answers them with one
kernel per device and one device-to-host copy per batch (`sample_rows`).

Exact: a token is the argmax of its scaled log-probability plus Gumbel noise (the
Gumbel-max trick), which follows ``softmax(logprobs / temperature)``; scores are taken
relative to each row's largest, so a tiny temperature gives the greedy token.

`AsyncLM.sample` draws one particle's tokens in turn with `sample_token`. Both take their
arguments by the same rules (`check_temperature`, `check_seed`; `check_sampling_args` for
`sample`'s).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genlm.backend.batching import AutoBatcher, BatchResults
from genlm.backend.checks import SEED_LIMIT

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True, eq=False)
class _Row:
    """One caller's row; hashed by identity, so equal rows are still two draws."""

    logprobs: torch.Tensor


class TokenSampler:
    """Samples one token per awaited row, batching concurrent calls into one kernel.

    Args:
        seed: seeds one generator per device; the same seed gives the same tokens for the
            same rows awaited in the same order (batches form when the event loop has
            nothing else to run, never on a timer). None: seeded from the OS.
        temperature: tokens follow ``softmax(logprobs / temperature)``; any finite real
            number > 0 (checked as `AsyncLM.sample` checks its own: `check_temperature`).
        batch_size: most rows per batch.

    Use it from one event loop at a time; `close` (or ``with``) stops its worker thread.
    """

    def __init__(self, seed: int | None = None, temperature: float = 1.0, batch_size: int = 4096):
        check_seed(seed)
        self.seed = seed
        self.temperature = check_temperature(temperature)
        self._generators: dict[str, torch.Generator] = {}
        self.batcher: AutoBatcher[_Row, int] = AutoBatcher(
            self._sample_batch, batch_size, timeout=None, name="genlm-sampler"
        )

    def sample(self, logprobs: torch.Tensor) -> Coroutine[Any, Any, int]:
        """A token id drawn from ``logprobs`` (a 1-D float tensor on any device), batched
        with the concurrent calls: await the result. The row is read when its batch runs,
        not copied here (on a GPU a copy per particle is a kernel launch each): leave it
        unedited until the draw is awaited.

        Raises:
            TypeError: ``logprobs`` is not a floating-point torch tensor.
            ValueError: it is not 1-D and non-empty, or (when awaited) it has a NaN or
                +inf entry or no finite one.
        """
        import torch

        if not isinstance(logprobs, torch.Tensor) or not logprobs.dtype.is_floating_point:
            kind = getattr(logprobs, "dtype", type(logprobs).__name__)
            raise TypeError(f"logprobs must be a floating-point torch tensor, got {kind}")
        if logprobs.ndim != 1 or logprobs.shape[0] == 0:
            raise ValueError(
                f"logprobs must be one non-empty row, got shape {tuple(logprobs.shape)}"
            )
        return self.batcher.submit(_Row(logprobs.detach()))

    def _sample_batch(self, rows: list[_Row]) -> BatchResults[int]:
        """One `sample_rows` per (device, vocabulary size) among ``rows``, in order."""
        groups: dict[tuple[str, int], list[int]] = {}
        for index, row in enumerate(rows):
            key = (str(row.logprobs.device), row.logprobs.shape[0])
            groups.setdefault(key, []).append(index)
        answers: list[Any] = [0] * len(rows)  # a ValueError is its caller's answer
        for (device, _), indices in groups.items():
            tokens = sample_rows(
                [rows[i].logprobs for i in indices], self.temperature, self._generator(device)
            )
            for index, token in zip(indices, tokens, strict=True):
                answers[index] = token
        return answers

    def _generator(self, device: str) -> torch.Generator:

        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = seeded_generator(self.seed, device)
        return generator

    def close(self) -> None:
        """Stop the worker thread (a new one starts if the sampler is used again)."""
        self.batcher.pause()

    def __enter__(self) -> TokenSampler:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def sample_rows(
    rows: list[torch.Tensor], temperature: float, generator: torch.Generator
) -> list[int | ValueError]:
    """A token per row (rows of one length, on ``generator``'s device), by Gumbel-max: one
    kernel sequence for the batch and one device-to-host copy; a row with a NaN or +inf
    entry or no finite one gets a `ValueError` instead (found on the device, no sync)."""
    import torch

    scores = torch.stack([row.float() for row in rows])
    top = scores.amax(dim=1, keepdim=True)  # NaN if any entry is
    valid = torch.isfinite(top[:, 0])
    uniform = torch.rand(scores.shape, generator=generator, device=scores.device)
    noise = -torch.log(-torch.log(uniform))  # Gumbel(0, 1); uniform 0 gives -inf, never drawn
    tokens = ((scores - top) / temperature + noise).argmax(dim=1)
    answers, ok = torch.stack([tokens, valid.long()]).tolist()  # the one copy to the host
    return [
        token
        if good
        else ValueError(
            "logprobs must have a finite largest entry and no NaN or +inf to sample from"
        )
        for token, good in zip(answers, ok, strict=True)
    ]


def check_sampling_args(
    max_tokens: Any,
    temperature: Any,
    seed: Any = None,
    seeds: int = 1,
    *,
    max_temperature: float = math.inf,
) -> None:
    """Raise for a ``max_tokens`` that is not an int >= 0, a bad ``temperature``
    (`check_temperature`) or ``seed`` (`check_seed`)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral):
        raise TypeError(f"max_tokens must be an int, got {type(max_tokens).__name__}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    check_temperature(temperature, max_temperature)
    check_seed(seed, seeds)


def check_temperature(temperature: Any, max_temperature: float = math.inf) -> float:
    """``temperature`` as a float, if it is a real number (a Python or numpy int or float,
    never a bool) that is finite and in ``(0, max_temperature]``; else `TypeError` /
    `ValueError` naming it. Any finite temperature > 0 works with `sample_token` and
    `sample_rows`, which scale from the top score; an engine's own sampler may accept fewer
    (`AsyncLM.max_temperature`)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}")
    try:
        value = float(temperature)
    except OverflowError:  # an int beyond float's range
        value = math.inf
    if not (math.isfinite(value) and 0 < value <= max_temperature):
        allowed = "> 0" if max_temperature == math.inf else f"in (0, {max_temperature}]"
        raise ValueError(f"temperature must be a finite number {allowed}, got {temperature}")
    return value


def check_seed(seed: Any, seeds: int = 1) -> None:
    """Raise unless ``seed`` is None or an int (Python or numpy, never a bool) with
    ``seed + seeds - 1`` in ``[0, 2**63)`` (``seeds`` prompts use ``seed + i``)."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if not 0 <= int(seed) <= SEED_LIMIT - max(seeds, 1):
        which = "" if seeds <= 1 else f" (prompt i uses seed + i, for {seeds} prompts)"
        raise ValueError(f"seed must be in [0, 2**63){which}, got {seed}")


def seeded_generator(seed: int | None, device: str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (None: from the system's entropy)."""
    import torch

    generator = torch.Generator(device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


def sample_token(logprobs: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """One token from ``softmax(logprobs / temperature)``. Scaled in float64 after subtracting
    the largest logprob, so the top token stays at 0 and a tiny temperature (down to the
    smallest positive float) gives the greedy token rather than inf or nan."""
    import torch

    scores = logprobs.detach().double().cpu()
    probs = torch.softmax((scores - scores.max()) / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())

